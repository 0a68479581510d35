#!/usr/bin/env bash
# NOIMAGE deployment, end to end, in one command:
#   bash examples/noimage_demo.sh BUNDLES_DIR
# BUNDLES_DIR holds what `python -m builder pack --images images --out BUNDLES_DIR` wrote.
# Serves it from a loopback HTTP server, starts from an empty cache with no local images,
# downloads the bundle for this GPU's arch, verifies it, and runs the examples from it.
set -euo pipefail
cd "$(dirname "$0")/.."
bundles=$(cd "${1:?usage: noimage_demo.sh BUNDLES_DIR}" && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
cache=$(mktemp -d)
port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$PY" -m http.server "$port" --bind 127.0.0.1 --directory "$bundles" >/dev/null 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; rm -rf "$cache"' EXIT
for _ in $(seq 50); do
  "$PY" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/index.json')" 2>/dev/null && break
  sleep 0.1
done

# No local images: the runtime may only find what the download installs.
unset AOTRITON_RT_IMAGES
export AOTRITON_RT_CACHE=$cache
if [ -f images/catalog.json ]; then
  echo "images/ holds a catalog; move it away for a true NOIMAGE run" >&2
  exit 1
fi
echo "== download (bundles served on 127.0.0.1:$port) =="
"$PY" -m aotriton_rt download --arch auto --url "http://127.0.0.1:$port" --allow-http --no-progress
echo "== verify =="
"$PY" -m aotriton_rt verify
"$PY" -m aotriton_rt info
echo "== run from the installed images =="
"$PY" examples/add_torch.py
if "$PY" -c 'import aotriton_rt.ops.attention' 2>/dev/null && [ -f examples/attention_torch.py ]; then
  "$PY" examples/attention_torch.py
fi
