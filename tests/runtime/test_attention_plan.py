"""Attention plans: one per call signature, reused, invalidated, and never a way around a refusal.

CPU torch tensors stand in for GPU arrays (the operator's describe step is widened to accept
them and to place chosen tensors on "device 1"); the library hands out handles with the real
argument lists of ``builder/kernels/attention*.py`` that record each launch instead of running
it. So every test sees exactly which arguments each call would launch with.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from aotriton_rt import ArgumentError, UnsupportedError  # noqa: E402
from aotriton_rt.ops import attention as op  # noqa: E402
from aotriton_rt.ops.attention import backward_plan, dispatch, plan, problem, signature  # noqa: E402
from tests.helpers.cpu_arrays import cpu_describer  # noqa: E402
from tests.runtime.test_attention_op import InterpretedKernel, InterpretedLibrary  # noqa: E402

_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
          torch.int8: "i8"}


class RecordingKernel(InterpretedKernel):
    """The real argument list; a launch records its arguments by name and runs nothing."""

    def __call__(self, *args: Any, stream: Any = None) -> None:
        values = dict(zip(self.arg_names, args, strict=True))
        with self.lib.lock:
            self.lib.launches.append((self.name, values))


class RecordingLibrary(InterpretedLibrary):
    def __init__(self) -> None:
        super().__init__(("attn_bwd_dq_convert",))
        self.lock = threading.Lock()

    def kernel(self, name: str, **params: Any) -> RecordingKernel:
        return RecordingKernel(self, name, params)


@pytest.fixture(scope="module")
def lib() -> RecordingLibrary:
    return RecordingLibrary()


ON_DEVICE_1: set[int] = set()  # data pointers that "live" on device 1


@pytest.fixture(autouse=True)
def cpu_arrays(monkeypatch: pytest.MonkeyPatch, lib: RecordingLibrary) -> None:
    monkeypatch.setattr(problem, "_describe", cpu_describer(problem._describe,
                                                            lambda ptr: 1 if ptr in ON_DEVICE_1 else 0))
    monkeypatch.setattr(dispatch, "_available", lambda library, name, params: library.has(name, params))
    lib.launches.clear()
    dispatch.kernels_of(lib).plans.clear()
    ON_DEVICE_1.clear()


def qkv(B: int = 2, H: int = 2, S: int = 24, D: int = 32, dtype: Any = torch.float16) -> list[torch.Tensor]:
    return [torch.randn(B, H, S, D).to(dtype) for _ in range(3)]


def builds(lib: RecordingLibrary) -> int:
    return dispatch.kernels_of(lib).plans.builds


def launched(lib: RecordingLibrary) -> list[tuple[str, dict]]:
    out = list(lib.launches)
    lib.launches.clear()
    return out


def test_a_repeated_signature_reuses_its_plan_with_the_new_arrays(lib: RecordingLibrary) -> None:
    out1, lse1 = op.attention(*qkv(), causal=True, library=lib)
    q, k, v = qkv()
    first = launched(lib)
    out2, lse2 = op.attention(q, k, v, causal=True, library=lib)
    (name, values), = launched(lib)
    assert builds(lib) == 1
    assert name == "attn_fwd"
    assert values["Q"] is q and values["K"] is k and values["V"] is v
    assert values["Out"] is out2 and values["LSE"] is lse2 and out2 is not out1
    assert (out2.shape, out2.dtype, lse2.shape, lse2.dtype) == ((2, 2, 24, 32), torch.float16, (2, 2, 24),
                                                                 torch.float32)
    scalars = {n: x for n, x in values.items() if not isinstance(x, torch.Tensor)}
    assert scalars == {n: x for n, x in first[0][1].items() if not isinstance(x, torch.Tensor)}
    assert scalars["seqlen_q"] == 24 and scalars["stride_qm"] == 32 and scalars["sm_scale"] == pytest.approx(32 ** -0.5)


@pytest.mark.parametrize("change", ["dtype", "stride", "shape", "device", "causal", "scale", "layout", "mask"])
def test_a_new_dtype_stride_shape_device_or_option_builds_a_new_validated_plan(lib: RecordingLibrary,
                                                                              change: str) -> None:
    op.attention(*qkv(), library=lib)
    assert builds(lib) == 1
    q, k, v = qkv()
    options: dict[str, Any] = {}
    if change == "dtype":
        q, k, v = qkv(dtype=torch.float32)
    elif change == "stride":
        q = torch.randn(2, 24, 2, 32).to(torch.float16).transpose(1, 2)  # same shape, other strides
    elif change == "shape":
        q = torch.randn(2, 2, 40, 32).to(torch.float16)
    elif change == "device":
        q, k, v = qkv()
        ON_DEVICE_1.update(t.data_ptr() for t in (q, k, v))
    elif change == "causal":
        options["causal"] = True
    elif change == "scale":
        options["scale"] = 0.5
    elif change == "layout":
        options["layout"] = "bshd"
    elif change == "mask":
        options["window"] = (4, 4)
    op.attention(q, k, v, **options, library=lib)
    assert builds(lib) == 2
    values = launched(lib)[-1][1]
    expect = {"dtype": ("Q", q), "stride": ("stride_qh", q.stride(1)), "shape": ("seqlen_q", 40),
              "causal": ("window_right", 0), "scale": ("sm_scale", 0.5), "layout": ("num_heads_q", 24),
              "mask": ("window_left", 4), "device": ("Q", q)}[change]
    assert values[expect[0]] is expect[1] if isinstance(expect[1], torch.Tensor) else values[expect[0]] == expect[1]
    op.attention(*qkv(), library=lib)  # the first signature again: its plan, nothing rebuilt
    assert builds(lib) == 2


def test_a_misaligned_address_under_an_equal_signature_takes_the_copying_plan(lib: RecordingLibrary) -> None:
    q, k, v = qkv()
    op.attention(q, k, v, library=lib)
    base = torch.randn(q.numel() + 1).to(torch.float16)
    shifted = base[1:].view(q.shape)  # same shape and strides, 2 bytes off alignment
    assert shifted.stride() == q.stride() and shifted.data_ptr() % 16
    launched(lib)
    op.attention(shifted, k, v, library=lib)
    (_, values), = launched(lib)
    assert builds(lib) == 2
    assert values["Q"].data_ptr() % 16 == 0 and torch.equal(values["Q"], shifted)  # an aligned copy
    op.attention(q, k, v, library=lib)
    assert launched(lib)[0][1]["Q"] is q


REPEATED_REFUSALS = [
    ("causal_int_after_causal_true", {"causal": 1}, ArgumentError, r"causal must be True or False, got 1"),
    ("dropout_false", {"dropout_p": False}, ArgumentError, r"dropout_p must be a number in \[0, 1\), got False"),
    ("dropout_without_seed", {"dropout_p": 0.1}, ArgumentError, r"dropout_p=0\.1 needs seed="),
    ("negative_seed", {"dropout_p": 0.1, "seed": -1}, ArgumentError,
     r"seed must be in \[0, 18446744073709551615\], got -1"),
    ("float_offset", {"dropout_p": 0.1, "seed": 3, "offset": 1.5}, ArgumentError,
     r"offset must be an integer, got 1\.5"),
    ("window_bool_after_window_ints", {"window": (True, 0)}, ArgumentError,
     r"window must be \(left, right\), two integers >= -1 \(-1: unbounded\), got \(True, 0\)"),
    ("window_list", {"window": [3, "x"]}, ArgumentError, r"window must be \(left, right\)"),
    ("layout", {"layout": "sbhd"}, ArgumentError, r"layout must be 'bhsd'"),
]


@pytest.mark.parametrize("options,exc,match", [r[1:] for r in REPEATED_REFUSALS], ids=[r[0] for r in REPEATED_REFUSALS])
def test_refusals_repeat_on_every_call_even_next_to_a_cached_plan(lib: RecordingLibrary, options: dict,
                                                                 exc: Any, match: Any) -> None:
    q, k, v = qkv()
    op.attention(q, k, v, causal=True, library=lib)
    op.attention(q, k, v, dropout_p=0.1, seed=3, library=lib)
    op.attention(q, k, v, window=(1, 0), library=lib)  # equal to (True, 0), but not the same option
    before = builds(lib)
    for _ in range(3):
        with pytest.raises(exc, match=match):
            op.attention(q, k, v, **options, library=lib)
    assert builds(lib) == before


def test_arrays_on_two_devices_are_refused_on_every_call(lib: RecordingLibrary) -> None:
    q, k, v = qkv()
    op.attention(q, k, v, library=lib)
    k1 = k.clone()
    ON_DEVICE_1.add(k1.data_ptr())
    for _ in range(2):
        with pytest.raises(ArgumentError, match=r"k is on device 1 but q is on device 0; every array must be on one "
                                                r"GPU"):
            op.attention(q, k1, v, library=lib)


def test_unsupported_shapes_stay_refused_with_their_type(lib: RecordingLibrary) -> None:
    for _ in range(2):
        with pytest.raises(UnsupportedError, match=r"the q·k head dim 520 exceeds"):
            op.attention(*qkv(D=520), library=lib)


def test_dropout_seeds_are_per_call_values_not_part_of_the_plan(lib: RecordingLibrary) -> None:
    q, k, v = qkv()
    for seed, offset in ((1, 0), (2**64 - 1, 8), (7, 12)):
        op.attention(q, k, v, dropout_p=0.2, seed=seed, offset=offset, library=lib)
        values = launched(lib)[0][1]
        assert (values["philox_seed"], values["philox_offset"]) == (seed, offset)
    assert builds(lib) == 1


def test_the_backward_plan_is_reused_and_launches_the_split_scheme_with_new_arrays(lib: RecordingLibrary) -> None:
    q, k, v = qkv()
    out, lse = op.attention(q, k, v, causal=True, library=lib)
    dout = torch.randn_like(out)
    op.attention_backward(dout, q, k, v, out, lse, causal=True, library=lib)
    q2, k2, v2 = qkv()
    launched(lib)
    dq, dk, dv, dbias = op.attention_backward(dout, q2, k2, v2, out, lse, causal=True, library=lib)
    calls = launched(lib)
    assert [n for n, _ in calls] == ["attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"]
    assert builds(lib) == 2  # one forward plan, one backward plan
    dkdv = calls[1][1]
    assert dkdv["Q"] is q2 and dkdv["DK"] is dk and dkdv["DV"] is dv and calls[2][1]["DQ"] is dq
    assert calls[0][1]["Delta"] is dkdv["Delta"] is calls[2][1]["Delta"]
    assert dq.shape == q.shape and dbias is None
    with pytest.raises(ArgumentError, match=r"dout must have shape \(2, 2, 24, 32\) and dtype fp16"):
        op.attention_backward(dout[..., :16], q2, k2, v2, out, lse, causal=True, library=lib)


def test_padded_head_dims_and_user_outputs_run_the_general_path_from_their_plan(lib: RecordingLibrary) -> None:
    q, k, v = qkv(D=40)  # bucket 48: padded copies
    out = torch.empty(2, 2, 24, 40, dtype=torch.float16)
    for _ in range(2):
        res, _ = op.attention(q, k, v, out=out, library=lib)
        assert res is out
        values = launched(lib)[0][1]
        assert values["Q"].shape[-1] == 48 and torch.equal(values["Q"][..., :40], q)
    assert builds(lib) == 1


def test_many_threads_with_many_signatures_each_launch_their_own_arguments(lib: RecordingLibrary) -> None:
    shapes = [(1 + i % 3, 2, 16 + i, 32) for i in range(12)]
    errors: list[str] = []

    def work(t: int) -> None:
        for r in range(6):
            B, H, S, D = shapes[(t + r) % len(shapes)]
            q = torch.randn(B, H, S, D).to(torch.float16)
            out, lse = op.attention(q, q, q, causal=bool(t % 2), library=lib)
            if out.shape != (B, H, S, D) or lse.shape != (B, H, S):
                errors.append(f"thread {t}: {tuple(out.shape)} for {(B, H, S, D)}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for _, values in lib.launches:
        assert values["Out"].shape[2] == values["seqlen_q"] == values["Q"].shape[2]
        assert values["window_right"] == (0 if values["window_right"] == 0 else -1)
    assert len(dispatch.kernels_of(lib).plans) == len({(s, c) for s in shapes for c in (0, 1)} & {
        (shapes[(t + r) % len(shapes)], t % 2) for t in range(8) for r in range(6)})


def test_the_plan_cache_is_a_bounded_lru() -> None:
    cache = dispatch.PlanCache(capacity=2)
    cache.put(("a",), 1)
    cache.put(("b",), 2)
    assert cache.get(("a",)) == 1  # a is now the most recent
    cache.put(("c",), 3)
    assert cache.get(("b",)) is None and cache.get(("a",)) == 1 and cache.get(("c",)) == 3
    assert len(cache) == 2 and cache.builds == 3


# ---------------------------------------------------------------------------------------------
# Kernel.prepare: the launch a direct plan uses, against a fake HIP driver on real images.
# ---------------------------------------------------------------------------------------------

PREPARED = r"""
import json, sys
import aotriton_rt
from aotriton_rt.catalog import Catalog

