"""A kernels package that declares one name twice, which ``load_kernels`` must refuse.

The leading underscore keeps ``load_kernels`` of the parent fixture package from importing it.
"""
