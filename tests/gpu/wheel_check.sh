#!/usr/bin/env bash
# On a GPU machine: install only the built wheels (plus the machine's torch) into a fresh venv
# and run every Python block of the README and examples/attention_torch.py from a folder with
# no source tree on the path. Prints a summary table; with $OUT set, writes each step's output
# under $OUT/wheel_check/.
#
#   bash tests/gpu/wheel_check.sh DIST
#
# DIST holds aotriton_rt-*.whl (python -m builder wheel runtime --images FOLDER, FOLDER being
# at least the default set for this GPU's target) and optionally aotriton_rt_images_*.whl.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
DIST=$(cd "${1:?usage: wheel_check.sh DIST}" && pwd)
PY=${PYTHON:-python3}
W=$(mktemp -d "${TMPDIR:-/tmp}/aotriton-wheel-check.XXXXXX")
LOG=${OUT:+$OUT/wheel_check}
LOG=${LOG:-$W/logs}
mkdir -p "$LOG"
declare -a ROWS=()
status=0

step() {  # step NAME COMMAND...: run in $W/run with only the venv, record pass/fail and time
  local name=$1; shift
  local start=$SECONDS rc
  (cd "$W/run" && env -u PYTHONPATH -u AOTRITON_RT_IMAGES AOTRITON_RT_CACHE="$W/no-cache" "$@") \
    >"$LOG/$name.log" 2>&1
  rc=$?
  ROWS+=("$(printf '%-28s %-5s %4ss  %s' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL)" \
           "$((SECONDS - start))" "$(tail -n 1 "$LOG/$name.log" | cut -c1-90)")")
  [ $rc = 0 ] || status=1
  return $rc
}

mkdir -p "$W/run"
# A fresh venv that sees the machine's torch (its site folder, appended after the venv's own,
# through a .pth file) and nothing of this checkout.
TORCH_SITE=$("$PY" -c 'import pathlib, torch; print(pathlib.Path(torch.__file__).resolve().parent.parent)')
"$PY" -m venv "$W/venv"
V="$W/venv/bin/python"
echo "$TORCH_SITE" >"$("$V" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/machine-torch.pth"
step install "$V" -m pip install --no-index --no-deps --force-reinstall "$DIST"/*.whl
step where "$V" -c 'import aotriton_rt, torch; p = aotriton_rt.__file__
assert p.startswith("'"$W"'/venv/"), p
print(f"aotriton_rt {aotriton_rt.__version__} from {p}; torch {torch.__version__}, {torch.cuda.get_device_name()}")'
step info "$V" -m aotriton_rt info

# Every Python block of the README, as a user would paste it, plus a sync to surface faults.
"$V" - "$REPO/README.md" "$W/run" <<'PY'
import re, sys
from pathlib import Path
blocks = re.findall(r"```python\n(.*?)```", Path(sys.argv[1]).read_text(encoding="utf-8"), re.S)
for i, block in enumerate(blocks):
    Path(sys.argv[2], f"readme_{i}.py").write_text(block + "\nimport torch\ntorch.cuda.synchronize()\n"
                                                  "print('README block %d ran')\n" % i)
PY
for f in "$W"/run/readme_*.py; do
  step "$(basename "$f" .py)" "$V" "$f"
done
cp "$REPO/examples/attention_torch.py" "$W/run/attention_torch.py"
step attention_torch "$V" attention_torch.py

echo
echo "== wheel check: $(ls "$DIST" | tr '\n' ' ')"
printf '%-28s %-5s %5s  %s\n' step result time "last line"
printf '%s\n' "${ROWS[@]}"
echo "logs: $LOG"
rm -rf "$W/venv"
exit $status