images = sys.argv[1]
lib = aotriton_rt.Library(images, backend="hip")
v = next(v for v in Catalog.load(images).variants if v.kernel == "add" and v.target.arch == "gfx942")
k = lib.kernel("add", raw_pointers=True, num_warps=v.config.num_warps, num_stages=v.config.num_stages, **v.params)
a, b, c = 0x7F0000001000, 0x7F0000002000, 0x7F0000003000
k(a, b, c, 5000, stream=0x5000)                       # the handle's own call
launch = k.prepare(0, (0, 0, 0, 5000))                # scalars checked and grid computed once
launch(0x5000, (a, b, c, 5000))
launch(0x6000, (c, b, a, 5000))                       # new addresses, same prepared scalars
errors = []
for bad in ((0, 0, 0, "x"), (0, 0, 0, 2**70)):
    try:
        k.prepare(0, bad)
    except aotriton_rt.ArgumentError as e:
        errors.append(str(e))
print(json.dumps({"errors": errors}))
"""


def test_a_prepared_launch_hands_the_driver_what_the_handle_would(built_images: Any, tmp_path: Any) -> None:
    import json
    import os
    import subprocess
    import sys

    from tests.fakehip import build_fake_hip, fake_hip_env, read_log

    fake = build_fake_hip(tmp_path / "fakehip")
    log = tmp_path / "calls.jsonl"
    env = {**os.environ, **fake_hip_env(fake, log, arch="gfx942:sramecc+:xnack-", backend="ctypes"),
           "PYTHONPATH": str(problem.__file__).rsplit("/aotriton_rt/", 1)[0]}
    proc = subprocess.run([sys.executable, "-c", PREPARED, str(built_images)], env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    errors = json.loads(proc.stdout)["errors"]
    assert errors == ["argument n (i64) must be an integer, got str 'x'",
                      f"argument n (i64) = {2**70} is out of range [{-2**63}, {2**63 - 1}]"]
    own, prepared, moved = [r for r in read_log(log) if r["call"] == "hipModuleLaunchKernel"]
    assert prepared["args"] == own["args"] and prepared["grid"] == own["grid"] and prepared["stream"] == 0x5000
    assert moved["args"] != own["args"] and moved["stream"] == 0x6000 and moved["grid"] == own["grid"]


# ---------------------------------------------------------------------------------------------
# The torch wrapper: eager calls skip the dispatcher (autograd through a Function), modes keep the op.
# ---------------------------------------------------------------------------------------------

def test_the_torch_wrapper_runs_the_plan_directly_unless_a_mode_needs_the_op(
        lib: RecordingLibrary, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    from aotriton_rt.ops import torch as op_torch

    through_op = []
    real = op_torch.attention_fwd
    monkeypatch.setattr(op_torch, "attention_fwd", lambda *a: through_op.append(1) or real(*a))
    q, k, v = qkv()
    out = op_torch.attention(q, k, v, causal=True, library=lib)
    assert through_op == [] and out.shape == q.shape and out.grad_fn is None
    direct = launched(lib)[0][1]
    # Eager autograd: the same plan under an autograd.Function, no dispatcher round trip.
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out_fn = op_torch.attention(*leaves, causal=True, library=lib)
    assert through_op == [] and type(out_fn.grad_fn).__name__ == "_EagerAttentionBackward"
    via_fn = launched(lib)[0][1]
    assert {n: x for n, x in direct.items() if not isinstance(x, torch.Tensor)} == \
        {n: x for n, x in via_fn.items() if not isinstance(x, torch.Tensor)}
    grad = torch.randn_like(out_fn)
    out_fn.backward(grad)
    bwd_fn = launched(lib)
    assert [name for name, _ in bwd_fn] == ["attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"]
    assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves)
    # The custom op's autograd formula (what torch.compile records) launches the same kernels.
    op_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out_op = real(*op_leaves, None, None, None, None, -1, -1, True, -1, -1, "top_left", 0.0, 0, 0, q.shape[-1] ** -0.5,
                  "bhsd", False, False, op_torch._library_key(lib))[0]
    out_op.backward(grad)
    scalars = [(name, {n: x for n, x in values.items() if not isinstance(x, torch.Tensor)}) for name, values in
               launched(lib)]
    assert scalars == [(name, {n: x for n, x in values.items() if not isinstance(x, torch.Tensor)})
                       for name, values in [("attn_fwd", via_fn), *bwd_fn]]
    with torch.no_grad():
        op_torch.attention(*leaves, causal=True, library=lib)
    assert through_op == []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            return func(*args, **(kwargs or {}))

    with Watch():
        op_torch.attention(q, k, v, causal=True, library=lib)
    assert through_op == [1]


def test_torch_deterministic_algorithms_make_the_backward_deterministic(
        lib: RecordingLibrary, monkeypatch: pytest.MonkeyPatch) -> None:
    """With torch.use_deterministic_algorithms(True) the wrapper asks for the reproducible
    backward (a tuning rule may otherwise pick the atomic scheme, whose dQ is not)."""
    from aotriton_rt.ops import torch as op_torch

    seen = []
    real = op_torch._EagerAttention.apply
    monkeypatch.setattr(op_torch._EagerAttention, "apply",
                        lambda *a: seen.append(a[-1]["deterministic"]) or real(*a))
    leaves = [t.clone().requires_grad_() for t in qkv()]
    before = torch.are_deterministic_algorithms_enabled()
    try:
        op_torch.attention(*leaves, causal=True, library=lib)
        torch.use_deterministic_algorithms(True)
        op_torch.attention(*leaves, causal=True, library=lib)
    finally:
        torch.use_deterministic_algorithms(before)
    op_torch.attention(*leaves, causal=True, deterministic=True, library=lib)
    assert seen == [False, True, True]


# ---------------------------------------------------------------------------------------------
# The integer-address flavour (torch tensors on a device, compiled handles), driven on the CPU.
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def addresses(monkeypatch: pytest.MonkeyPatch, lib: RecordingLibrary) -> list:
    """Handles with ``prepare``; CPU tensors signed as if on a device. Returns the prepared launches."""
    prepared: list = []

    def prepare(self: RecordingKernel, device: int, values: list) -> Any:
        template = dict(zip(self.arg_names, values, strict=True))
        prepared.append((self.name, template))

        def launch(stream: int, args: tuple) -> None:
            with self.lib.lock:
                self.lib.launches.append((self.name, dict(zip(self.arg_names, args, strict=True))))
        return launch

    def sig(obj: Any, name: str) -> Any:
        if type(obj) is torch.Tensor:
            ptr = obj.data_ptr()
            return (obj.shape, obj.stride(), obj.dtype, 0, not ptr & 15), ptr
        return signature._described_sig(obj, name)

    monkeypatch.setattr(RecordingKernel, "prepare", prepare, raising=False)
    for module in (plan, backward_plan):  # each plan module looks these up in its own namespace
        monkeypatch.setattr(module, "_sig", sig)
        monkeypatch.setattr(module, "_fast_handles", lambda p, handles, arrays: True)
        monkeypatch.setattr(module, "_stream_getter", lambda p, q: (lambda device: 0x77))
    return prepared


def test_the_address_flavour_fills_each_pointer_slot_with_its_own_array(lib: RecordingLibrary,
                                                                        addresses: list) -> None:
    q, k, v = qkv()
    bias = torch.randn(2, 24, 24).to(torch.float16)
    out, lse, mask = op.attention(q, k, v, bias=bias, dropout_p=0.2, seed=11, offset=4, return_mask=True,
                                  library=lib)
    (name, values), = launched(lib)
    (_, template), = addresses
    assert values["Q"] == q.data_ptr() and values["K"] == k.data_ptr() and values["V"] == v.data_ptr()
    assert values["Bias"] == bias.data_ptr() and values["Out"] == out.data_ptr() and values["LSE"] == lse.data_ptr()
    assert values["DropMask"] == mask.data_ptr() and values["cu_seqlens_q"] == 0  # absent: address 0
    assert (values["philox_seed"], values["philox_offset"]) == (11, 4)
    fixed = {n for n, x in template.items() if x not in (0, None) and n not in ("philox_seed", "philox_offset")}
    assert fixed and all(values[n] == template[n] for n in fixed)  # strides and scalars as prepared
    assert values["stride_bz"] == 0 and values["stride_bh"] == 24 * 24 and values["stride_qh"] == 24 * 32
    op.attention(q, k, v, bias=bias, dropout_p=0.2, seed=12, offset=8, return_mask=True, library=lib)
    assert len(addresses) == 1 and launched(lib)[0][1]["philox_seed"] == 12


def test_the_address_flavour_runs_the_backward_kernels_on_shared_scratch(lib: RecordingLibrary,
                                                                         addresses: list) -> None:
    q, k, v = qkv()
    out, lse = op.attention(q, k, v, causal=True, library=lib)
    dout = torch.randn_like(out)
    launched(lib)
    dq, dk, dv, _ = op.attention_backward(dout, q, k, v, out, lse, causal=True, library=lib)
    pre, dkdv, dqk = (values for _, values in launched(lib))
    assert pre["DO"] == dout.data_ptr() and pre["Out"] == out.data_ptr() and pre["Delta"] == dkdv["Delta"]
    assert dkdv["DK"] == dk.data_ptr() and dkdv["DV"] == dv.data_ptr() and dqk["DQ"] == dq.data_ptr()
    assert dkdv["LSE"] == lse.data_ptr() == dqk["LSE"] and dkdv["stride_dkh"] == 24 * 32


def test_the_torch_ops_find_a_library_by_its_key_without_registering_it(built_images: Any) -> None:
    # torch.compile traces the key without registering anything (a traced registration would run
    # after the graph); every live Library is found by its op_key (a serial number, never reused),
    # other objects must be registered.
    import aotriton_rt
    from aotriton_rt.ops import torch as op_torch

    lib = aotriton_rt.Library(built_images)
    key = op_torch._library_key(lib)
    assert key == lib.op_key and key not in op_torch._LIBRARIES and op_torch._library(key) is lib
    assert aotriton_rt.Library(built_images).op_key != key
    double = object()
    with pytest.raises(aotriton_rt.ArgumentError, match=r"register_library\(library\) before torch.compile"):
        op_torch._library(key + (1 << 61))
    assert op_torch._library(op_torch.register_library(double)) is double
    assert op_torch.register_library(double) == op_torch._library_key(double)


def test_eager_training_steps_find_the_backward_plan_from_the_forward_key(lib: RecordingLibrary,
                                                                          addresses: list) -> None:
    from aotriton_rt.ops import torch as op_torch

    def step(grad_of: Any) -> tuple[list, list, list]:
        leaves = [t.requires_grad_() for t in qkv()]
        out = op_torch.attention(*leaves, causal=True, library=lib)
        launched(lib)
        out.backward(grad_of(out))
        return leaves, out, launched(lib)

    leaves, out, _ = step(torch.ones_like)
    built = builds(lib)
    assert built == 2  # the forward plan and the backward found from its key
    # A second step with new tensors: no plan built, each pointer slot holds this step's arrays.
    leaves, out, calls = step(torch.ones_like)
    assert builds(lib) == built
    pre, dkdv, dq = (values for _, values in calls)
    q, k, v = leaves
    assert dkdv["Q"] == q.data_ptr() and dkdv["K"] == k.data_ptr() and dkdv["V"] == v.data_ptr()
    assert pre["Out"] == out.data_ptr() and dkdv["DK"] == k.grad.data_ptr() and dq["DQ"] == q.grad.data_ptr()
    # A gradient of another signature (an expanded one: stride 0 everywhere) gets its own plan,
    # read in place through its own strides or through the general path, never the first plan's.
    leaves, out, calls = step(lambda o: torch.ones((), dtype=o.dtype).expand(o.shape))
    assert builds(lib) == built + 1
    assert [name for name, _ in calls] == ["attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"]
    assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves)
    # deterministic=True changes only the backward: the same forward plan, a backward plan of its
    # own (the same expanded gradient as the step before, so only the flag tells them apart).
    leaves = [t.requires_grad_() for t in qkv()]
    op_torch.attention(*leaves, causal=True, deterministic=True, library=lib).sum().backward()
    assert builds(lib) == built + 2
