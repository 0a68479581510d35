"""Every attention call the README and the examples make is served by the default image set.

The README's Python blocks that call attention are executed on the CPU with the attention
functions replaced by recorders (tensors on "cpu" instead of "cuda"); each recorded call is
then dispatched by :func:`aotriton_rt.ops.attention.attention_kernels` (dispatch only, nothing
launches) against a library whose variants are exactly what ``python -m builder build --set
default`` compiles, for every default target. The examples' calls are listed by hand below,
next to the file they come from; a test checks that those lines are still in the files.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from aotriton_rt.errors import KernelNotFound
from aotriton_rt.ops import attention as op
from aotriton_rt.ops.attention import dispatch
from aotriton_rt.select import match
from tests.runtime.test_attention_op import Dev

torch = pytest.importorskip("torch", reason="the README's snippets build torch tensors")
pytest.importorskip("triton", reason="the default set is what the builder's declarations expand to")

ROOT = Path(__file__).resolve().parent.parent.parent
_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

#: (file, a line it must contain, the call: shape of q, k, v as (B, H, S, D) or BSHD per layout,
#: dtype, options, whether the backward runs).
EXAMPLES = [
    ("examples/attention_torch.py", 'out = attention(ql, kl, vl, causal=True, layout="bshd")',
     ((4, 509, 8, 64), (4, 509, 2, 64), (4, 509, 2, 64)), "bf16", {"causal": True, "layout": "bshd"}, True),
    ("examples/attention_torch.py", "dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16",
     ((4, 509, 8, 64), (4, 509, 2, 64), (4, 509, 2, 64)), "fp16", {"causal": True, "layout": "bshd"}, True),
    ("examples/attention_jax.py", 'return aj.attention(q, k, v, causal=True, layout="bshd")',
     None, "bf16", {"causal": True, "layout": "bshd"}, True),
    # Training: width 256 over 4 heads (D=64), batch 32 on one rank, bf16 q/k/v.
    ("examples/ddp_train.py", 'a = attention(q, k, v, causal=True, layout="bshd", library=self.library)',
     ((32, 512, 4, 64),) * 3, "bf16", {"causal": True, "layout": "bshd"}, True),
    # The ring's blocks (ops/ring.py: aotriton_blocks) at the example's defaults, 2 ranks: the own
    # chunk causally, an earlier rank's fully; and the whole sequence on one GPU for comparison.
    ("examples/context_parallel.py", 'parser.add_argument("--dim", type=int, default=128)',
     ((2, 8, 4096, 128),) * 3, "bf16", {"causal": True}, True),
    ("examples/context_parallel.py", 'parser.add_argument("--seqlen", type=int, default=8192',
     ((2, 8, 4096, 128),) * 3, "bf16", {"causal": False}, True),
    ("examples/context_parallel.py", "out = attention(*leaves, causal=args.causal, library=library)",
     ((2, 8, 8192, 128),) * 3, "bf16", {"causal": True}, True),
    # A Llama with head_dim=64 prefilling a 256-token prompt (the integration's bottom-right causal call).
    ("examples/transformers_llama.py", "num_attention_heads=16, num_key_value_heads=4, head_dim=64",
     ((4, 256, 16, 64), (4, 256, 4, 64), (4, 256, 4, 64)), "bf16",
     {"causal": True, "align": "bottom_right", "layout": "bshd"}, False),
]

#: The decode calls of the examples: (file, a line it must contain, q (B, Sq, Hq, D), cache (B or pages,
#: S or page size, Hk, D), dtype, paged, appends new keys).
DECODE_EXAMPLES = [
    ("examples/decode_torch.py", "B, HQ, HK, D, PAGE, STEPS = 8, 32, 8, 128, 16, 20",
     (8, 1, 32, 128), (8 * 66, 16, 8, 128), "bf16", True, True),
    # Generation steps of the Llama (integrations/transformers.py): one query row on the contiguous cache.
    ("examples/transformers_llama.py", "num_attention_heads=16, num_key_value_heads=4, head_dim=64",
     (4, 1, 16, 64), (4, 300, 4, 64), "bf16", False, False),
]


class _DefaultSetLibrary:
    """What a library over the default set's catalog for one target answers, without images."""

    tuning: dict = {}

    def __init__(self, variants: list[Any]) -> None:
        self.variants = variants

    def kernel(self, name: str, **params: Any) -> Any:
        sel = match(self.variants, name, params)
        if not sel.accepted:
            raise KernelNotFound(f"{name} {params}")
        return sel.accepted[0]


