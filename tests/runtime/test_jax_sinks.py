"""Attention sinks in ``aotriton_rt.jax`` on the CPU: the glue around the kernels, with the kernels
replaced by jnp functions that keep their contract.

The forward stand-in returns ``(out, lse)`` over the visible keys, as ``attn_fwd`` does; the
backward stand-in computes what the backward kernels compute from the ``(out, lse)`` they are
given (``P = exp(S - lse)``, ``Delta = rowsum(dO * out)``, ``dS = P (dP - Delta)``). With them,
``jax.grad`` (under ``jit`` and ``vmap``) of ``aotriton_rt.jax.attention(..., sinks=s)`` must equal
``jax.grad`` of gpt-oss's reference (the sink joins the softmax, then is dropped) for q, k, v and
the sinks: which holds only if the glue rescales the forward's output and feeds the backward
kernels the rescaled pair. ``tests/runtime/test_jax_lowering.py`` lowers the real kernels with
sinks; ``tests/runtime/test_jax_gpu.py`` runs them.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
np = pytest.importorskip("numpy")

import aotriton_rt.jax as aj  # noqa: E402
from aotriton_rt.errors import ArgumentError  # noqa: E402
from aotriton_rt.jax import sinks as jax_sinks  # noqa: E402

jax_attention = importlib.import_module("aotriton_rt.jax.attention")  # the package exports its function


def _keep(sq: int, sk: int, causal: bool, window: Any, align: str) -> Any:
    """(Sq, Sk) bools: the keys each query row sees (the operator's masks)."""
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    diag = sk - sq if align == "bottom_right" else 0
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    keep = np.ones((sq, sk), bool)
    if right >= 0:
        keep &= j <= i + diag + right
    if left >= 0:
        keep &= j >= i + diag - left
    return keep


def _scores(q: Any, k: Any, o: Any) -> tuple[Any, Any]:
    """fp32 (B, Hq, Sq, Sk) masked scores of bhsd arrays (k repeated over each GQA group), and the mask."""
    group = q.shape[1] // k.shape[1]
    kf = jnp.repeat(k.astype(jnp.float32), group, axis=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if o.scale is None else o.scale
    s = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), kf) * scale
    keep = _keep(q.shape[2], k.shape[2], o.causal, o.window, o.align)
    return jnp.where(keep, s, -jnp.inf), keep


def _bhsd(x: Any, layout: str) -> Any:
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


class StandIns:
    """The attention kernels as jnp functions of the same contract; counts their calls."""

    def __init__(self) -> None:
        self.batches: dict[str, list[int]] = {"forward": [], "backward": []}

    def forward(self, q, k, v, bias, cu_q, cu_k, o, return_mask=False, alibi=None):
        assert bias is None and cu_q is None and not return_mask and alibi is None
        self.batches["forward"].append(q.shape[0])
        q, k, v = (_bhsd(x, o.layout) for x in (q, k, v))
        s, keep = _scores(q, k, o)
        lse = jax.nn.logsumexp(s, axis=-1)  # -inf for a row that sees no key
        p = jnp.where(keep, jnp.exp(s - jnp.where(jnp.isinf(lse), 0.0, lse)[..., None]), 0.0)
        vf = jnp.repeat(v.astype(jnp.float32), q.shape[1] // v.shape[1], axis=1)
        out = jnp.einsum("bhqk,bhkd->bhqd", p, vf).astype(q.dtype)
        return _bhsd(out, o.layout), lse

    def backward(self, dout, q, k, v, out, lse, bias, cu_q, cu_k, o, alibi=None):
        """What the backward kernels compute from the (out, lse) they are handed."""
        assert bias is None and cu_q is None and alibi is None
        self.batches["backward"].append(q.shape[0])
        dtypes = (q.dtype, k.dtype, v.dtype)
        dout, q, k, v, out = (_bhsd(x, o.layout).astype(jnp.float32) for x in (dout, q, k, v, out))
        group = q.shape[1] // k.shape[1]
        kf, vf = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
        scale = 1.0 / math.sqrt(q.shape[-1]) if o.scale is None else o.scale
        s, keep = _scores(q, k, o)
        p = jnp.where(keep, jnp.exp(s - lse[..., None]), 0.0)
        delta = (dout * out).sum(-1)
        ds = p * (jnp.einsum("bhqd,bhkd->bhqk", dout, vf) - delta[..., None])
        dq = jnp.einsum("bhqk,bhkd->bhqd", ds, kf) * scale
        dk = jnp.einsum("bhqk,bhqd->bhkd", ds, q) * scale
        dv = jnp.einsum("bhqk,bhqd->bhkd", p, dout)
        b, hk = k.shape[:2]
        dk, dv = (x.reshape(b, hk, group, *x.shape[2:]).sum(2) for x in (dk, dv))
        return tuple(_bhsd(g, o.layout).astype(t) for g, t in zip((dq, dk, dv), dtypes)) + (None,)


@pytest.fixture()
def kernels(monkeypatch) -> StandIns:
    """Route aotriton_rt.jax's kernel calls to the stand-ins (fresh cached closures either side)."""
    fake = StandIns()
    for cached in (jax_attention._differentiable, jax_attention._forward_core, jax_attention._backward_core):
        cached.cache_clear()
    monkeypatch.setattr(jax_attention, "_forward", fake.forward)
    monkeypatch.setattr(jax_attention, "_backward", fake.backward)
    yield fake
    for cached in (jax_attention._differentiable, jax_attention._forward_core, jax_attention._backward_core):
        cached.cache_clear()


def reference(q: Any, k: Any, v: Any, sinks: Any, layout: str = "bhsd", **options: Any) -> Any:
    """gpt-oss's attention with sinks in fp32: the sink joins each row's softmax, then is dropped."""
    o = jax_attention._options(options.get("causal", False), options.get("window"),
                               options.get("align", "top_left"), 0.0, None, 0, options.get("scale"), None, None,
                               layout, False, None, None, None, None, None)
    q, k, v = (_bhsd(x, layout) for x in (q, k, v))
    s, _ = _scores(q, k, o)
    vf = jnp.repeat(v.astype(jnp.float32), q.shape[1] // v.shape[1], axis=1)
    if sinks is None:
        p = jnp.nan_to_num(jax.nn.softmax(s, axis=-1))
    else:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], s.shape[:3] + (1,))
        p = jax.nn.softmax(jnp.concatenate([s, sink], -1), axis=-1)[..., :-1]
    return _bhsd(jnp.einsum("bhqk,bhkd->bhqd", p, vf), layout)


