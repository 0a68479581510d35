"""Importing the drivers is free: no library opened, no device probed, no framework imported.

And the driver of a backend is created on first use, once, even under concurrent first use.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.fakehip import build_fake_hip, fake_hip_env, read_log

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "cupy", "jax", "triton", "hip", "numpy")

PROBE = r"""
import ctypes, json, sys
opened = []
original = ctypes.CDLL.__init__
def record(self, name, *args, **kwargs):
    opened.append(name)
    original(self, name, *args, **kwargs)
ctypes.CDLL.__init__ = record  # WinDLL and PyDLL derive from CDLL
before = set(sys.modules)
import aotriton_rt.drivers
import aotriton_rt.drivers._loader
import aotriton_rt.drivers.cuda
import aotriton_rt.drivers.hip
with open("/proc/self/maps") as maps:
    mapped = [line.split()[-1] for line in maps if "libcuda" in line or "libamdhip64" in line]
print(json.dumps({"opened": opened, "new_modules": sorted(set(sys.modules) - before),
                  "drivers": sorted(aotriton_rt.drivers._drivers), "mapped": mapped}))
"""


def test_importing_the_drivers_opens_no_library_and_imports_no_framework() -> None:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", PROBE], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    facts = json.loads(proc.stdout)
    assert facts["opened"] == []
    assert facts["mapped"] == []
    assert facts["drivers"] == []
    assert "aotriton_rt.drivers.hip" in facts["new_modules"]
    heavy = [m for m in facts["new_modules"] if m.split(".")[0] in HEAVY]
    assert heavy == []
    # -X importtime lists every module imported, including any the probe could not see
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    assert not {m for m in imported if m.split(".")[0] in HEAVY}


CONCURRENT = r"""
import json, threading
from aotriton_rt.drivers import get_driver
barrier = threading.Barrier(8)
got = []
def first_use():
    barrier.wait()
    got.append(get_driver("hip"))
threads = [threading.Thread(target=first_use) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps({"distinct": len({id(d) for d in got}), "calls": len(got),
                  "same_again": get_driver("hip") is got[0]}))
"""


def test_concurrent_first_use_creates_the_driver_once(tmp_path: Path) -> None:
    lib = build_fake_hip(tmp_path)
    log = tmp_path / "calls.jsonl"
    env = {**os.environ, **fake_hip_env(lib, log, backend="ctypes")}
    proc = subprocess.run([sys.executable, "-c", CONCURRENT], env=env, cwd=ROOT,
                          capture_output=True, text=True, check=True)
    assert json.loads(proc.stdout) == {"distinct": 1, "calls": 8, "same_again": True}
    assert [r["call"] for r in read_log(log)].count("hipInit") == 1