@pytest.fixture(scope="module")
def default_set() -> dict[str, _DefaultSetLibrary]:
    from builder.registry import expand, load_kernels
    from builder.targets import DEFAULT, parse_targets

    kernels = load_kernels()
    per_arch: dict[str, list] = {a: [] for a in DEFAULT}
    for kernel in kernels.values():
        if not kernel.name.startswith("attn_"):
            continue
        for job in expand(kernel, parse_targets("default"), "default", "3.6.0"):
            config = SimpleNamespace(index=job.config_index, num_warps=job.config.num_warps,
                                     num_stages=job.config.num_stages, constexprs={})
            per_arch[job.target.arch].append(SimpleNamespace(
                kernel=job.kernel, key=job.key, target=job.target, config=config, params=dict(job.spec)))
    return {arch: _DefaultSetLibrary(vs) for arch, vs in per_arch.items()}


def _readme_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    # The blocks that call the prefill operator. The JAX block (aotriton_rt.jax) needs jax to run;
    # its call is the torch block's (causal=True), and examples/attention_jax.py is checked below
    # through EXAMPLES. The decode block calls decode_attention, whose kernels are in the default
    # set for every fp16/bf16 head dim of the set (builder/kernels/decode.py).
    return [b for b in re.findall(r"```python\n(.*?)```", text, re.S)
            if re.search(r"(?<!_)attention\(", b) and "import jax" not in b]


