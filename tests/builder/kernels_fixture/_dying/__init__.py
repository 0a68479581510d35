"""A kernel whose first compile kills its own worker process: for the Ray executor's retries.

Not part of the fixture package's kernels (private); load it as its own package,
``load_kernels("tests.builder.kernels_fixture._dying")``.
"""