def _inputs(b=2, hq=4, hk=2, sq=24, sk=40, d=16, layout="bhsd", seed=0) -> tuple:
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    shape = (lambda h, s: (b, h, s, d)) if layout == "bhsd" else (lambda h, s: (b, s, h, d))
    q = jax.random.normal(keys[0], shape(hq, sq), jnp.float32)
    k = jax.random.normal(keys[1], shape(hk, sk), jnp.float32)
    v = jax.random.normal(keys[2], shape(hk, sk), jnp.float32)
    w = jax.random.normal(keys[3], shape(hq, sq), jnp.float32)
    # Sinks near the rows' logsumexp (a few units), so each takes a large share of its row.
    sinks = 2.5 + jax.random.normal(keys[4], (hq,), jnp.float32)
    return q, k, v, w, sinks


CASES = {
    "causal gqa": dict(causal=True),
    "sliding window bottom_right": dict(window=(8, 0), align="bottom_right"),
    "bshd, more queries than keys: rows without keys": dict(layout="bshd", causal=True, align="bottom_right",
                                                             sq=40, sk=24),
    "mqa, scale": dict(hk=1, scale=0.3),
}


def _split(case: dict) -> tuple[dict, dict]:
    opts = dict(case)
    shape = {n: opts.pop(n) for n in ("hk", "layout", "sq", "sk") if n in opts}
    return shape, opts


def _rel(a: Any, b: Any) -> float:
    return float(jnp.abs(a - b).max() / jnp.maximum(jnp.abs(b).max(), 1e-6))


