"""aotriton_rt.jax on a CUDA GPU: every catalog kernel under jax.jit, attention identical to the
eager path, gradients against references, vmap, and a small transformer block training.

Run with prebuilt images (the default set for the GPU's arch) and jax[cuda13]::

    AOTRITON_RT_TEST_IMAGES=.gpu-images python -m pytest -q -m gpu tests/runtime/test_jax_gpu.py

With ``$OUT`` set, a per-case summary (max differences, bitwise identity) is written to
``$OUT/jax_gpu.json``.
"""

from __future__ import annotations

import atexit
import json
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch (eager path) shares the GPU
os.environ["AOTRITON_RT_FP8_SM90"] = "1"  # the Gluon FP8 forward is tested, even where the environment says "0"

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
np = pytest.importorskip("numpy")

import aotriton_rt  # noqa: E402

pytestmark = pytest.mark.gpu
SUMMARY: list[dict] = []


@atexit.register
def _write_summary() -> None:
    if not SUMMARY:
        return
    print("\njax gpu summary:")
    for row in SUMMARY:
        print("  " + ", ".join(f"{k}={v}" for k, v in row.items()))
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "jax_gpu.json").write_text(json.dumps(SUMMARY, indent=1))


@pytest.fixture(scope="module")
def lib(gpu_images: Path) -> aotriton_rt.Library:
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("jax sees no GPU (pip install 'jax[cuda13]')")
    return aotriton_rt.Library(gpu_images)


@pytest.fixture(scope="module")
def aj(lib: aotriton_rt.Library) -> Any:
    import aotriton_rt.jax as module

    return module


def _np(x: Any) -> Any:
    if hasattr(x, "detach"):  # torch (the eager path's outputs)
        return x.detach().float().cpu().numpy()
    return np.asarray(jnp.asarray(x, jnp.float32))


def _rel(a: Any, b: Any) -> float:
    a, b = _np(a), _np(b)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


_JNP = {"fp16": jnp.float16, "bf16": jnp.bfloat16, "fp32": jnp.float32}


# -- every catalog kernel in the image folder, under jit --------------------------------------

def _plain_kernel_case(aj: Any, lib: Any, v: Any) -> None:
    dtype = _JNP[v.spec["dtype"]]
    key = jax.random.PRNGKey(0)
    params = {k: v.spec[k] for k in v.spec}
    k = aj.kernel(v.kernel, library=lib, **params)
    if v.kernel == "add":
        x, y = (jax.random.normal(s, (100_003,), dtype) for s in jax.random.split(key))
        got = jax.jit(lambda x, y: k(x, y, aj.Out(x.shape, x.dtype), x.size))(x, y)
        ref = x + y
    elif v.kernel == "softmax":
        cols = v.spec["BLOCK"] - 3
        x = jax.random.normal(key, (37, cols), dtype)
        got = jax.jit(lambda a: k(aj.Out(a.shape, a.dtype), a, 37, cols, cols, cols))(x)
        ref = jax.nn.softmax(x.astype(jnp.float32), axis=-1)
    else:  # layernorm / rmsnorm
        cols = v.spec["BLOCK"] - 5
        x = jax.random.normal(key, (33, cols), dtype)
        w = jnp.linspace(0.5, 1.5, cols).astype(dtype)
        b = jnp.linspace(-0.1, 0.1, cols).astype(dtype)
        f = lambda x, w, b: k(x, aj.Out(x.shape, x.dtype), w, b, aj.Out((33,), jnp.float32),  # noqa: E731
                              aj.Out((33,), jnp.float32), 33, cols, cols, cols, 1e-5)
        got = jax.jit(f)(x, w, b)[0]
        xf = x.astype(jnp.float32)
        if v.kernel == "rmsnorm":
            ref = xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + 1e-5) * w.astype(jnp.float32)
        else:
            mu = xf.mean(-1, keepdims=True)
            ref = (xf - mu) * jax.lax.rsqrt(((xf - mu) ** 2).mean(-1, keepdims=True) + 1e-5) \
                * w.astype(jnp.float32) + b.astype(jnp.float32)
    err = _rel(got, ref)
    SUMMARY.append({"case": f"{v.kernel} {v.spec}", "rel_err": f"{err:.1e}"})
    assert err < (1e-2 if v.spec["dtype"] != "fp32" else 1e-5), (v.kernel, v.spec, err)


def _attention_options(spec: dict) -> tuple[dict, tuple[int, int, int, int, int, int]]:
    """Options and (B, Hq, Hk, Sq, Sk, D) exercising exactly this attention spec."""
    causal = spec.get("CAUSAL", 0)
    opts: dict[str, Any] = {}
    if causal:
        opts.update(causal=True, align="top_left" if causal == 1 else "bottom_right")
    if spec.get("BIAS"):
        opts["bias"] = True
    if spec.get("DROPOUT"):
        opts.update(dropout_p=0.2, seed=1234, offset=7)
    if spec.get("SOFTCAP"):
        opts["softcap"] = 2.0  # unit-variance inputs: scores of a few units, which this cap bends
    if spec.get("ALIBI"):
        # Per sequence (two, dense or packed) and query head (four): a traced operand, as q is.
        opts["alibi_slopes"] = jnp.linspace(0.05, 0.4, 8, dtype=jnp.float32).reshape(2, 4)
    sq, sk = (200, 333) if causal else (257, 257)
    return opts, (2, 4, 2, sq, sk, spec["HEAD_DIM"])


def _inputs(dtype: Any, b: int, hq: int, hk: int, sq: int, sk: int, d: int, dv: int, bias: bool) -> tuple:
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    q = jax.random.normal(keys[0], (b, hq, sq, d), dtype)
    k = jax.random.normal(keys[1], (b, hk, sk, d), dtype)
    v = jax.random.normal(keys[2], (b, hk, sk, dv), dtype)
    dout = jax.random.normal(keys[3], (b, hq, sq, dv), dtype)
    bb = jax.random.normal(keys[4], (1, hq, sq, sk), dtype) if bias else None
    return q, k, v, dout, bb


