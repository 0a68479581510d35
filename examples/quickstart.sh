#!/usr/bin/env bash
# The main job: set up, build the default images on the CPU, then run the attention example
# when a GPU is present (and say plainly what was done when there is none).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Use this Python as it is when it already has the builder's pinned needs (e.g. a GPU machine
# with torch and triton 3.6.0); otherwise set up .venv and install them.
if "$PY" -c 'import triton, elftools, msgpack, sys; sys.exit(triton.__version__ != "3.6.0")' 2>/dev/null; then
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  python() { "$PY" "$@"; }
else
  if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
  fi
  . .venv/bin/activate
  python -m pip install -q --upgrade pip
  python -m pip install -q -e '.[builder,download]'
fi

echo "== building the default image set for all default targets (CPU only) =="
start=$(date +%s)
python -m builder build --set default --add   # --add: keep any other variants already there
echo "build wall time: $(( $(date +%s) - start )) s"

echo "== checking the images (digests and ABI proof) =="
python -m builder verify

echo "== runtime =="
python -m aotriton_rt info
targets=$(python -c 'from aotriton_rt.arch import detect_targets
try:
    print(",".join(detect_targets()))
except Exception:
    print("")')
if [ -z "$targets" ]; then
  echo "No GPU on this machine: images were built and verified; no kernel was launched."
  exit 0
fi
echo "GPU found ($targets): running the examples"
if python -c 'import torch' 2>/dev/null; then
  python examples/add_torch.py
  if [ -f examples/attention_torch.py ]; then
    python examples/attention_torch.py
  fi
else
  echo "torch is not installed here: pip install torch to run examples/attention_torch.py"
fi
