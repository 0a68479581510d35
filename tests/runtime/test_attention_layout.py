"""One call, three launch paths, one argument list.

The eager operator's direct plan (open slots filled per call), its general path (copies and
padding) and the JAX path each lay out the kernels' arguments from their own arrays and strides
through :mod:`aotriton_rt.ops.attention.family`. For a matrix of calls this runs all three on
CPU (CPU torch tensors stand in for GPU arrays, handles carry the real argument lists of
``builder/kernels/attention*.py`` and record each launch instead of running it; the JAX path
runs eagerly with its launch recorded) and checks that they launch the same kernels with the same
arguments: every scalar and stride equal, the same arguments null, in the handle's catalog order.
Only addresses may differ.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import importlib  # noqa: E402

import numpy as np  # noqa: E402

from aotriton_rt.jax.kernels import Out, Update  # noqa: E402
from aotriton_rt.ops import attention as op  # noqa: E402
from aotriton_rt.ops.attention import backward_plan, dispatch, family, plan, problem  # noqa: E402
from tests.helpers.cpu_arrays import cpu_describer  # noqa: E402
from tests.runtime.test_attention_op import InterpretedKernel, InterpretedLibrary  # noqa: E402

# The module (``aotriton_rt.jax.attention`` names the function the package exports).
jax_attention = importlib.import_module("aotriton_rt.jax.attention")
_NAMES = {torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int8: "i8"}


class RecordingKernel(InterpretedKernel):
    """The real argument list; a launch records its arguments by name and runs nothing."""

    @property
    def params(self) -> dict:  # what the JAX path reads of a handle
        return self.spec

    def __call__(self, *args: Any, stream: Any = None) -> None:
        self.lib.launches.append((self.name, dict(self.spec), list(self.arg_names), list(args)))


class RecordingLibrary(InterpretedLibrary):
    def kernel(self, name: str, **params: Any) -> RecordingKernel:
        return RecordingKernel(self, name, params)


_LIBS: dict[tuple, RecordingLibrary] = {}


def library(missing: tuple[str, ...]) -> RecordingLibrary:
    if missing not in _LIBS:
        _LIBS[missing] = RecordingLibrary(missing)
    lib = _LIBS[missing]
    lib.launches.clear()
    dispatch.kernels_of(lib).plans.clear()
    return lib


@pytest.fixture(autouse=True)
def cpu_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(problem, "_describe", cpu_describer(problem._describe))
    monkeypatch.setattr(dispatch, "_available", lambda lib, name, params: lib.has(name, params))
    # These handles are this checkout's declarations: a variant takes the arguments its source declares.
    monkeypatch.setattr(dispatch, "_takes", lambda lib, name, params, args: all(
        a in lib.decls[name].signature for a in args))


# ---------------------------------------------------------------------------------------------
# The calls.
# ---------------------------------------------------------------------------------------------

_NO_80_96 = ("attn_fwd:HEAD_DIM=80", "attn_fwd:HEAD_DIM=96", "attn_bwd_preprocess:HEAD_DIM=80",
             "attn_bwd_preprocess:HEAD_DIM=96")

#: name: shape and options. Shapes: B, Hq, Hk, Sq, Sk, D, Dv; ``varlen``: (q, k) lengths per
#: sequence; ``missing``: what the images lack (without 80 and 96, those run padded on 128);
#: ``scheme``: the backward's; ``bias_grad``: whether the backward computes dBias; ``copied``: an
#: operand the kernels cannot read in place (a bias broadcast over keys or of keys not a multiple
#: of 8, a v padded to q's head dim), so that even the first path runs general.
CASES: dict[str, dict[str, Any]] = {
    "plain_bhsd": {},
    "bshd_causal_gqa": {"layout": "bshd", "causal": True, "Hq": 4, "Hk": 2},
    "window_bottom_right_lopsided": {"window": (5, 3), "align": "bottom_right", "Sq": 24, "Sk": 40},
    "causal_bottom_right_mqa_bshd": {"causal": True, "align": "bottom_right", "Hq": 3, "Hk": 1, "layout": "bshd",
                                     "Sq": 40, "Sk": 24},
    "bias_broadcast_batch_causal": {"bias": (1, 2, 24, 24), "causal": True},
    "bias_broadcast_keys_copied": {"bias": (1, 2, 1, 1), "causal": True, "copied": True},
    "bias_full_grad": {"bias": "full", "bias_grad": True},
    "bias_rows_keys_grad_bshd": {"bias": (24, 24), "bias_grad": True, "layout": "bshd"},
    "dropout_mask": {"dropout_p": 0.25, "seed": 7, "offset": 3, "return_mask": True},
    "dropout_bias_window_gqa": {"dropout_p": 0.1, "seed": 11, "bias": "full", "window": (4, 0), "Hq": 4, "Hk": 2},
    "varlen_causal_gqa": {"varlen": ((5, 9), (17, 31), (16, 16)), "causal": True, "Hq": 4, "Hk": 2},
    "varlen_bias_dropout_grad": {"varlen": ((19, 19), (33, 7)), "bias": "full", "bias_grad": True,
                                 "dropout_p": 0.2, "seed": 5, "copied": True},
    "varlen_bias_in_place": {"varlen": ((9, 16), (24, 8)), "bias": "full"},
    "head_dim_64_v_32_padded": {"D": 64, "Dv": 32, "copied": True},
    "head_dim_80_padded": {"D": 80, "missing": _NO_80_96},
    "head_dim_96_padded_bshd_causal": {"D": 96, "layout": "bshd", "causal": True, "missing": _NO_80_96},
    "head_dim_96_bucket": {"D": 96},
    "atomic": {"scheme": "atomic", "causal": True},
    "atomic_varlen_bias_copied": {"scheme": "atomic", "varlen": ((7, 21), (30, 30)), "bias": (1, 1, 1, 1),
                                  "bias_grad": True, "copied": True},
    "atomic_padded_80_bshd": {"scheme": "atomic", "D": 80, "layout": "bshd", "missing": _NO_80_96},
    # ALiBi slopes (fp32): shared by the batch ("heads", batch stride 0) or per sequence ("batch").
    "alibi_heads_causal_bshd": {"alibi": "heads", "causal": True, "layout": "bshd"},
    "alibi_per_sequence_varlen_gqa": {"alibi": "batch", "varlen": ((5, 9), (17, 31), (16, 16)), "causal": True,
                                      "Hq": 4, "Hk": 2},
    "alibi_per_sequence_padded_80": {"alibi": "batch", "D": 80, "missing": _NO_80_96},
    "alibi_atomic_dropout_window": {"alibi": "batch", "scheme": "atomic", "dropout_p": 0.1, "seed": 3,
                                    "window": (6, 0), "align": "bottom_right", "Sk": 40},
}

_OPTIONS = ("causal", "window", "align", "dropout_p", "seed", "offset", "layout")


class Call:
    """One case's arrays, as numpy (the source), torch (eager) and JAX arrays."""

    def __init__(self, case: dict[str, Any]) -> None:
        rng = np.random.default_rng(0)
        self.case = case
        B, Hq, Hk = case.get("B", 2), case.get("Hq", 2), case.get("Hk", case.get("Hq", 2))
        Sq, Sk = case.get("Sq", 24), case.get("Sk", case.get("Sq", 24))
        D, Dv = case.get("D", 64), case.get("Dv", case.get("D", 64))
        self.layout = case.get("layout", "bhsd")
        self.varlen = case.get("varlen")
        self.options = {n: case[n] for n in _OPTIONS if n in case}

        def array(*shape: int, dtype: Any = np.float16) -> np.ndarray:
            return rng.standard_normal(shape).astype(dtype)

        if self.varlen:
            lq, lk = [s for s, _ in self.varlen], [s for _, s in self.varlen]
            B, Sq, Sk = len(lq), max(lq), max(lk)
            shapes = [(sum(lq), Hq, D), (sum(lk), Hk, D), (sum(lk), Hk, Dv)]
            self.cu = [np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32) for lengths in (lq, lk)]
            self.options.update(max_seqlen_q=Sq, max_seqlen_k=Sk)
            out_shape, lse_shape = (sum(lq), Hq, Dv), (Hq, sum(lq))
        else:
            def shape(h: int, s: int, d: int) -> tuple[int, ...]:
                return (B, h, s, d) if self.layout == "bhsd" else (B, s, h, d)

            shapes = [shape(Hq, Sq, D), shape(Hk, Sk, D), shape(Hk, Sk, Dv)]
            self.cu = None
            out_shape, lse_shape = shape(Hq, Sq, Dv), (B, Hq, Sq)
        self.qkv = [array(*s) for s in shapes]
        bias = case.get("bias")
        self.bias = None if bias is None else array(*((B, Hq, Sq, Sk) if bias == "full" else bias))
        alibi = case.get("alibi")
        self.alibi = None if alibi is None else rng.uniform(0.05, 0.5, (Hq,) if alibi == "heads" else (B, Hq)
                                                            ).astype(np.float32)
        self.dout, self.out = array(*out_shape), array(*out_shape)
        self.lse = array(*lse_shape, dtype=np.float32)
        self.out_shape = out_shape

    def torch(self) -> dict[str, Any]:
        t = lambda a: None if a is None else torch.from_numpy(a.copy())  # noqa: E731
        q, k, v = (t(a) for a in self.qkv)
        cu = (None, None) if self.cu is None else (t(self.cu[0]), t(self.cu[1]))
        return {"q": q, "k": k, "v": v, "bias": t(self.bias), "cu_seqlens_q": cu[0], "cu_seqlens_k": cu[1],
                "dout": t(self.dout), "out": t(self.out), "lse": t(self.lse), "alibi_slopes": t(self.alibi)}

    def jax(self) -> dict[str, Any]:
        j = lambda a: None if a is None else jnp.asarray(a)  # noqa: E731
        q, k, v = (j(a) for a in self.qkv)
        cu = (None, None) if self.cu is None else (j(self.cu[0]), j(self.cu[1]))
        return {"q": q, "k": k, "v": v, "bias": j(self.bias), "cu_seqlens_q": cu[0], "cu_seqlens_k": cu[1],
                "dout": j(self.dout), "out": j(self.out), "lse": j(self.lse), "alibi_slopes": j(self.alibi)}


