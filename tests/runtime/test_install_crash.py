"""An installer killed at any step leaves an install the next installer recovers (issue 9, item 4).

Each case runs ``install_file`` of release v2 over an installed v1 in a child process that
``os._exit``s at one step of the swap (no cleanup, no ``finally``: as ``kill -9`` would). A fresh
installer then finds a complete, verified release — v1 if the kill came before the new folder
was in place, v2 after — and nothing left behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aotriton_rt.download import install_file, verify_folder
from builder.bundle import pack
from tests.helpers.httpfaults import make_image_folder

ROOT = Path(__file__).resolve().parents[2]
NAME = "hip-gfx942"

CRASH = r"""
import os, shutil, sys
from pathlib import Path
import aotriton_rt.bundles.unpack as u
import aotriton_rt.download as d

step = sys.argv[3]
real_replace, real_rmtree, real_copy = os.replace, shutil.rmtree, u._copy
replaces = []

def replace(src, dst):
    replaces.append((src, dst))
    if step == "before_aside" and len(replaces) == 1:
        os._exit(9)
    real_replace(src, dst)
    if step == "between_renames" and len(replaces) == 1:
        os._exit(9)
    if step == "after_swap" and len(replaces) == 2:
        os._exit(9)

def rmtree(path, ignore_errors=False):
    if step == "during_cleanup" and Path(path).name.startswith("old-"):
        next(p for p in Path(path).rglob("*") if p.is_file()).unlink()
        os._exit(9)
    real_rmtree(path, ignore_errors=ignore_errors)

copies = []
def copy(*args):
    copies.append(1)
    if step == "during_unpack" and len(copies) == 2:
        os._exit(9)
    real_copy(*args)

os.replace, shutil.rmtree, u._copy = replace, rmtree, copy
d.install_file(sys.argv[1], dest=sys.argv[2])
os._exit(0)
"""

#: step -> the release a recovering installer must find in place.
STEPS = {"during_unpack": "v1", "before_aside": "v1", "between_renames": "v1", "after_swap": "v2",
         "during_cleanup": "v2"}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("crash-releases")
    out = {}
    for seed, tag in ((0, "v1"), (1, "v2")):
        pack(make_image_folder(base / f"images-{tag}", seed=seed, targets=(("hip", "gfx942", 64),)), base / tag)
        out[tag] = base / tag / f"{NAME}.tar"
    return out


@pytest.mark.parametrize("step", sorted(STEPS))
def test_installer_killed_at_each_step_is_recovered_by_the_next(step, bundles, tmp_path):
    dest = tmp_path / "images"
    install_file(bundles["v1"], dest=dest)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CRASH, str(bundles["v2"]), str(dest), step], env=env,
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 9, proc.stderr[-2000:]
    expected = STEPS[step]
    # The next installer of the release that should be there finds it complete and verified.
    assert install_file(bundles[expected], dest=dest).action == "already installed"
    assert verify_folder(dest / NAME).ok
    assert sorted(p.name for p in dest.iterdir() if not p.name.endswith(".lock")) == [NAME]
    # And an upgrade still goes through.
    assert install_file(bundles["v2"], dest=dest).action == ("already installed" if expected == "v2" else "installed")
    assert verify_folder(dest / NAME).ok