def test_every_catalog_kernel_is_callable_under_jit(lib: Any, aj: Any) -> None:
    seen = set()
    from aotriton_rt import arch as _arch

    arch = _arch.normalize("cuda", jax.devices()[0].compute_capability)
    for v in lib.variants:
        ident = (v.kernel, tuple(sorted(v.spec.items())))
        if v.target.arch != arch or ident in seen:
            continue
        seen.add(ident)
        if v.kernel in _PLAIN_KERNELS:
            _plain_kernel_case(aj, lib, v)
        elif v.kernel == "attn_fwd":
            _attention_case(aj, lib, v.spec)  # and the backward kernels it implies
        elif v.kernel in _ARCH_FORWARDS:
            # The same calls on the arch's own forward (where the tuning rules might send them elsewhere).
            from builder.tune import forced_forward

            _attention_case(aj, forced_forward(lib, v.kernel), v.spec, expect_kernel=v.kernel)
        elif v.kernel in _FP8_FORWARDS:
            _fp8_case(aj, lib, v.kernel, v.spec)
        elif v.kernel == "attn_decode" and v.spec.get("KV_DTYPE", v.spec["dtype"]) != v.spec["dtype"]:
            continue  # fp8 caches: their scales and raw-kernel calls are tests/runtime/test_decode_fp8_gpu.py's
        elif v.kernel == "attn_decode":
            _decode_case(aj, lib, v.spec)  # with attn_decode_append and attn_decode_combine
        elif v.kernel in _HELPER_CASES:
            _HELPER_CASES[v.kernel](aj, lib, v.spec)
        elif v.kernel not in _COVERED_BY_OTHERS:
            pytest.fail(f"no jit case for catalog kernel {v.kernel}: add one to this test")
    assert seen


_PLAIN_KERNELS = ("add", "softmax", "layernorm", "rmsnorm")
_ARCH_FORWARDS = ("attn_fwd_sm90",)
_FP8_FORWARDS = ("attn_fwd_fp8", "attn_fwd_fp8_sm90")
# Launched by the cases above: the backward by _attention_case (on sm90 through the Gluon dK/dV and
# dQ where the images hold the call's spec), append and combine by _decode_case. The Gluon dK/dV's
# aligned-length sibling serves lengths that are multiples of 16, which those cases avoid: its GPU
# test is tests/runtime/test_attention_bwd_sm90_gpu.py (the JAX path passes the same LSE strides).
_COVERED_BY_OTHERS = ("attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq", "attn_bwd_dq_convert",
                      "attn_bwd_dkdv_sm90", "attn_bwd_dkdv_sm90_a16", "attn_bwd_dq_sm90", "attn_decode_append",
                      "attn_decode_combine",
                      # Under jit XLA writes the FP8 forward's V^T; the eager FP8 tests run the pre-pass.
                      "attn_fp8_v_transpose")


# -- the eager paths' helper kernels (the decode route's packing, attention sinks), each on its own --

_FAULT_LENGTH = 1  # builder/kernels/decode.py


def _route_inputs() -> tuple:
    """Three sequences against a 64-row cache: a clean one, one whose length is out of range (a
    fault: its packed rows and outputs are NaN), one with 4 rows of left padding. The packed
    lengths and prefix sums the lengths kernel must produce."""
    lens, starts, capacity, seqlen_q = np.array([10, 69, 30], np.int32), np.array([0, 0, 4], np.int32), 64, 2
    n = np.array([10, 64, 26], np.int32)  # the bad sequence keeps its clamped 64 rows
    cu_k = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    faults = np.array([0, _FAULT_LENGTH, 0], np.int32)
    return lens, starts, capacity, seqlen_q, cu_k, faults


def _lengths_case(aj: Any, lib: Any, spec: dict) -> None:
    lens, starts, capacity, seqlen_q, cu_k, faults = _route_inputs()
    b = len(lens)
    k = aj.kernel("attn_decode_lengths", library=lib, **spec)
    cq, ck, sf = jax.jit(lambda lens, starts: k(aj.Out((b + 1,), jnp.int32), aj.Out((b + 1,), jnp.int32),
                                                aj.Out((b,), jnp.int32), lens, starts, b, seqlen_q, 0,
                                                capacity))(jnp.asarray(lens), jnp.asarray(starts))
    assert np.array_equal(np.asarray(cq), np.arange(b + 1) * seqlen_q)
    assert np.array_equal(np.asarray(ck), cu_k) and np.array_equal(np.asarray(sf), faults), (ck, sf)
    SUMMARY.append({"case": f"attn_decode_lengths {spec}", "exact": True})