def _shown(value: Any) -> Any:
    """What a launch passes, but for the address: ``null``, ``array``, or a scalar with its type."""
    if value is None:
        return "null"
    if isinstance(value, (torch.Tensor, jax.Array, Out, Update)):
        return "array"
    assert type(value) in (int, float), f"{type(value).__name__}: {value!r}"
    return (type(value).__name__, value)


def _launches(lib: RecordingLibrary) -> list[tuple[str, dict, list[tuple[str, Any]]]]:
    """(kernel, spec, [(argument, shown value)] in the handle's order) of each launch so far."""
    found = [(name, spec, [(n, _shown(v)) for n, v in zip(names, args, strict=True)])
             for name, spec, names, args in lib.launches]
    lib.launches.clear()
    return found


def _plan_kind(lib: RecordingLibrary) -> type:
    (made,) = dispatch.kernels_of(lib).plans._plans.values()
    dispatch.kernels_of(lib).plans.clear()
    return type(made)


def _direct_serves(case: dict[str, Any], backward: bool) -> bool:
    padded = any("HEAD_DIM=" in m for m in case.get("missing", ()))
    return not (padded or case.get("copied") or (backward and case.get("bias") is not None and case.get("bias_grad")))


# ---------------------------------------------------------------------------------------------
# The three paths.
# ---------------------------------------------------------------------------------------------

