"""Library (``library.py``) and its Kernel handles (``launch.py``): what a launch does and every
refusal of the launch path.

Most tests run the real runtime (Library → generated launch → HIP driver) against the fake
``libamdhip64`` in a subprocess, so that the driver library is the fake one: each refusal is
raised before anything reaches the GPU; launches run on their arguments' device, whatever device
is current. The rest build a Kernel in memory: the generated launcher holds no catalog text and
the slow path's refusals are not cached.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from aotriton_rt import interop
from aotriton_rt.catalog import Catalog
from aotriton_rt.errors import ArgumentError
from aotriton_rt.launch import Kernel
from tests.fakehip import build_fake_hip, fake_hip_env, read_log
from tests.helpers.httpfaults import make_image_folder

ROOT = Path(__file__).resolve().parents[2]

SCENARIOS = r"""
import json, sys
import aotriton_rt
from aotriton_rt.errors import AotritonError
from tests.runtime.test_interop import FakeGPUArray

lib = aotriton_rt.Library(sys.argv[1], backend="hip")
add = lib.kernel("add", dtype="fp32", raw_pointers=True)
add_strict = lib.kernel("add", dtype="fp32")
softmax = lib.kernel("softmax", dtype="fp16", BLOCK=256, raw_pointers=True)
P = 0x7F0000000000
dev0 = lambda: FakeGPUArray(device=(10, 0), ptr=P)
dev1 = lambda: FakeGPUArray(device=(10, 1), ptr=P)
cases = {
    "plain_int": lambda: add_strict(P, P, P, 10),
    "misaligned": lambda: add(P + 4, P, P, 10),
    "scalar_range": lambda: add(P, P, P, 2**64),
    "scalar_type": lambda: add(P, P, P, "10"),
    "grid_len": lambda: add[(1, 2, 3, 4)](P, P, P, 10),
    "grid_neg": lambda: add[(-1,)](P, P, P, 10),
    "grid_type": lambda: add[(1.5,)](P, P, P, 10),
    "check": lambda: softmax(P, P, 4, 300, 300, 300),
    "wrong_device": lambda: add(dev0(), dev1(), dev0(), 4),
    "cuda_array_on_hip": lambda: add(FakeGPUArray(device=(2, 0), ptr=P), dev0(), dev0(), 4),
    "cpu_array": lambda: add(FakeGPUArray(device=(1, 0), ptr=P), dev0(), dev0(), 4),
    "device_range": lambda: add(FakeGPUArray(device=(10, 70), ptr=P), P, P, 4),
    "unknown_kernel": lambda: lib.kernel("addd"),
    # Issue 9, item 5: launch values are range-checked before the driver sees them.
    "grid_rule_negative": lambda: add(P, P, P, -2000),
    "grid_rule_too_many_blocks": lambda: add(P, P, P, 2**32 * 1024 + 2048),
    "grid_too_many_threads": lambda: add[(2**31 - 1,)](P, P, P, 10),
    "stream_str": lambda: add(P, P, P, 10, stream="0"),
    "stream_negative": lambda: add(P, P, P, 10, stream=-1),
    "stream_too_big": lambda: add(P, P, P, 10, stream=2**70),
    "stream_bool": lambda: add(P, P, P, 10, stream=True),
    "fifth_positional": lambda: add(P, P, P, 10, 0),
    "sixth_positional": lambda: add(P, P, P, 10, 0, (1,)),
}
out = {}
for name, fn in cases.items():
    try:
        fn()
        out[name] = "no error"
    except AotritonError as e:
        out[name] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""

