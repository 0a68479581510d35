"""aotriton-rt builder: Triton kernel sources → compressed images + a JSON catalog, offline.

Run ``python -m builder --help``. Needs triton (pinned, see build.PINNED_TRITON); no GPU.
"""