def _pack_case(aj: Any, lib: Any, spec: dict) -> None:
    """Non-paged caches (B, capacity, Hk, D) and paged ones (4 shuffled pages of 16 rows per
    sequence) packed into the varlen forward's (total, Hk, D) rows."""
    lens, starts, capacity, _, cu_k, faults = _route_inputs()
    b, hk, d, page = len(lens), 2, spec["HEAD_DIM"], 16
    dtype, paged = _JNP[spec["dtype"]], spec["PAGED"]
    rng = np.random.default_rng(1)
    dense = rng.standard_normal((2, b, capacity, hk, d)).astype(np.float32)
    if paged:
        blocks = capacity // page
        table = rng.permutation(b * blocks).reshape(b, blocks).astype(np.int32)
        caches = np.zeros((2, b * blocks, page, hk, d), np.float32)
        for z in range(b):
            for r in range(capacity):
                caches[:, table[z, r // page], r % page] = dense[:, z, r]
        rows = page * hk * d
    else:
        table, caches, rows = None, dense, capacity * hk * d
    kc, vc = (jnp.asarray(c, dtype) for c in caches)
    total = int(cu_k[-1])
    k = aj.kernel("attn_decode_pack", library=lib, **spec)
    values = {"stride_kz": rows, "stride_kh": d, "stride_kn": hk * d, "stride_vz": rows, "stride_vh": d,
              "stride_vn": hk * d, "stride_okm": hk * d, "stride_okh": d, "stride_ovm": hk * d, "stride_ovh": d,
              "stride_btz": capacity // page if paged else 0, "batch": b, "num_heads_k": hk, "seqlen_new": 0,
              "capacity": capacity, "num_pages": kc.shape[0] if paged else 1, "page_size": page, "head_dim": d}

    def run(kc: Any, vc: Any, cu: Any, table: Any, lens: Any, starts: Any, sf: Any, fl: Any) -> tuple:
        arrays = {"K": kc, "V": vc, "KOut": aj.Out((total, hk, d), dtype), "VOut": aj.Out((total, hk, d), dtype),
                  "CuK": cu, "BlockTable": table, "CacheSeqlens": lens, "CacheStart": starts,
                  "SeqFaults": aj.Update(sf), "Faults": aj.Update(fl)}
        return k(*[arrays[n] if n in arrays else values[n] for n in k.arg_names])

    ko, vo, sf, fl = jax.jit(run)(kc, vc, jnp.asarray(cu_k), None if table is None else jnp.asarray(table),
                                  jnp.asarray(lens), jnp.asarray(starts), jnp.asarray(faults),
                                  jnp.zeros((1,), jnp.int32))
    want = np.full((2, total, hk, d), np.nan, np.float32)
    for z, (n0, n1) in enumerate(zip(cu_k[:-1], cu_k[1:])):
        if not faults[z]:
            want[:, n0:n1] = np.asarray(jnp.asarray(jnp.asarray(dense[:, z, starts[z]:starts[z] + n1 - n0], dtype),
                                                    jnp.float32))
    got = np.stack([np.asarray(jnp.asarray(x, jnp.float32)) for x in (ko, vo)])
    assert np.array_equal(got, want, equal_nan=True), f"attn_decode_pack {spec}: wrong packed rows"
    assert np.array_equal(np.asarray(sf), faults) and int(np.asarray(fl)[0]) == _FAULT_LENGTH
    SUMMARY.append({"case": f"attn_decode_pack {spec}", "exact": True})


def _poison_case(aj: Any, lib: Any, spec: dict) -> None:
    _, _, _, sq, _, faults = _route_inputs()
    b, hq, d, dtype = len(faults), 4, spec["HEAD_DIM"], _JNP[spec["dtype"]]
    out = jax.random.normal(jax.random.PRNGKey(2), (b, sq, hq, d), dtype)
    lse = jax.random.normal(jax.random.PRNGKey(3), (b, hq, sq), jnp.float32)
    k = aj.kernel("attn_decode_poison", library=lib, **spec)
    o2, l2 = jax.jit(lambda o, ls, f: k(aj.Update(o), aj.Update(ls), f, sq * hq * d, d, hq * d, hq * sq, sq, b, hq, sq,
                                       d))(out, lse, jnp.asarray(faults))
    bad = faults != 0
    o_np, l_np = np.array(jnp.asarray(out, jnp.float32)), np.array(lse)
    o_np[bad], l_np[bad] = np.nan, np.nan
    assert np.array_equal(np.asarray(jnp.asarray(o2, jnp.float32)), o_np, equal_nan=True)
    assert np.array_equal(np.asarray(l2), l_np, equal_nan=True)
    SUMMARY.append({"case": f"attn_decode_poison {spec}", "exact": True})


def _sinks_case(aj: Any, lib: Any, spec: dict) -> None:  # attn_sinks (spec with ALIGNED) or attn_sinks_bwd
    """attn_sinks rescales a forward's (out, lse) by a sink logit per head; attn_sinks_bwd gives
    each program's share of the sinks' gradient. Dense (B, S, H, D) rows, one sink of -inf."""
    b, s, h, d = 2, 37, 4, 64
    dtype = _JNP[spec["dtype"]]
    keys = jax.random.split(jax.random.PRNGKey(4), 4)
    out = jax.random.normal(keys[0], (b, s, h, d), dtype)
    lse = jax.random.normal(keys[1], (b, h, s), jnp.float32)
    sinks = jnp.array([0.5, -1.0, float("-inf"), 2.0], jnp.float32)
    strides = (s * h * d, d, h * d, h * s, s)
    f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))  # noqa: E731
    if spec.get("ALIGNED") is not None:  # the forward's rescale
        k = aj.kernel("attn_sinks", library=lib, **spec)
        o2, l2 = jax.jit(lambda o, ls, sk: k(aj.Update(o), aj.Update(ls), sk, None, *strides, b, h, s, d, 0, 0))(
            out, lse, sinks)
        new = np.logaddexp(f32(lse), f32(sinks)[None, :, None])
        want_o = f32(out) * np.exp(f32(lse) - new).transpose(0, 2, 1)[..., None]
        assert np.abs(f32(l2) - new).max() < 1e-5
        err = _rel(o2, want_o)
        assert err < (1e-5 if spec["dtype"] == "fp32" else 1e-2), err
    else:
        block_m = lib.kernel("attn_sinks_bwd", **spec).variant(0).config.constexprs["BLOCK_M"]
        k = aj.kernel("attn_sinks_bwd", library=lib, **spec)
        dout = jax.random.normal(keys[2], (b, s, h, d), dtype)
        blocks = -(-s // block_m)
        part = jax.jit(lambda do, o, ls, sk: k(do, o, ls, sk, aj.Out((blocks, b, h), jnp.float32), None,
                                              *strides[:3], *strides, b, h, s, s, d, 0))(dout, out, lse, sinks)
        delta = (f32(dout) * f32(out)).sum(-1).transpose(0, 2, 1)  # (b, h, s)
        p = np.where(np.isneginf(f32(sinks))[None, :, None], 0.0, np.exp(f32(sinks)[None, :, None] - f32(lse)))
        want = -(p * delta).sum(-1)
        err = _rel(f32(part).sum(0), want)
        assert err < 1e-2, err
    SUMMARY.append({"case": f"sinks {spec}", "rel_err": "ok"})


_HELPER_CASES = {"attn_decode_lengths": _lengths_case, "attn_decode_pack": _pack_case,
                 "attn_decode_poison": _poison_case, "attn_sinks": _sinks_case, "attn_sinks_bwd": _sinks_case}


def _fp8_case(aj: Any, lib: Any, kernel: str, spec: dict) -> None:
    """One FP8 forward spec under jit on ``kernel`` (the portable one with sm90's Gluon kernel hidden),
    against fp32 attention of the dequantised inputs, within the P-in-e4m3 bound of
    tests/runtime/test_attention_fp8_gpu.py."""
    from aotriton_rt.ops.attention import explain
    from builder.tune import without_kernel

    view = without_kernel(lib, "attn_fwd_fp8_sm90") if kernel == "attn_fwd_fp8" else lib
    causal = spec["CAUSAL"]
    opts: dict[str, Any] = {}
    if causal:
        opts.update(causal=True, align="top_left" if causal == 1 else "bottom_right")
    b, hq, hk, d = 2, 4, 2, spec["HEAD_DIM"]
    lens = [(150, 180), (50, 120)] if spec["VARLEN"] else [(200, 333)] * b if causal else [(257, 257)] * b
    fp8 = jnp.float8_e4m3fn if spec["dtype"] == "fp8e4nv" else jnp.float8_e4m3fnuz
    keys = jax.random.split(jax.random.PRNGKey(11), 4)
    rows_q, rows_k = (sum(a for a, _ in lens), sum(c for _, c in lens)) if spec["VARLEN"] else lens[0]
    if spec["VARLEN"]:
        shape_q, shape_k = (rows_q, hq, d), (rows_k, hk, d)
    else:
        shape_q, shape_k = (b, hq, rows_q, d), (b, hk, rows_k, d)
    q, k, v = ((jax.random.normal(key, shape, jnp.float32) * 40).astype(fp8)
               for key, shape in zip(keys, (shape_q, shape_k, shape_k)))
    dq, dk, dv = (jax.random.uniform(key, (b, hk), jnp.float32, 0.005, 0.025) for key in jax.random.split(keys[3], 3))
    if spec["VARLEN"]:
        cu = [np.cumsum([0] + [x[i] for x in lens]).astype(np.int32) for i in (0, 1)]
        opts.update(cu_seqlens_q=jnp.asarray(cu[0]), cu_seqlens_k=jnp.asarray(cu[1]),
                    max_seqlen_q=max(a for a, _ in lens), max_seqlen_k=max(c for _, c in lens))
    ran = explain(dtype=spec["dtype"], head_dim=d, seqlen_q=lens[0][0], seqlen_k=lens[0][1], causal=bool(causal),
                  align=opts.get("align", "top_left"), varlen=bool(spec["VARLEN"]), out_dtype=spec["out_dtype"],
                  library=view).kernels[-1]
    assert ran.kernel == kernel, f"{kernel} {spec}: the call runs {ran.kernel}"
    out = jax.jit(lambda q, k, v, dq, dk, dv: aj.attention_fp8(q, k, v, q_descale=dq, k_descale=dk, v_descale=dv,
                                                               out_dtype=spec["out_dtype"], library=view, **opts))(
        q, k, v, dq, dk, dv)
    qf, kf, vf, out = (_np(x).astype(np.float32) for x in (q, k, v, out))
    worst = 0.0
    for i, (sq, sk) in enumerate(lens):
        if spec["VARLEN"]:
            part = [x[c[i]:c[i + 1]].transpose(1, 0, 2) for x, c in ((qf, cu[0]), (kf, cu[1]), (vf, cu[1]))]
            got = out[cu[0][i]:cu[0][i + 1]].transpose(1, 0, 2)
        else:
            part, got = [qf[i], kf[i], vf[i]], out[i]
        scales = [np.asarray(x)[i] for x in (dq, dk, dv)]
        qs = part[0] * np.repeat(scales[0], hq // hk)[:, None, None]
        ks, vs = (x * s[:, None, None] for x, s in zip(part[1:], scales[1:]))
        ks, vs = (np.repeat(x, hq // hk, 0) for x in (ks, vs))
        s_ = qs @ ks.transpose(0, 2, 1) * d ** -0.5
        if causal:
            diag = sk - sq if causal == 2 else 0
            rel = np.arange(sk)[None, :] - np.arange(sq)[:, None] - diag
            s_ = np.where(rel <= 0, s_, -np.inf)
        m = s_.max(-1, keepdims=True)
        p = np.exp(s_ - np.where(np.isfinite(m), m, 0.0))
        ref = (p / np.maximum(p.sum(-1, keepdims=True), 1e-30)) @ vs
        vmax = np.abs(vs).max()
        err = np.abs(got - ref)
        assert err.max() <= vmax / 16 + np.abs(ref).max() / 128 and err.mean() <= vmax / 256, (kernel, spec, i)
        worst = max(worst, float(err.max() / vmax))
    SUMMARY.append({"case": f"{kernel} {spec}", "max_err_over_vmax": f"{worst:.1e}"})


def _decode_case(aj: Any, lib: Any, spec: dict) -> None:
    """attn_decode_append, attn_decode (two splits) and attn_decode_combine as one jitted program,
    against an fp32 reference: two sequences with different cached lengths, two new rows each,
    GQA 2:1, bottom-right causal; a paged spec reads a shuffled block table of 16-row pages. A
    masked spec (PADDED_D=1) runs a head dim 5 below its bucket (split partials stay bucket wide)."""
    dtype, bucket, paged = _JNP[spec["dtype"]], spec["HEAD_DIM"], spec["PAGED"]
    padded = spec.get("PADDED_D", 0)  # images built before the masked variants have no such axis
    d = bucket - 5 if padded else bucket
    b, hq, hk, sq, splits, page, blocks = 2, 4, 2, 2, 2, 16, 6
    capacity, group = page * blocks, hq // hk
    lens = np.array([37, 80], np.int32)  # rows cached before the append
    keys = jax.random.split(jax.random.PRNGKey(5), 5)
    rng = np.random.default_rng(0)
    if paged:
        num_pages = b * blocks + 3  # three pages no sequence references
        table = rng.permutation(num_pages)[: b * blocks].reshape(b, blocks).astype(np.int32)
        cache_shape = (num_pages, page, hk, d)
    else:
        num_pages, table, cache_shape = 1, None, (b, capacity, hk, d)
    # Rows past each sequence's keys, and pages no sequence references, hold NaN: a read of
    # them poisons the output.
    kc_np, vc_np = (np.array(jax.random.normal(s, cache_shape, jnp.float32)) for s in keys[:2])
    for z in range(b):
        for row in range(lens[z] + sq, capacity):
            where = (table[z, row // page], row % page) if paged else (z, row)
            kc_np[where] = vc_np[where] = np.nan
    if paged:
        unused = sorted(set(range(num_pages)) - set(table.ravel().tolist()))
        kc_np[unused] = vc_np[unused] = np.nan
    kc, vc = jnp.asarray(kc_np, dtype), jnp.asarray(vc_np, dtype)
    q = jax.random.normal(keys[2], (b, sq, hq, d), dtype)
    kn, vn = (jax.random.normal(s, (b, sq, hk, d), dtype) for s in keys[3:5])
    cache_rows = cache_shape[1] * hk * d
    part_rows = b * hk * splits * group * sq
    values = {"stride_qz": sq * hq * d, "stride_qh": d, "stride_qm": hq * d,
              "stride_oz": sq * hq * d, "stride_oh": d, "stride_om": hq * d,
              "stride_kz": cache_rows, "stride_kh": d, "stride_kn": hk * d,
              "stride_vz": cache_rows, "stride_vh": d, "stride_vn": hk * d,
              "stride_knz": sq * hk * d, "stride_knh": d, "stride_knm": hk * d,
              "stride_vnz": sq * hk * d, "stride_vnh": d, "stride_vnm": hk * d,
              "stride_lz": hq * sq, "stride_lh": sq, "stride_btz": blocks if paged else 0,
              "batch": b, "num_heads_q": hq, "num_heads_k": hk, "seqlen_q": sq, "seqlen_new": sq,
              "capacity": capacity, "num_pages": num_pages, "page_size": page, "sm_scale": d ** -0.5,
              "window_left": -1, "window_right": 0, "num_splits": splits, "head_dim": d,
              # No softcap, ALiBi or sinks; a cache of q's type reads no scales (one 1.0 stands in).
              "softcap": 0.0, "stride_az": 0, "use_alibi": 0, "use_sinks": 0, "k_scale": 1.0, "v_scale": 1.0,
              "stride_ksz": 0, "stride_ksh": 0, "stride_vsz": 0, "stride_vsh": 0}
    unused = {n: jnp.ones((1,), jnp.float32) for n in ("KScale", "VScale", "alibi_slopes", "Sinks")}
    params = {"dtype": spec["dtype"], "HEAD_DIM": bucket, **({"PADDED_D": padded} if "PADDED_D" in spec else {})}
    # Caches of q's type (images built before the fp8 caches have no KV_DTYPE axis).
    cache = {"PAGED": paged, **({"KV_DTYPE": spec["KV_DTYPE"]} if "KV_DTYPE" in spec else {})}
    append = aj.kernel("attn_decode_append", library=lib, **params, **cache)
    decode = aj.kernel("attn_decode", library=lib, **params, **cache)
    combine = aj.kernel("attn_decode_combine", library=lib, **params)

    def call(kernel: Any, **arrays: Any) -> Any:
        given = {**unused, **values, **arrays}
        return kernel(*[given[n] for n in kernel.arg_names])

    def step(q: Any, kc: Any, vc: Any, kn: Any, vn: Any, lens: Any, table: Any, faults: Any) -> tuple:
        # Faults: the int32 flag both kernels OR a bit into on an out-of-range length or page.
        kc, vc, faults = call(append, KNew=kn, VNew=vn, K=aj.Update(kc), V=aj.Update(vc), BlockTable=table,
                              CacheSeqlens=lens, Faults=aj.Update(faults))
        _, _, part_o, part_l, faults = call(decode, Q=q, K=kc, V=vc, Out=aj.Out(q.shape, q.dtype),
                                            LSE=aj.Out((b, hq, sq), jnp.float32),
                                            PartO=aj.Out((part_rows, bucket), jnp.float32),
                                            PartL=aj.Out((part_rows,), jnp.float32), BlockTable=table,
                                            CacheSeqlens=lens, CacheStart=jnp.zeros((b,), jnp.int32),
                                            Faults=aj.Update(faults))
        out, lse = call(combine, Out=aj.Out(q.shape, q.dtype), LSE=aj.Out((b, hq, sq), jnp.float32), PartO=part_o,
                        PartL=part_l)
        return out, lse, kc, vc, faults

    got_out, got_lse, got_k, got_v, faults = jax.jit(step)(q, kc, vc, kn, vn, jnp.asarray(lens),
                                                            None if table is None else jnp.asarray(table),
                                                            jnp.zeros((1,), jnp.int32))
    assert int(np.asarray(faults)[0]) == 0, "a valid call raised the decode fault flag"
    # Reference: the appended caches, then causal attention of each query row over its sequence.
    f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))  # noqa: E731
    k_all, v_all = f32(kc).copy(), f32(vc).copy()
    seq_k = np.zeros((b, capacity, hk, d), np.float32)
    seq_v = np.zeros_like(seq_k)
    for z in range(b):
        for i in range(sq):
            row = lens[z] + i
            where = (table[z, row // page], row % page) if paged else (z, row)
            k_all[where], v_all[where] = f32(kn)[z, i], f32(vn)[z, i]
        for row in range(capacity):
            where = (table[z, row // page], row % page) if paged else (z, row)
            seq_k[z, row], seq_v[z, row] = k_all[where], v_all[where]
    ref = np.zeros((b, sq, hq, d), np.float32)
    ref_lse = np.zeros((b, hq, sq), np.float32)
    qf = f32(q)
    for z in range(b):
        len_k = lens[z] + sq
        for h in range(hq):
            kk, vv = seq_k[z, :len_k, h // group], seq_v[z, :len_k, h // group]
            for i in range(sq):
                s = (kk @ qf[z, i, h]) * d ** -0.5
                s[len_k - sq + i + 1:] = -np.inf
                m = s.max()
                p = np.exp(s - m)
                ref[z, i, h] = p @ vv / p.sum()
                ref_lse[z, h, i] = m + np.log(p.sum())
    assert np.array_equal(f32(got_k), k_all, equal_nan=True) and np.array_equal(f32(got_v), v_all, equal_nan=True), \
        "append wrote wrong cache rows"
    err, lse_err = _rel(got_out, ref), float(np.abs(f32(got_lse) - ref_lse).max())
    SUMMARY.append({"case": f"attn_decode append+decode+combine {spec}", "rel_err": f"{err:.1e}",
                    "lse_err": f"{lse_err:.1e}"})
    tol = 1e-5 if spec["dtype"] == "fp32" else 2e-2
    assert err < tol and lse_err < 10 * tol, (spec, err, lse_err)


def _attention_case(aj: Any, lib: Any, spec: dict, expect_kernel: str | None = None) -> None:
    """One forward spec (and the backward it implies) under jit, against the eager path, bitwise."""
    import torch  # the eager path's outputs

    opts, (b, hq, hk, sq, sk, d) = _attention_options(spec)
    dtype = _JNP[spec["dtype"]]
    dv = spec["HEAD_DIM_V"]
    q, k, v, dout, bias = _inputs(dtype, b, hq, hk, sq, sk, d, dv, opts.pop("bias", False))
    if spec.get("VARLEN"):
        # Two packed sequences with different q and k lengths (the alignment matters).
        lq, lk = (150, 50), (180, 120)
        cq, ck = jnp.array([0, 150, 200], jnp.int32), jnp.array([0, 180, 300], jnp.int32)
        keys = jax.random.split(jax.random.PRNGKey(3), 4)
        q = jax.random.normal(keys[0], (sum(lq), hq, d), dtype)
        k = jax.random.normal(keys[1], (sum(lk), hk, d), dtype)
        v = jax.random.normal(keys[2], (sum(lk), hk, dv), dtype)
        dout = jax.random.normal(keys[3], (sum(lq), hq, dv), dtype)
        if bias is not None:
            bias = jax.random.normal(keys[3], (1, hq, max(lq), max(lk)), dtype)
        opts.update(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    ret_mask = spec.get("DROPOUT") == 2
    if expect_kernel is not None:
        from aotriton_rt.ops.attention import attention_kernels

        ran = attention_kernels(q, k, v, bias=bias, library=lib, return_mask=ret_mask, **opts)["attn_fwd"]
        assert ran.name == expect_kernel, f"{expect_kernel} {spec}: the call ran {ran.name}"
    f = jax.jit(lambda q, k, v, bias: aj.attention_forward(q, k, v, bias=bias, library=lib, return_mask=ret_mask,
                                                           **opts))
    got = f(q, k, v, bias)
    eager = aotriton_rt.attention(q, k, v, bias=bias, library=lib, return_mask=ret_mask, **opts)
    torch.cuda.synchronize()
    same = all(np.array_equal(_np(g), _np(e)) for g, e in zip(got, eager))
    SUMMARY.append({"case": f"attn_fwd {spec}", "identical_to_eager": same,
                    "max_diff": max(float(np.abs(_np(g) - _np(e)).max()) for g, e in zip(got, eager))})
    assert same, f"attn_fwd {spec}: jit differs from the eager path"
    if ret_mask:
        return
    for scheme in ("split", "atomic"):
        try:
            grads = jax.jit(lambda *a, scheme=scheme: aj.attention_backward(*a, bias=bias, library=lib,
                                                                            scheme=scheme, **opts))(
                dout, q, k, v, got[0], got[1])
        except aotriton_rt.KernelNotFound:
            # The images hold no such backward (eager would refuse it the same way).
            SUMMARY.append({"case": f"attn_bwd {scheme} {spec}", "identical_to_eager": "not in the images"})
            continue
        eager_g = aotriton_rt.attention_backward(dout, q, k, v, got[0], got[1], bias=bias, library=lib,
                                                 scheme=scheme, **opts)
        torch.cuda.synchronize()
        for name, g, e in zip(("dq", "dk", "dv", "dbias"), grads, eager_g):
            if e is None:
                assert g is None
                continue
            if scheme == "atomic" and name == "dq":  # summed with atomics: not bit-reproducible
                assert _rel(g, e) < 1e-2, f"dq {spec} atomic"
                continue
            assert np.array_equal(_np(g), _np(e)), f"{name} {spec} {scheme}: jit differs from the eager path"
        SUMMARY.append({"case": f"attn_bwd {scheme} {spec}", "identical_to_eager": True})


# -- features, gradients against references ---------------------------------------------------

def _reference(q, k, v, bias=None, causal=False, align="top_left", window=None, sinks=None):
    """fp32 attention of (B, H, S, D) arrays; with ``sinks`` gpt-oss's: the sink joins each row's
    softmax, then is dropped."""
    qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
    group = qf.shape[1] // kf.shape[1]
    kf, vf = jnp.repeat(kf, group, axis=1), jnp.repeat(vf, group, axis=1)
    s = jnp.einsum("bhqd,bhkd->bhqk", qf, kf) / np.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    sq, sk = q.shape[2], k.shape[2]
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    diag = 0 if align == "top_left" else sk - sq
    keep = np.ones((sq, sk), bool)
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    if right >= 0:
        keep &= j <= i + diag + right
    if left >= 0:
        keep &= j >= i + diag - left
    s = jnp.where(keep, s, -jnp.inf)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], s.shape[:3] + (1,))
        p = jax.nn.softmax(jnp.concatenate([s, sink], -1), axis=-1)[..., :-1]
    else:
        p = jnp.where(keep.any(1)[:, None], jax.nn.softmax(s, axis=-1), 0.0)
    return jnp.einsum("bhqk,bhkd->bhqd", p, vf)


CASES = {
    "causal bottom_right Sq<Sk": dict(causal=True, align="bottom_right"),
    "window": dict(window=(32, 16)),
    "bias": dict(bias=True),
    "gqa": dict(),
    "head dim 80": dict(d=80),
}


@pytest.mark.parametrize("name", list(CASES))
def test_grad_under_jit_matches_an_fp32_reference(lib: Any, aj: Any, name: str) -> None:
    opts = dict(CASES[name])
    d = opts.pop("d", 64)
    q, k, v, dout, bias = _inputs(jnp.bfloat16, 2, 4, 2, 200, 333, d, d, opts.pop("bias", False))
    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)

    def loss(q, k, v, bias, fn):
        return (fn(q, k, v, bias).astype(jnp.float32) * dout.astype(jnp.float32)).sum()

    ours = lambda q, k, v, bias: aj.attention(q, k, v, bias=bias, library=lib, **opts)  # noqa: E731
    ref = lambda q, k, v, bias: _reference(q, k, v, bias, **opts)  # noqa: E731
    try:
        got = jax.jit(jax.grad(lambda *a: loss(*a, ours), argnums=argnums))(q, k, v, bias)
    except aotriton_rt.KernelNotFound as e:
        pytest.skip(f"images lack this combination: {e}"[:200])
    want = jax.grad(lambda *a: loss(*a, ref), argnums=argnums)(q, k, v, bias)
    errs = [_rel(g, w) for g, w in zip(got, want)]
    SUMMARY.append({"case": f"grad {name}", "rel_errs": [f"{e:.1e}" for e in errs]})
    assert max(errs) < 2e-2, errs


def test_vmap_of_attention_equals_a_loop(lib: Any, aj: Any) -> None:
    q, k, v, _, _ = _inputs(jnp.bfloat16, 3, 4, 4, 128, 128, 64, 64, False)
    f = lambda q, k, v: aj.attention(q[None], k[None], v[None], causal=True, library=lib)[0]  # noqa: E731
    batched = jax.jit(jax.vmap(f))(q, k, v)
    looped = jnp.stack([f(q[i], k[i], v[i]) for i in range(3)])
    assert np.array_equal(_np(batched), _np(looped))


# -- attention sinks: the jnp epilogue around the kernels ---------------------------------------

SINK_CASES = {
    "causal gqa": dict(causal=True),
    "causal bottom_right Sq<Sk": dict(causal=True, align="bottom_right"),
    "sliding window": dict(window=(64, 0)),
    "sliding window both sides, bshd": dict(window=(32, 16), layout="bshd"),
    "causal, bf16 sinks": dict(causal=True, sinks_dtype=jnp.bfloat16),
}


def _sink_inputs(opts: dict) -> tuple:
    """(q, k, v, dout) bf16 (B, H, S, D) with GQA 4/2, 200 queries and 333 keys, and sinks near the
    rows' logsumexp (a few units), so each takes a large share of its row."""
    q, k, v, dout, _ = _inputs(jnp.bfloat16, 2, 4, 2, 200, 333, 64, 64, False)
    sinks = jnp.linspace(2.0, 6.0, 4).astype(opts.pop("sinks_dtype", jnp.float32))
    return q, k, v, dout, sinks


def _bshd(x: Any) -> Any:
    return x.transpose(0, 2, 1, 3)


@pytest.mark.parametrize("name", list(SINK_CASES))
def test_sinks_forward_under_jit_matches_the_eager_path_and_an_fp32_reference(lib: Any, aj: Any, name: str) -> None:
    import torch  # the eager path's outputs

    opts = dict(SINK_CASES[name])
    q, k, v, dout, sinks = _sink_inputs(opts)
    bshd = opts.get("layout") == "bshd"
    args = tuple(_bshd(x) if bshd else x for x in (q, k, v, dout))
    try:
        out, lse = jax.jit(lambda q, k, v, s: aj.attention_forward(q, k, v, sinks=s, library=lib, **opts))(
            *args[:3], sinks)
    except aotriton_rt.KernelNotFound as e:
        pytest.skip(f"images lack this combination: {e}"[:200])
    eager_out, eager_lse = aotriton_rt.attention(*args[:3], sinks=sinks, library=lib, **opts)
    torch.cuda.synchronize()
    plain = {n: o for n, o in opts.items() if n != "layout"}
    ref = _reference(q, k, v, sinks=sinks, **plain)
    err = _rel(_bshd(out) if bshd else out, ref)
    assert _rel(_reference(q, k, v, **plain), ref) > 0.1, "the sinks barely change the output: the test proves little"
    # The epilogue is jnp (XLA's exp and log), the eager one a kernel: equal to rounding.
    eager_err, lse_diff = _rel(out, eager_out), float(np.abs(_np(lse) - _np(eager_lse)).max())
    # The same (out, lse) into both backwards: the same kernels give the same dq, dk, dv; the
    # sinks' gradient is summed in another order.
    grads = jax.jit(lambda do, q, k, v, o, ls, s: aj.attention_backward(do, q, k, v, o, ls, sinks=s, library=lib,
                                                                        **opts))(args[3], *args[:3], out, lse, sinks)
    eager_g = aotriton_rt.attention_backward(args[3], *args[:3], out, lse, sinks=sinks, library=lib, **opts)
    torch.cuda.synchronize()
    same = [np.array_equal(_np(g), _np(e)) for g, e in zip(grads[:3], eager_g[:3])]
    dsinks_err = _rel(grads[4], eager_g[4])
    SUMMARY.append({"case": f"sinks forward {name}", "rel_err": f"{err:.1e}", "vs_eager": f"{eager_err:.1e}",
                    "lse_diff": f"{lse_diff:.1e}", "bwd_identical_to_eager": same,
                    "dsinks_vs_eager": f"{dsinks_err:.1e}"})
    assert err < 2e-2 and eager_err < 1e-2 and lse_diff < 1e-4, (err, eager_err, lse_diff)
    assert all(same) and grads[4].dtype == sinks.dtype and dsinks_err < 1e-2, (same, dsinks_err)


@pytest.mark.parametrize("name", list(SINK_CASES))
def test_grad_with_sinks_under_jit_matches_an_fp32_reference(lib: Any, aj: Any, name: str) -> None:
    opts = dict(SINK_CASES[name])
    q, k, v, dout, sinks = _sink_inputs(opts)
    bshd = opts.pop("layout", None) == "bshd"

    def ours(q, k, v, s):
        if bshd:
            return _bshd(aj.attention(_bshd(q), _bshd(k), _bshd(v), sinks=s, layout="bshd", library=lib, **opts))
        return aj.attention(q, k, v, sinks=s, library=lib, **opts)

    def loss(fn):
        return lambda q, k, v, s: (fn(q, k, v, s).astype(jnp.float32) * dout.astype(jnp.float32)).sum()

    ref = lambda q, k, v, s: _reference(q, k, v, sinks=s, **opts)  # noqa: E731
    try:
        got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    except aotriton_rt.KernelNotFound as e:
        pytest.skip(f"images lack this combination: {e}"[:200])
    want = jax.grad(loss(ref), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    errs = [_rel(g, w) for g, w in zip(got, want)]
    SUMMARY.append({"case": f"grad with sinks {name}", "rel_errs dq dk dv dsinks": [f"{e:.1e}" for e in errs]})
    assert got[3].dtype == sinks.dtype and got[3].shape == sinks.shape
    assert max(errs) < 2e-2, errs


def test_vmap_of_attention_with_sinks_equals_a_loop(lib: Any, aj: Any) -> None:
    q, k, v, dout, _ = _inputs(jnp.bfloat16, 3, 4, 2, 128, 160, 64, 64, False)
    sinks = jnp.stack([jnp.linspace(1.0, 5.0, 4), jnp.linspace(5.0, 1.0, 4), jnp.full((4,), 3.0)])

    def f(q, k, v, s):
        return aj.attention(q[None], k[None], v[None], causal=True, window=(48, 0), sinks=s, library=lib)[0]

    def grad(q, k, v, s, do):
        return jax.grad(lambda *a: (f(*a).astype(jnp.float32) * do.astype(jnp.float32)).sum(),
                        argnums=(0, 1, 2, 3))(q, k, v, s)

    batched = jax.jit(jax.vmap(f))(q, k, v, sinks)
    looped = jnp.stack([jax.jit(f)(q[i], k[i], v[i], sinks[i]) for i in range(3)])
    # The same kernels on a folded batch and the same elementwise epilogue: equal, at most an
    # ulp apart should XLA fuse the epilogue differently for the two shapes.
    fwd_err = _rel(batched, looped)
    got = jax.jit(jax.vmap(grad))(q, k, v, sinks, dout)
    want = [jnp.stack(g) for g in zip(*[jax.jit(grad)(q[i], k[i], v[i], sinks[i], dout[i]) for i in range(3)])]
    errs = [_rel(g, w) for g, w in zip(got, want)]
    SUMMARY.append({"case": "vmap with sinks", "identical": bool(np.array_equal(_np(batched), _np(looped))),
                    "fwd_rel_err": f"{fwd_err:.1e}", "rel_errs dq dk dv dsinks": [f"{e:.1e}" for e in errs]})
    assert got[3].shape == sinks.shape
    assert fwd_err < 5e-3 and max(errs) < 1e-2, (fwd_err, errs)


# -- a transformer block training under jit ---------------------------------------------------

def _block(params: dict, tokens: Any, attend: Any) -> Any:
    x = params["embed"][tokens]  # (B, S, E)
    b, s, e = x.shape
    h = 4
    qkv = (x @ params["wqkv"]).reshape(b, s, 3, h, e // h)
    q, k, v = (qkv[:, :, i] for i in range(3))  # (B, S, H, D)
    a = attend(q, k, v).reshape(b, s, e)
    x = x + a @ params["wo"]
    x = x + jax.nn.gelu(x @ params["w1"]) @ params["w2"]
    logits = (x @ params["embed"].T).astype(jnp.float32)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1).mean()


def test_a_transformer_block_trains_under_jit_like_jax_dot_product_attention(lib: Any, aj: Any) -> None:
    vocab, e = 512, 256
    keys = jax.random.split(jax.random.PRNGKey(2), 6)
    dt = jnp.bfloat16
    params = {"embed": jax.random.normal(keys[0], (vocab, e), dt) * 0.05,
              "wqkv": jax.random.normal(keys[1], (e, 3 * e), dt) * 0.05,
              "wo": jax.random.normal(keys[2], (e, e), dt) * 0.05,
              "w1": jax.random.normal(keys[3], (e, 4 * e), dt) * 0.05,
              "w2": jax.random.normal(keys[4], (4 * e, e), dt) * 0.05}
    tokens = jax.random.randint(keys[5], (4, 256), 0, vocab)
    ours = lambda q, k, v: aj.attention(q, k, v, causal=True, layout="bshd", library=lib)  # noqa: E731
    theirs = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731

    def trainer(attend):
        @jax.jit
        def step(p):
            loss, g = jax.value_and_grad(_block)(p, tokens, attend)
            return jax.tree.map(lambda w, gw: (w.astype(jnp.float32) - 0.5 * gw.astype(jnp.float32)).astype(w.dtype),
                                p, g), loss, g
        return step

    p1 = p2 = params
    s1, s2 = trainer(ours), trainer(theirs)
    losses = []
    for i in range(5):
        p1, l1, g1 = s1(p1)
        p2, l2, g2 = s2(p2)
        losses.append((float(l1), float(l2)))
        if i == 0:
            gerr = {n: _rel(g1[n], g2[n]) for n in g1}
    SUMMARY.append({"case": "transformer block", "losses ours/jax": losses,
                    "grad rel err step 0": {n: f"{e:.1e}" for n, e in gerr.items()}})
    assert losses[-1][0] < losses[0][0], "the loss did not go down"
    for a, b in losses:
        assert abs(a - b) <= 2e-2 * abs(b), losses
    assert max(gerr.values()) < 3e-2, gerr


COMMAND_BUFFER_SCRIPT = r"""
import sys
import jax, jax.numpy as jnp
import aotriton_rt, aotriton_rt.jax as aj

lib = aotriton_rt.Library(sys.argv[1])
key = jax.random.split(jax.random.PRNGKey(0), 3)
# D=128 bf16 on sm90 runs a TMA forward, whose global scratch XLA's command buffers must capture.
q, k, v = (jax.random.normal(s, (2, 4, 512, 128), jnp.bfloat16) for s in key)
worst = 0.0
for causal in (False, True):
    def loss(q, k, v, fn):
        return (fn(q, k, v).astype(jnp.float32) ** 2).mean()
    ours = lambda q, k, v: aj.attention(q, k, v, causal=causal, library=lib)
    ref = lambda q, k, v: jax.nn.dot_product_attention(
        q.transpose(0, 2, 1, 3).astype(jnp.float32), k.transpose(0, 2, 1, 3).astype(jnp.float32),
        v.transpose(0, 2, 1, 3).astype(jnp.float32), is_causal=causal).transpose(0, 2, 1, 3)
    step = jax.jit(jax.value_and_grad(lambda *a: loss(*a, ours), argnums=(0, 1, 2)))
    for _ in range(3):  # the first run records the command buffer, later ones replay it
        got = step(q, k, v)
    want = jax.value_and_grad(lambda *a: loss(*a, ref), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = g.astype(jnp.float32), w.astype(jnp.float32)
        worst = max(worst, float(jnp.abs(g - w).max() / (jnp.abs(w).max() + 1e-6)))
print(f"worst {worst:.2e}")
assert worst < 2e-2, worst
"""


def test_attention_runs_inside_xla_command_buffers(gpu_images: Path) -> None:
    # XLA records jitted programs into CUDA graphs ("command buffers"); force them on for custom
    # calls and for programs of any size, in a fresh process (flags are read once per process).
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,CUBLAS,CUBLASLT "
               "--xla_gpu_graph_min_graph_size=1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    done = subprocess.run([sys.executable, "-c", COMMAND_BUFFER_SCRIPT, str(gpu_images)], env=env,
                          capture_output=True, text=True, timeout=600)
    SUMMARY.append({"case": "command buffers", "rc": done.returncode, "out": done.stdout.strip()[-80:]})
    assert done.returncode == 0, done.stderr[-3000:]