EXPECTED = {
    "plain_int": r"ArgumentError: argument x_ptr is a plain integer 0x7f0000000000; raw addresses are "
                 r"accepted only from lib.kernel\('add', raw_pointers=True\)",
    "misaligned": r"ArgumentError: argument x_ptr address 0x7f0000000004 is not 16-byte aligned, which this "
                  r"kernel was compiled to assume",
    "scalar_range": r"ArgumentError: argument n \(i64\) = 18446744073709551616 is out of range",
    "scalar_type": r"ArgumentError: argument n \(i64\) must be an integer, got str",
    "grid_len": r"ArgumentError: grid must be 1 to 3 integers, got \(1, 2, 3, 4\)",
    "grid_neg": r"ArgumentError: grid\[0\] = -1 must be an integer in \[0, 16777215\] on hip with 256 threads",
    "grid_type": r"ArgumentError: grid\[0\] = 1.5 must be an integer",
    "check": r"ArgumentError: softmax: n_cols=300 violates `n_cols <= BLOCK` of this variant \(BLOCK=256\)",
    "wrong_device": r"ArgumentError: argument y_ptr is on device 1 but the other arguments are on device 0; "
                    r"move it to device 0",
    "cuda_array_on_hip": r"ArgumentError: argument x_ptr: .*",
    "cpu_array": r"ArgumentError: argument x_ptr: .*CPU.*",
    "device_range": r"LaunchError: device index 70 is out of range \(0\.\.63\)",
    "unknown_kernel": r"KernelNotFound: no kernel named 'addd' in the catalog; kernels: add, softmax",
    "grid_rule_negative": r"LaunchError: grid rule of add \(cdiv\(n, BLOCK\), 1, 1\) gives grid \(-1, 1, 1\) for "
                          r"these arguments; each size must be in \[0, 16777215\]",
    "grid_rule_too_many_blocks": r"LaunchError: grid rule of add .* gives grid \(4294967298, 1, 1\)",
    "grid_too_many_threads": r"ArgumentError: grid\[0\] = 2147483647 must be an integer in \[0, 16777215\]",
    "stream_str": r"ArgumentError: stream must be a raw stream handle \(an int in \[0, 2\*\*64\)\) or a "
                  r"torch/CuPy stream object, got str '0'",
    "stream_negative": r"ArgumentError: stream -1 is not a stream handle: it must be in \[0, 2\*\*64\)",
    "stream_too_big": r"ArgumentError: stream 1180591620717411303424 is not a stream handle",
    "stream_bool": r"ArgumentError: stream must be a raw stream handle .* got bool True",
    "fifth_positional": r"ArgumentError: add takes 4 arguments \(x_ptr, y_ptr, out_ptr, n\) but was given 5 "
                        r"positionally; pass stream= and grid= by keyword",
    "sixth_positional": r"ArgumentError: add takes 4 arguments .* but was given 6 positionally",
}


