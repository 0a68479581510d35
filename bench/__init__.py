"""aotriton-rt's benchmark suite: ``python -m bench`` runs the product benchmarks (``bench/README.md``).

A package so that ``python -m bench.NAME`` runs one benchmark from the checkout's root with the
checkout importable; ``python bench/NAME.py`` works too.
"""