def _record_readme(block: str, monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Run a README block on the CPU; return each attention call as (q, k, v, dtype, options, backward)."""
    import aotriton_rt
    import aotriton_rt.ops.torch as op_torch

    calls: list[tuple] = []

    def shape(t: Any) -> tuple:
        return tuple(t.shape)

    def torch_op(q, k, v, **options):
        calls.append(((shape(q), shape(k), shape(v)), _DTYPES[q.dtype], options, q.requires_grad))
        return q * 1

    def forward(q, k, v, **options):
        calls.append(((shape(q), shape(k), shape(v)), _DTYPES[q.dtype], options, False))
        return q.detach() * 1, torch.zeros(q.shape[:-1])

    def backward(dout, q, k, v, out, lse, **options):
        calls.append(((shape(q), shape(k), shape(v)), _DTYPES[q.dtype], options, True))
        return q, k, v, None

    monkeypatch.setattr(op_torch, "attention", torch_op)
    monkeypatch.setattr(aotriton_rt, "attention", forward, raising=False)
    monkeypatch.setattr(aotriton_rt, "attention_backward", backward, raising=False)
    source = block.replace('device="cuda"', 'device="cpu"')
    exec(compile(source, "<README.md>", "exec"), {"__name__": "readme"})  # noqa: S102 - the project's own README
    return calls


def _missing(call: tuple, libraries: dict[str, _DefaultSetLibrary]) -> list[str]:
    (sq, sk, sv), dtype, options, backward = call
    options = dict(options)
    options.pop("library", None)
    for name in ("return_lse", "deterministic"):
        options.pop(name, None)
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        if options.get(name) is not None:  # the block's CPU tensor: a device array of its length
            options[name] = Dev(*tuple(options[name].shape), dtype="i32")
    cai_dtype = "fp16" if dtype == "bf16" else dtype  # CAI has no bf16; the dtype is patched into the specs
    arrays = [Dev(*s, dtype=cai_dtype) for s in (sq, sk, sv)]
    missing = []
    for arch, lib in libraries.items():
        rec = _Recorder()
        op.attention_kernels(*arrays, **options, library=rec)
        if backward:
            op.attention_kernels(*arrays, **options, backward=True, library=rec)
        wanted = [(n, {**p, "dtype": dtype}) for n, p in rec.asked]
        for name, params in wanted:
            try:
                lib.kernel(name, **params)
            except KernelNotFound:
                missing.append(f"{arch}: {name} {params}")
    return missing


class _Recorder:
    """A library that holds every variant and records which ones dispatch asks for."""

    tuning: dict = {}
    variants: list = []

    def __init__(self) -> None:
        self.asked: list[tuple[str, dict]] = []

    def kernel(self, name: str, **params: Any) -> dict:
        self.asked.append((name, params))
        return params


@pytest.fixture
def dispatch_as_the_default_set(monkeypatch: pytest.MonkeyPatch, default_set) -> None:
    # Where the call has a choice (causal alignment for equal lengths), dispatch takes what the
    # default set holds: availability comes from the sm90 default set (the same on every target).
    # The arch's own kernels (sm90's Gluon forward and backward, the aligned sibling) serve a
    # subset of the portable kernels' specs on one arch: every call must be servable by the
    # portable kernels on every target, so they are left out.
    own = (set(dispatch.ARCH_FORWARDS.values()) | set(dispatch.ALIGNED_SIBLINGS.values())
           | {k for kernels in dispatch.ARCH_BACKWARDS.values() for k in kernels.values()})
    monkeypatch.setattr(dispatch, "_available", lambda lib, name, params: name not in own
                        and bool(match(default_set["sm90"].variants, name,
                                       {k: v for k, v in params.items() if k != "dtype"}).accepted))
    # Its mask-mode-1 kernels take causal_align (they are this checkout's): they serve bottom-right calls.
    from builder.registry import load_kernels

    decls = load_kernels()
    monkeypatch.setattr(dispatch, "_takes", lambda lib, name, params, args: all(a in decls[name].signature
                                                                                for a in args))


def test_the_readme_has_attention_snippets_to_check() -> None:
    blocks = _readme_blocks()
    assert blocks and any("cu_seqlens_q" in b for b in blocks) and any("backward" in b for b in blocks)


@pytest.mark.parametrize("index", range(len(_readme_blocks())))
def test_every_readme_attention_call_runs_on_the_default_set_of_every_default_target(
        index: int, monkeypatch: pytest.MonkeyPatch, default_set, dispatch_as_the_default_set) -> None:
    calls = _record_readme(_readme_blocks()[index], monkeypatch)
    assert calls, "the README block made no attention call"
    missing = [m for call in calls for m in _missing(call, default_set)]
    assert not missing, "README attention calls the default set cannot serve:\n" + "\n".join(missing)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e[0])
def test_every_example_attention_call_runs_on_the_default_set_of_every_default_target(
        example: tuple, default_set, dispatch_as_the_default_set) -> None:
    path, line, shapes, dtype, options, backward = example
    assert line in (ROOT / path).read_text(encoding="utf-8"), f"{path} changed: update EXAMPLES"
    if shapes is None:  # attention_jax.py: (B, S, H, D) from its constants
        text = (ROOT / path).read_text(encoding="utf-8")
        b, s, h, d = (int(x) for x in re.search(r"B, S, H, D = (\d+), (\d+), (\d+), (\d+)", text).groups())
        shapes = ((b, s, h, d),) * 3
    missing = _missing((shapes, dtype, options, backward), default_set)
    assert not missing, f"{path} needs kernels the default set lacks:\n" + "\n".join(missing)


def test_the_check_itself_catches_a_call_the_default_set_lacks(default_set, dispatch_as_the_default_set) -> None:
    # fp32 and a bias are outside the default set: the same machinery must report them.
    shapes = ((2, 4, 128, 64),) * 3
    assert _missing((shapes, "fp32", {"causal": True}, False), default_set)
    # Causal in either alignment, unequal lengths, a window (at 80 zero-padded on 128's variants).
    lopsided = ((2, 4, 128, 80), (2, 4, 256, 80), (2, 4, 256, 80))
    for align in ("top_left", "bottom_right"):
        assert _missing((lopsided, "fp16", {"causal": True, "align": align, "window": (100, 0)}, True),
                        {"sm90": default_set["sm90"]}) == []
    # Dropout went to the full set; so did the backward at 256.
    assert _missing((lopsided, "fp16", {"causal": True, "dropout_p": 0.1, "seed": 1}, False),
                    {"sm90": default_set["sm90"]})
    wide = ((2, 4, 128, 256), (2, 4, 256, 256), (2, 4, 256, 256))
    assert _missing((wide, "fp16", {"causal": True}, True), {"sm90": default_set["sm90"]})


class _AsDtype:
    """A library answering as ``lib`` for the variants of ``dtype`` (the test arrays can only be fp16)."""

    tuning: dict = {}
    variants: list = []

    def __init__(self, lib: _DefaultSetLibrary, dtype: str) -> None:
        self.lib, self.dtype = lib, dtype

    def kernel(self, name: str, **params: Any) -> Any:
        cache = {"KV_DTYPE": self.dtype} if params.get("KV_DTYPE") == "fp16" else {}
        return self.lib.kernel(name, **{**params, "dtype": self.dtype, **cache})

    def variants_of(self, name: str) -> list:
        """``dtype``'s variants of ``name``, as the fp16 ones the arrays ask for (a cache of q's
        type too)."""
        def as_fp16(params: dict) -> dict:
            cache = {"KV_DTYPE": "fp16"} if params.get("KV_DTYPE") == self.dtype else {}
            return {**params, "dtype": "fp16", **cache}

        return [SimpleNamespace(**{**v.__dict__, "params": as_fp16(v.params)})
                for v in self.lib.variants if v.kernel == name and v.params.get("dtype") == self.dtype]


@pytest.mark.parametrize("example", DECODE_EXAMPLES, ids=lambda e: e[0])
def test_every_example_decode_call_runs_on_the_default_set_of_every_default_target(example: tuple, default_set) -> None:
    from aotriton_rt.ops import decode

    path, line, q_shape, cache_shape, dtype, paged, append = example
    assert line in (ROOT / path).read_text(encoding="utf-8"), f"{path} changed: update DECODE_EXAMPLES"
    b, _, _, d = q_shape
    hk = cache_shape[2]
    options: dict[str, Any] = {"cache_seqlens": Dev(b, dtype="i32"), "causal": True}
    if paged:
        options["block_table"] = Dev(b, cache_shape[0] // b, dtype="i32")
    if append:
        options["k_new"] = options["v_new"] = Dev(b, 1, hk, d)
    missing = []
    for arch, lib in default_set.items():
        try:
            kernels = decode.decode_kernels(Dev(*q_shape), Dev(*cache_shape), Dev(*cache_shape),
                                            library=_AsDtype(lib, dtype), **options)
        except KernelNotFound as e:
            missing.append(f"{arch}: {e}")
        else:
            wanted = {"attn_decode", "attn_decode_combine"} | ({"attn_decode_append"} if append else set())
            assert set(kernels) == wanted
    assert not missing, f"{path} needs decode kernels the default set lacks:\n" + "\n".join(missing)


def test_the_decode_check_catches_a_head_dim_the_default_set_lacks(default_set) -> None:
    from aotriton_rt.ops import decode

    lacks = (r"attn_decode with dtype=fp16, HEAD_DIM=160, PAGED=0, PADDED_D=0, KV_DTYPE=fp16 \(head dim 160 is a "
             r"bucket and the "
             r"arrays are 16-byte aligned; the images hold no masked variant at a bucket >= 160 either\), which "
             r"these images lack.*'dtype': 'bf16'")
    with pytest.raises(KernelNotFound, match=lacks):
        decode.decode_kernels(Dev(2, 1, 8, 160), Dev(2, 64, 2, 160), Dev(2, 64, 2, 160),
                              cache_seqlens=Dev(2, dtype="i32"), library=_AsDtype(default_set["sm90"], "bf16"))


@pytest.mark.parametrize("d,bucket", [(80, 128), (96, 128), (59, 64), (1, 64), (128, 128)])
def test_the_default_set_runs_every_decode_head_dim_up_to_128(default_set, d: int, bucket: int) -> None:
    from aotriton_rt.ops import decode

    for arch, lib in default_set.items():
        kernels = decode.decode_kernels(Dev(2, 1, 8, d), Dev(2, 64, 2, d), Dev(2, 64, 2, d),
                                        cache_seqlens=Dev(2, dtype="i32"), library=_AsDtype(lib, "bf16"))
        spec = kernels["attn_decode"].params
        assert (spec["HEAD_DIM"], spec["PADDED_D"]) == (bucket, int(d != bucket)), (arch, spec)