def eager_forward(lib: RecordingLibrary, call: Call, general: bool) -> tuple[type, list]:
    a = call.torch()
    out = torch.empty(call.out_shape, dtype=torch.float16) if general else None
    op.attention(a["q"], a["k"], a["v"], bias=a["bias"], cu_seqlens_q=a["cu_seqlens_q"],
                 cu_seqlens_k=a["cu_seqlens_k"], out=out, return_mask=call.case.get("return_mask", False),
                 alibi_slopes=a["alibi_slopes"], library=lib, **call.options)
    return _plan_kind(lib), _launches(lib)


def eager_backward(lib: RecordingLibrary, call: Call, general: bool, bias_grad: bool) -> tuple[type, list]:
    a = call.torch()
    dq = torch.empty_like(a["q"]) if general else None
    op.attention_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], bias=a["bias"],
                          cu_seqlens_q=a["cu_seqlens_q"], cu_seqlens_k=a["cu_seqlens_k"],
                          scheme=call.case.get("scheme"), bias_grad=bias_grad, dq=dq, alibi_slopes=a["alibi_slopes"],
                          library=lib, **call.options)
    return _plan_kind(lib), _launches(lib)


def _recording_launch(lib: RecordingLibrary) -> Any:
    def launch(handle: Any, o: Any, values: dict[str, Any]) -> Any:
        args = [values[n] for n in handle.arg_names]
        lib.launches.append((handle.name, dict(handle.spec), list(handle.arg_names), args))
        outs = [jnp.zeros(v.shape, v.dtype) if isinstance(v, Out) else v.array for v in args
                if isinstance(v, (Out, Update))]
        return outs[0] if len(outs) == 1 else tuple(outs)

    return launch


