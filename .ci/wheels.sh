#!/usr/bin/env bash
# CI, wheels: build the runtime wheel (images embedded) and an image wheel twice each and
# compare the bytes; install both into a fresh venv with no source tree on the path; check that
# `python -m aotriton_rt info` finds both image folders, digest-checked; check that an image
# wheel of another catalog schema is refused. Small image folders keep it fast: the release
# wheel embeds the default set for every default target (examples/quickstart.sh builds it).
set -euo pipefail
cd "$(dirname "$0")/.."
W=$(mktemp -d "${TMPDIR:-/tmp}/aotriton-wheels.XXXXXX")
trap 'rm -rf "$W"' EXIT
fail() { echo "wheels: FAIL: $*" >&2; exit 1; }

python -m builder build --kernels add,softmax --targets sm90,gfx942 --out "$W/embedded" -j 2 -q
python -m builder build --kernels rmsnorm --targets sm90 --out "$W/extra" -j 2 -q
for n in 1 2; do
  python -m builder wheel runtime --images "$W/embedded" --out "$W/dist$n"
  python -m builder wheel images --images "$W/extra" --set full --out "$W/dist$n"
done
for f in "$W"/dist1/*.whl; do
  cmp "$f" "$W/dist2/$(basename "$f")" || fail "two builds of $(basename "$f") differ"
done
echo "wheels: two builds of each wheel are byte-identical: $(cd "$W/dist1" && ls)"

python -m venv "$W/venv"
"$W/venv/bin/python" -m pip install -q --no-index --find-links "$W/dist1" "aotriton-rt[images-sm90-full]"   # the extra pulls the image wheel
cd "$W"  # no source tree here, and none on the path
run() { env -u PYTHONPATH -u AOTRITON_RT_IMAGES AOTRITON_RT_CACHE="$W/no-cache" "$W/venv/bin/python" "$@"; }
run -c 'import aotriton_rt, sys; assert "site-packages" in aotriton_rt.__file__, aotriton_rt.__file__'
info=$(run -m aotriton_rt info)
echo "$info"
grep -q "^  embedded in aotriton-rt .*/site-packages/aotriton_rt/images$" <<<"$info" || fail "embedded images not found"
grep -q "^  image wheel aotriton-rt-images-sm90-full .*/site-packages/aotriton_rt_images_sm90_full$" <<<"$info" \
  || fail "the image wheel was not found"
[ "$(grep -c 'digests OK$' <<<"$info")" = 2 ] || fail "not every folder's digests were checked OK"
grep -q "^catalog: 22 variants of 3 kernels" <<<"$info" || fail "the merged catalog is not add+softmax+rmsnorm"
run -m builder --version >/dev/null || fail "the installed builder does not run"

# An image wheel of a catalog schema this runtime does not read: refused, by name.
run - "$W/dist1/aotriton_rt_images_sm90_full-"*.whl "$W/future" <<'PY'
import json, sys, zipfile
from pathlib import Path
from builder.wheels import write_wheel
src, out = Path(sys.argv[1]), Path(sys.argv[2])
with zipfile.ZipFile(src) as zf:
    files = {n: zf.read(n) for n in zf.namelist()}
renamed = {}
for name, data in files.items():
    name = name.replace("aotriton_rt_images_sm90_full", "aotriton_rt_images_sm90_future")
    data = data.replace(b"aotriton_rt_images_sm90_full", b"aotriton_rt_images_sm90_future")
    data = data.replace(b"aotriton-rt-images-sm90-full", b"aotriton-rt-images-sm90-future").replace(b"sm90-full =", b"sm90-future =")
    if name.endswith("image-wheel.json"):
        data = json.dumps({**json.loads(data), "catalog_schema_version": 3}).encode()
    renamed[name] = data
write_wheel(out / "aotriton_rt_images_sm90_future-0.1.0-py3-none-any.whl", renamed,
            "aotriton_rt_images_sm90_future-0.1.0.dist-info")
PY
"$W/venv/bin/python" -m pip install -q --no-index --no-deps "$W"/future/*.whl
info=$(run -m aotriton_rt info)
grep -q "image wheel aotriton-rt-images-sm90-future 0.1.0 holds a catalog of schema 'aotriton-rt.catalog' version 3" \
  <<<"$info" || { echo "$info"; fail "the incompatible image wheel was not refused by name"; }
run -c 'import aotriton_rt
try:
    aotriton_rt.Library()
except aotriton_rt.CatalogError as e:
    assert "its images were not used" in str(e), e
else:
    raise SystemExit("an incompatible image wheel was accepted")'
echo "wheels: OK (embedded + image wheel found and digest-checked; incompatible image wheel refused)"