@pytest.mark.parametrize("name", list(CASES))
def test_grad_with_sinks_under_jit_equals_the_reference_for_q_k_v_and_the_sinks(kernels, name) -> None:
    shape, opts = _split(CASES[name])
    layout = shape.get("layout", "bhsd")
    q, k, v, w, sinks = _inputs(**shape)

    def loss(fn):
        return lambda q, k, v, s: (fn(q, k, v, s) * w).sum()

    ours = lambda q, k, v, s: aj.attention(q, k, v, sinks=s, layout=layout, **opts)  # noqa: E731
    ref = lambda q, k, v, s: reference(q, k, v, s, layout, **opts)  # noqa: E731
    out = jax.jit(ours)(q, k, v, sinks)
    assert _rel(out, ref(q, k, v, sinks)) < 1e-5
    # The sinks matter here: without them the output is far off.
    assert _rel(ref(q, k, v, None), ref(q, k, v, sinks)) > 0.1
    got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    want = jax.grad(loss(ref), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    errs = [_rel(g, x) for g, x in zip(got, want)]
    assert max(errs) < 1e-4, errs
    assert got[3].shape == sinks.shape and got[3].dtype == sinks.dtype
    assert kernels.batches["forward"] and kernels.batches["backward"]


def test_a_backward_fed_the_forwards_pair_before_the_sinks_would_be_caught(kernels) -> None:
    # The test above can fail: the gradients of the rescaled output with the kernels' backward fed
    # the pair over the keys alone (the sinks left out of P and Delta) are wrong.
    q, k, v, w, sinks = _inputs()
    o = jax_attention._options(True, None, "top_left", 0.0, None, 0, None, None, None, "bhsd", False, None, None,
                               None, None, None)
    out, lse = kernels.forward(q, k, v, None, None, None, o)
    wrong = kernels.backward(w, q, k, v, out, lse, None, None, None, o)[:3]
    want = jax.grad(lambda q, k, v: (reference(q, k, v, sinks, causal=True) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    assert min(_rel(g, x) for g, x in zip(wrong, want)) > 1e-2


def test_attention_forward_and_backward_take_the_sinks_and_return_their_gradient_fifth(kernels) -> None:
    q, k, v, w, sinks = _inputs()
    f = jax.jit(lambda q, k, v, s: aj.attention_forward(q, k, v, causal=True, sinks=s))
    out, lse = f(q, k, v, sinks)
    plain_out, plain_lse = jax.jit(lambda q, k, v: aj.attention_forward(q, k, v, causal=True))(q, k, v)
    assert jnp.allclose(lse, jnp.logaddexp(plain_lse, sinks[None, :, None]), atol=1e-6)
    assert jnp.allclose(out, plain_out * jnp.exp(plain_lse - lse)[..., None], atol=1e-6)
    grads = jax.jit(lambda dout, q, k, v, out, lse, s: aj.attention_backward(dout, q, k, v, out, lse, causal=True,
                                                                             sinks=s))(w, q, k, v, out, lse, sinks)
    assert len(grads) == 5 and grads[3] is None
    want = jax.grad(lambda q, k, v, s: (aj.attention(q, k, v, causal=True, sinks=s) * w).sum(),
                    argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for g, x in zip(grads[:3] + grads[4:], want):
        assert _rel(g, x) < 1e-6
    # Without sinks: the four gradients, as before.
    assert len(aj.attention_backward(w, q, k, v, plain_out, plain_lse, causal=True)) == 4


@pytest.mark.parametrize("sinks_mapped", [True, False])
def test_vmap_of_the_grad_with_sinks_equals_the_reference_per_element(kernels, sinks_mapped: bool) -> None:
    batches = [_inputs(b=1, seed=s) for s in range(3)]
    q, k, v, w, sinks = (jnp.stack(xs) for xs in zip(*batches))
    if not sinks_mapped:
        sinks = sinks[0]

    def loss(fn):
        return lambda q, k, v, s, w: (fn(q, k, v, s) * w).sum()

    ours = lambda q, k, v, s: aj.attention(q, k, v, window=(6, 2), sinks=s)  # noqa: E731
    ref = lambda q, k, v, s: reference(q, k, v, s, window=(6, 2))  # noqa: E731
    axes = (0, 0, 0, 0 if sinks_mapped else None, 0)
    got = jax.jit(jax.vmap(jax.grad(loss(ours), argnums=(0, 1, 2, 3)), in_axes=axes))(q, k, v, sinks, w)
    want = jax.vmap(jax.grad(loss(ref), argnums=(0, 1, 2, 3)), in_axes=axes)(q, k, v, sinks, w)
    assert got[3].shape == (3, 4)  # one sinks gradient per mapped element, mapped sinks or not
    errs = [_rel(g, x) for g, x in zip(got, want)]
    assert max(errs) < 1e-4, errs
    # The kernels' vmap rule folded the mapped axis into the batch (3 elements of batch 1).
    assert max(kernels.batches["forward"]) == max(kernels.batches["backward"]) == 3


def test_sinks_in_bf16_or_fp16_get_a_gradient_of_their_own_dtype(kernels) -> None:
    q, k, v, w, sinks = _inputs()
    for dtype in (jnp.bfloat16, jnp.float16):
        g = jax.grad(lambda s: (aj.attention(q, k, v, causal=True, sinks=s) * w).sum())(sinks.astype(dtype))
        want = jax.grad(lambda s: (reference(q, k, v, s, causal=True) * w).sum())(sinks.astype(dtype))
        assert g.dtype == dtype and _rel(g.astype(jnp.float32), want.astype(jnp.float32)) < 2e-2


def test_rows_without_keys_and_sinks_of_minus_infinity_follow_the_eager_epilogue() -> None:
    out = jnp.array([[[[1.0, 2.0], [0.0, 0.0]]] * 3], jnp.float32)  # (1, 3, 2, 2): row 1 saw no key
    lse = jnp.array([[[0.5, -jnp.inf]] * 3], jnp.float32)
    sinks = jnp.array([0.5, -jnp.inf, 1.0], jnp.float32)
    got_out, got_lse = jax_sinks.apply_sinks(out, lse, sinks, layout="bhsd")
    assert jnp.allclose(got_lse[0, 0], jnp.array([0.5 + math.log(2), 0.5]))  # no key: lse = the sink
    assert jnp.allclose(got_out[0, 0, 0], jnp.array([0.5, 1.0])) and jnp.array_equal(got_out[0, 0, 1], out[0, 0, 1])
    assert jnp.array_equal(got_out[0, 1], out[0, 1]) and jnp.array_equal(got_lse[0, 1], lse[0, 1])  # no sink
    assert not jnp.isnan(got_out).any()
    dout = jnp.ones_like(out)
    g = jax_sinks.sinks_grad(dout, got_out, got_lse, sinks, layout="bhsd")
    assert g[1] == 0.0 and not jnp.isnan(g).any()
    assert jnp.allclose(g[0], -0.5 * (0.5 + 1.0))  # row 0: -exp(s - lse') * rowsum(dout * out')


def test_packed_rows_outside_the_sequences_are_neither_touched_nor_summed() -> None:
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    total, h, d = 12, 2, 4
    out = jax.random.normal(keys[0], (total, h, d), jnp.bfloat16).at[10:].set(jnp.nan)
    lse = jax.random.normal(keys[1], (h, total), jnp.float32).at[:, 10:].set(jnp.nan)
    dout = jax.random.normal(keys[2], (total, h, d), jnp.bfloat16)
    sinks = jnp.array([0.3, -0.7], jnp.float32)
    cu = jnp.array([2, 6, 10], jnp.int32)  # rows 0-1 and 10-11 belong to no sequence
    got_out, got_lse = jax_sinks.apply_sinks(out, lse, sinks, layout="bhsd", cu_seqlens_q=cu)
    rows = np.r_[0:2, 10:12]
    assert np.array_equal(np.asarray(got_out[rows], np.float32), np.asarray(out[rows], np.float32), equal_nan=True)
    assert np.array_equal(np.asarray(got_lse[:, rows]), np.asarray(lse[:, rows]), equal_nan=True)
    dense_out, dense_lse = jax_sinks.apply_sinks(out[None, 2:10], lse[None, :, 2:10], sinks, layout="bshd")
    assert jnp.array_equal(got_out[2:10], dense_out[0]) and jnp.array_equal(got_lse[:, 2:10], dense_lse[0])
    g = jax_sinks.sinks_grad(dout, got_out, got_lse, sinks, layout="bhsd", cu_seqlens_q=cu)
    want = jax_sinks.sinks_grad(dout[None, 2:10], dense_out, dense_lse, sinks, layout="bshd")
    assert jnp.allclose(g, want) and not jnp.isnan(g).any()


def test_sinks_are_refused_with_the_eager_errors(kernels) -> None:
    q, k, v, w, sinks = _inputs()
    fwd = lambda s: aj.attention(q, k, v, causal=True, sinks=s)  # noqa: E731
    with pytest.raises(ArgumentError, match=r"sinks must have shape \(4,\): one logit per query head, got \(2, 2\)"):
        jax.eval_shape(fwd, jax.ShapeDtypeStruct((2, 2), jnp.float32))
    with pytest.raises(ArgumentError, match="sinks must be fp16, bf16 or fp32, got i32"):
        jax.eval_shape(fwd, jax.ShapeDtypeStruct((4,), jnp.int32))
    with pytest.raises(ArgumentError, match="sinks must be an array of one logit per query head, got list"):
        aj.attention_forward(q, k, v, sinks=[0.0] * 4)
    out, lse = aj.attention_forward(q, k, v, sinks=sinks)
    with pytest.raises(ArgumentError, match=r"sinks must have shape \(4,\): one logit per query head, got \(2,\)"):
        aj.attention_backward(w, q, k, v, out, lse, sinks=sinks[:2])