@pytest.fixture(scope="module")
def messages(built_images, tmp_path_factory) -> dict:
    lib = build_fake_hip(tmp_path_factory.mktemp("fakehip"))
    log = tmp_path_factory.mktemp("log") / "calls.jsonl"
    env = {**os.environ, **fake_hip_env(lib, log, arch="gfx942:sramecc+:xnack-", devices=2, backend="ctypes"),
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run([sys.executable, "-c", SCENARIOS, str(built_images)], env=env, capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    launches = [r for r in read_log(log) if r["call"] == "hipModuleLaunchKernel"]
    return {"messages": json.loads(proc.stdout), "launches": launches}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_launch_is_refused_with_a_clear_message(messages, case):
    import re

    assert re.match(EXPECTED[case], messages["messages"][case]), messages["messages"][case]


def test_no_refused_launch_reached_the_driver(messages):
    assert messages["launches"] == []


LAUNCH_ONE = ("import sys, aotriton_rt\n"
              "k = aotriton_rt.Library(sys.argv[1], backend='hip').kernel('add', dtype='fp32', raw_pointers=True)\n"
              "k(0x7F0000000000, 0x7F0000000000, 0x7F0000000000, 8)\n")


def _launch_one(images: Path, tmp_path: Path, **fake) -> subprocess.CompletedProcess:
    env = {**os.environ, **fake_hip_env(build_fake_hip(tmp_path), None, backend="ctypes", **fake),
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    return subprocess.run([sys.executable, "-c", LAUNCH_ONE, str(images)], env=env, capture_output=True,
                          text=True, cwd=ROOT)


def test_missing_arch_names_the_built_ones_and_the_fix(built_images, tmp_path):
    proc = _launch_one(built_images, tmp_path, arch="gfx90a:sramecc+:xnack-")
    assert proc.returncode != 0
    assert "KernelNotFound: no image for gfx90a; built archs: gfx1100, gfx942 — build it with " \
           "`python -m builder build --targets gfx90a --add` (keeps the images already there)" in proc.stderr


def test_driver_failure_names_the_call_code_and_hint(built_images, tmp_path):
    proc = _launch_one(built_images, tmp_path, fail="hipModuleLaunchKernel=1")
    assert proc.returncode != 0
    assert "DriverError: hipModuleLaunchKernel(add_kernel" in proc.stderr
    assert "code 1" in proc.stderr or "(1)" in proc.stderr, proc.stderr[-2000:]


# --------------------------------------------------------------------------- several devices

MULTI_DEVICE_SCENARIO = r"""
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
def multi_device(built_images, tmp_path_factory) -> dict:
    lib = build_fake_hip(tmp_path_factory.mktemp("fakehip"))
    log = tmp_path_factory.mktemp("log") / "calls.jsonl"
    env = {**os.environ, **fake_hip_env(lib, log, arch="gfx942:sramecc+:xnack-", devices=2, backend="ctypes"),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", MULTI_DEVICE_SCENARIO, str(built_images)], env=env,
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return {"out": json.loads(proc.stdout), "log": read_log(log)}


def test_each_launch_runs_with_its_arguments_device_current(multi_device):
    launches = [(r["device"], r["module_device"]) for r in multi_device["log"] if r["call"] == "hipModuleLaunchKernel"]
    assert launches == [(1, 1), (0, 0), (0, 0)]


def test_the_callers_current_device_is_restored_after_each_launch(multi_device):
    assert multi_device["out"]["current_after"] == [0, 0, 1]


def test_each_device_gets_its_own_module_loaded_once(multi_device):
    loads = [r["device"] for r in multi_device["log"] if r["call"] == "hipModuleLoadData"]
    assert loads == [1, 0]


def test_arguments_on_two_devices_in_one_call_are_refused_before_the_driver(multi_device):
    assert multi_device["out"]["refused"] == ("argument y_ptr is on device 1 but the other arguments are on device 0; "
                                     "move it to device 0")
    assert len([r for r in multi_device["log"] if r["call"] == "hipModuleLaunchKernel"]) == 3


# --------------------------------------------------------------------------- the generated launcher


def _folder(tmp_path: Path) -> Path:
    return make_image_folder(tmp_path / "imgs", targets=(("cuda", "sm90", 32),), kernels=("add",))


def test_launcher_source_holds_no_catalog_text_even_if_validation_were_bypassed(tmp_path):
    # Defence in depth: a Variant built in memory skips the schema; the generated launcher still
    # uses placeholders, so a hostile name is only a label.
    marker = tmp_path / "PWNED"
    v = Catalog.load(_folder(tmp_path)).variants[0]
    hostile = f"n=open({str(marker)!r}, 'w')"
    v = dataclasses.replace(v, args=(v.args[0], dataclasses.replace(v.args[1], name=hostile)))
    lib = SimpleNamespace(backend_now="cuda")
    k = Kernel.__new__(Kernel)
    k.library, k.name, k.params, k.candidates, k._raw = lib, "add", {}, [v], True
    k.arg_names, k._states = [a.name for a in v.args], [None] * 64
    fn = k._generate(v)
    assert not marker.exists()
    assert fn.__code__.co_varnames[:3] == ("self", "x_ptr", hostile)
    assert all(c is None or hostile not in str(c) for c in fn.__code__.co_consts)


def _kernel_stub(raw: bool) -> Kernel:
    k = Kernel.__new__(Kernel)
    k.library, k.name, k._raw = SimpleNamespace(backend_now="cuda", backend="cuda"), "k", raw
    return k


def test_a_refused_describe_of_none_does_not_poison_later_launches():
    with pytest.raises(ArgumentError):
        interop.describe(None)
    with pytest.raises(ArgumentError):
        interop.pointer(None)
    assert _kernel_stub(False)._pointer(None, "bias", None) == (0, -2)


def test_a_refused_pointer_of_an_int_does_not_poison_raw_pointer_handles():
    with pytest.raises(ArgumentError):
        interop.pointer(0x1000)
    assert _kernel_stub(True)._pointer(0x1000, "x", None) == (0x1000, -2)
    assert interop.pointer_reader(int) is None and interop.pointer_reader(type(None)) is None


def _handle(tmp_path: Path) -> Kernel:
    """A handle on the folder's 'add' (x_ptr, n) built in memory: its generated
    launcher refuses bad calls before it needs a driver."""
    v = Catalog.load(_folder(tmp_path)).variants[0]
    driver = SimpleNamespace(current_device=lambda: 0)
    lib = SimpleNamespace(backend_now="cuda", backend="cuda", driver=driver)
    return Kernel(lib, "add", {}, [v], raw_pointers=True)


# Issue 25, finding 9: a call that does not fit the signature is an ArgumentError naming the
# kernel and its arguments (it was Python's TypeError about "__call__()").
BAD_CALLS = {
    "too few": (lambda k: k(1 << 12), r"^add takes 2 arguments \(x_ptr, n\) but n was not given$"),
    "first missing": (lambda k: k(n=4), r"^add takes 2 arguments \(x_ptr, n\) but x_ptr was not given$"),
    "none": (lambda k: k(), r"^add takes 2 arguments \(x_ptr, n\) but x_ptr was not given$"),
    "unknown keyword": (lambda k: k(1 << 12, 4, strem=0),
                        r"^add got an unknown keyword argument 'strem'; it takes x_ptr, n \(by position or name\) "
                        r"and stream=, grid= by keyword$"),
    "numpy array as n": (lambda k: k(1 << 12, __import__("numpy").array([4])),
                         r"^argument n \(i32\) must be an integer, got ndarray of shape \(1,\)"),
    "str from __index__": (lambda k: k(1 << 12, _StrIndex()),
                           r"^argument n \(i32\) must be an integer, got _StrIndex whose __index__\(\) failed"),
}


class _StrIndex:
    def __index__(self):
        return "4"


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
@pytest.mark.parametrize("call", ["first", "later"])
def test_a_call_that_does_not_fit_the_signature_is_an_argument_error(tmp_path, case, call):
    k = _handle(tmp_path)
    if call == "later":  # the generated launcher is the handle's __call__ after the first call
        with pytest.raises(ArgumentError):
            k(1 << 12, 2**40)
        assert type(k) is not Kernel
    fn, message = BAD_CALLS[case]
    with pytest.raises(ArgumentError, match=message):
        fn(k)


def test_the_first_call_of_a_handle_may_name_its_arguments(tmp_path):
    k = _handle(tmp_path)
    with pytest.raises(ArgumentError, match=r"^argument n \(i32\) = 1099511627776 is out of range"):
        k(x_ptr=1 << 12, n=2**40)


def test_operator_state_is_made_once_per_library_even_when_one_state_asks_for_another():
    from aotriton_rt.library import operator_state

    class Lib:
        pass

    class View:  # stands in for a library, forwarding what it lacks
        def __init__(self, lib):
            self._lib = lib

        def __getattr__(self, name):
            return getattr(self._lib, name)

    made = []

    def inner(lib):
        made.append(lib)
        return object()

    def outer(lib):
        return operator_state(lib, "inner", inner)

    a, b = Lib(), Lib()
    first = operator_state(a, "outer", outer)
    assert operator_state(a, "outer", outer) is first and made == [a]
    assert operator_state(b, "outer", outer) is not first
    view = View(a)
    assert operator_state(view, "outer", outer) is not first and made == [a, b, view]


def test_a_tuning_view_shares_what_the_library_loaded_and_keeps_its_own_rules_and_state(tmp_path):
    import aotriton_rt
    from aotriton_rt.errors import CatalogError
    from aotriton_rt.library import live_library, operator_state

    folder = _folder(tmp_path)
    catalog = json.loads((folder / "catalog.json").read_text())
    own = {"add": [{"config": 0, "source": "images"}], "attn_fwd": [{"config": 1}]}
    (folder / "catalog.json").write_text(json.dumps({**catalog, "tuning": own}))
    lib = aotriton_rt.Library(folder)
    variants = lib.variants_of("add")
    view = lib.with_tuning({"attn_fwd": [{"config": 2}]})
    assert type(view) is aotriton_rt.Library and view is not lib
    assert view.tuning == {"add": own["add"], "attn_fwd": [{"config": 2}]} and lib.tuning == own
    # Everything loaded is shared: catalogs, the variants read, modules per device, scratch, lock.
    assert view.catalogs is lib.catalogs and view.variants_of("add") is variants
    assert view._modules is lib._modules and view.scratch is lib.scratch and view._lock is lib._lock
    # Its own handles and operator state; torch ops find it by its own key like any library.
    assert view.kernel("add", dtype="fp32") is not lib.kernel("add", dtype="fp32")
    assert view.kernel("add", dtype="fp32").candidates == lib.kernel("add", dtype="fp32").candidates
    assert operator_state(view, "k", lambda lib: [lib]) == [view] and operator_state(lib, "k", lambda lib: []) == []
    assert live_library(view.op_key) is view and view.op_key != lib.op_key
    nested = view.with_tuning({"add": []})
    assert nested.tuning == {"add": [], "attn_fwd": [{"config": 2}]} and view.tuning["add"] == own["add"]
    with pytest.raises(CatalogError, match=r"^Library\.with_tuning: catalog tuning\['attn_fwd'\] rule "
                                           r"\{'config': -1\}: config must be an integer >= 0$"):
        lib.with_tuning({"attn_fwd": [{"config": -1}]})