def jax_forward(lib: RecordingLibrary, call: Call, monkeypatch: pytest.MonkeyPatch) -> list:
    a = call.jax()
    monkeypatch.setattr(jax_attention, "_launch", _recording_launch(lib))
    jax_attention.attention_forward(a["q"], a["k"], a["v"], bias=a["bias"], cu_seqlens_q=a["cu_seqlens_q"],
                                    cu_seqlens_k=a["cu_seqlens_k"], return_mask=call.case.get("return_mask", False),
                                    alibi_slopes=a["alibi_slopes"], library=lib, **call.options)
    return _launches(lib)


def jax_backward(lib: RecordingLibrary, call: Call, monkeypatch: pytest.MonkeyPatch) -> list:
    a = call.jax()
    monkeypatch.setattr(jax_attention, "_launch", _recording_launch(lib))
    jax_attention.attention_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], bias=a["bias"],
                                     cu_seqlens_q=a["cu_seqlens_q"], cu_seqlens_k=a["cu_seqlens_k"],
                                     scheme=call.case.get("scheme"), alibi_slopes=a["alibi_slopes"], library=lib,
                                     **call.options)
    return _launches(lib)


@pytest.mark.parametrize("name", list(CASES))
def test_the_direct_plan_the_general_path_and_jax_launch_the_same_forward_arguments(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[name]
    lib = library(case.get("missing", ()))
    call = Call(case)
    kind, direct = eager_forward(lib, call, general=False)
    assert kind is (plan._DirectForward if _direct_serves(case, False) else plan._GeneralForward)
    kind, general = eager_forward(lib, call, general=True)
    assert kind is plan._GeneralForward
    traced = jax_forward(lib, call, monkeypatch)
    assert len(general) == 1 and general[0][0] == family.FWD
    assert direct == general
    assert traced == general
    if any("HEAD_DIM=" in m for m in case.get("missing", ())):
        assert general[0][1]["HEAD_DIM"] == 128 != case["D"]


@pytest.mark.parametrize("name", list(CASES))
def test_the_direct_plan_the_general_path_and_jax_launch_the_same_backward_arguments(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[name]
    lib = library(case.get("missing", ()))
    call = Call(case)
    bias_grad = bool(case.get("bias_grad"))
    kind, direct = eager_backward(lib, call, general=False, bias_grad=bias_grad)
    assert kind is (backward_plan._DirectBackward if _direct_serves(case, True) else backward_plan._GeneralBackward)
    kind, general = eager_backward(lib, call, general=True, bias_grad=bias_grad)
    assert kind is backward_plan._GeneralBackward
    last = family.CONVERT if case.get("scheme") == "atomic" else family.DQ
    assert [launch[0] for launch in general] == [family.PRE, family.DKDV, last]
    assert direct == general
    if case.get("bias") is None or bias_grad:  # JAX always computes dBias
        assert jax_backward(lib, call, monkeypatch) == general
    if bias_grad:
        (dkdv,) = [args for kernel, _, args in general if kernel == family.DKDV]
        assert dict(dkdv)["DBias"] == "array"


def test_a_bias_without_its_gradient_runs_the_direct_plan_with_the_general_paths_arguments(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # ... and differs from the launch that computes dBias in the arguments the dBias buffer fills.
    case = {"bias": "full", "causal": True}
    lib = library(())
    call = Call(case)
    kind, direct = eager_backward(lib, call, general=False, bias_grad=False)
    assert kind is backward_plan._DirectBackward
    _, general = eager_backward(lib, call, general=True, bias_grad=False)
    assert direct == general
    _, with_grad = eager_backward(lib, call, general=True, bias_grad=True)
    traced = jax_backward(lib, call, monkeypatch)
    assert traced == with_grad
    differ = {n for (_, _, a), (_, _, b) in zip(general, with_grad) for (n, x), (_, y) in zip(a, b) if x != y}
    assert differ == {"DBias", "stride_dbz", "stride_dbh", "stride_dbm"}


# ---------------------------------------------------------------------------------------------
# The family covers every argument the builder declares.
# ---------------------------------------------------------------------------------------------

def _args(name: str) -> list[str]:
    from builder.registry import load_kernels

    return [n for n, t in load_kernels()[name].signature.items() if t != "constexpr"]


def _stand_ins() -> list[tuple[str, str]]:
    return ([(family.FWD, own) for own in family.ARCH_FORWARDS.values()]
            + [(role, own) for kernels in family.ARCH_BACKWARDS.values() for role, own in kernels.items()]
            + list(family.ALIGNED_SIBLINGS.items()))


def test_every_argument_the_builder_declares_is_named_by_the_family() -> None:
    strides = {n: (0, 0, 0) for n in ("q", "k", "v", "out", "dout", "dq", "dk", "dv")}
    scalars = family.scalar_arguments(batch=1, heads_q=1, heads_k=1, seqlen_q=1, seqlen_k=1, scale=1.0,
                                      dropout_p=0.0, seed=0, offset=0, window_left=-1, window_right=-1,
                                      causal_mode=0)
    assert tuple(scalars) == family.SCALARS
    forward = family.forward_arguments({}, {n: strides[n] for n in ("q", "k", "v", "out")}, (0, 0), scalars)
    backward = family.backward_arguments({}, strides, (0, 0), scalars)
    forwards = [family.FWD, *family.ARCH_FORWARDS.values()]
    backwards = [family.PRE, family.DKDV, family.DQ, family.CONVERT,
                 *(n for kernels in family.ARCH_BACKWARDS.values() for n in kernels.values()),
                 *family.ALIGNED_SIBLINGS.values()]
    for name in forwards:
        assert set(_args(name)) <= set(forward), name
    for name in backwards:
        assert set(_args(name)) <= set(backward), name


def test_each_stand_in_takes_the_arguments_of_the_kernel_it_stands_in_for() -> None:
    assert _stand_ins()
    for portable, own in _stand_ins():
        assert _args(own) == _args(portable), own


def test_the_argument_builders_refuse_names_they_do_not_know() -> None:
    with pytest.raises(TypeError, match=r"forward arrays: unknown names \['query'\]"):
        family.forward_arguments({"query": None}, {}, (0, 0), {})
    with pytest.raises(TypeError, match=r"backward strides: unknown names \['do'\]"):
        family.backward_arguments({}, {"do": (0, 0, 0)}, (0, 0), {})
