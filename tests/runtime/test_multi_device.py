"""Launches on several devices: each launch runs on its arguments' device, whatever device is current.

Runs the real runtime (Library → generated launch → HIP driver) against the fake ``libamdhip64``
with two devices, in a subprocess so that the driver library is the fake one. The fake refuses a
launch unless the function's device is current, and records the current device at each launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakehip import build_fake_hip, fake_hip_env, read_log

ROOT = Path(__file__).resolve().parents[2]

SCENARIO = r"""
import json, sys
import aotriton_rt
from aotriton_rt.errors import ArgumentError
from tests.runtime.test_interop import FakeGPUArray

lib = aotriton_rt.Library(sys.argv[1], backend="hip")
add = lib.kernel("add", dtype="fp32")
drv = lib.driver
P = 0x7F0000000000
on = lambda device: FakeGPUArray(device=(10, device), ptr=P)
seen = []
add(on(1), on(1), on(1), 8)          # device 0 current, arguments on device 1
seen.append(drv.current_device())
add(on(0), on(0), on(0), 8)          # and on device 0
seen.append(drv.current_device())
drv._api.set_device(1)               # device 1 current, arguments on device 0
add(on(0), on(0), on(0), 8)
seen.append(drv.current_device())
try:
    add(on(0), on(1), on(0), 8)
    refused = "no error"
except ArgumentError as e:
    refused = str(e)
print(json.dumps({"current_after": seen, "refused": refused}))
"""


@pytest.fixture(scope="module")
def run(built_images, tmp_path_factory) -> dict:
    lib = build_fake_hip(tmp_path_factory.mktemp("fakehip"))
    log = tmp_path_factory.mktemp("log") / "calls.jsonl"
    env = {**os.environ, **fake_hip_env(lib, log, arch="gfx942:sramecc+:xnack-", devices=2, backend="ctypes"),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCENARIO, str(built_images)], env=env, capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return {"out": json.loads(proc.stdout), "log": read_log(log)}


def test_each_launch_runs_with_its_arguments_device_current(run):
    launches = [(r["device"], r["module_device"]) for r in run["log"] if r["call"] == "hipModuleLaunchKernel"]
    assert launches == [(1, 1), (0, 0), (0, 0)]


def test_the_callers_current_device_is_restored_after_each_launch(run):
    assert run["out"]["current_after"] == [0, 0, 1]


def test_each_device_gets_its_own_module_loaded_once(run):
    loads = [r["device"] for r in run["log"] if r["call"] == "hipModuleLoadData"]
    assert loads == [1, 0]


def test_arguments_on_two_devices_in_one_call_are_refused_before_the_driver(run):
    assert run["out"]["refused"] == ("argument y_ptr is on device 1 but the other arguments are on device 0; "
                                     "move it to device 0")
    assert len([r for r in run["log"] if r["call"] == "hipModuleLaunchKernel"]) == 3
