"""The attention operator: FlashAttention-2 forward and backward on any framework's GPU arrays.

Inputs may be torch tensors, CuPy arrays, JAX arrays or any ``__cuda_array_interface__`` /
DLPack object; they are read in place (zero copy) whenever the kernels can address them.
Everything is validated before anything is allocated or launched, and every refusal names
the offending argument, its value and what is supported.

Example::

    out, lse = aotriton_rt.attention(q, k, v, causal=True)            # (B, H, S, D) torch tensors
    dq, dk, dv, _ = aotriton_rt.attention_backward(dout, q, k, v, out, lse, causal=True)

**Layouts.** ``layout="bhsd"`` (default) takes ``(batch, heads, seqlen, head_dim)``,
``layout="bshd"`` takes ``(batch, seqlen, heads, head_dim)``; any strides work as long as the
head dimension is contiguous (otherwise, or when a stride is not a multiple of 16 elements, the
operand is copied once into a padded contiguous buffer). Variable-length batches
(``cu_seqlens_q``/``cu_seqlens_k``, int32 prefix sums on the device) take packed
``(total, heads, head_dim)`` arrays; ``max_seqlen_q``/``max_seqlen_k`` default to the longest
sequence, which costs a device synchronisation to read.

**Outputs** are allocated in the framework of ``q`` for torch and CuPy, contiguous in the
caller's layout. Inputs of other frameworks (JAX, plain DLPack or CAI producers) get torch
tensors back, or CuPy arrays when torch is not installed: wrap them with
``jax.dlpack.from_dlpack`` (zero copy), or pass preallocated ``out=`` / ``lse=`` arrays.

**Masks.** ``causal=True`` hides keys after the query; ``window=(left, right)`` keeps keys with
``i + diag - left <= j <= i + diag + right`` (-1: unbounded side); ``align`` places the diagonal
when ``seqlen_q != seqlen_k``: ``"top_left"`` (``diag = 0``, torch SDPA's ``is_causal``) or
``"bottom_right"`` (``diag = seqlen_k - seqlen_q``, FlashAttention-2). Rows that see no key
output 0 and logsumexp ``-inf``.

**Bias** is additive, broadcastable (numpy rules) to ``(batch, heads_q, seqlen_q, seqlen_k)`` in
that order whatever the layout (varlen: ``(batch, heads_q, max_seqlen_q, max_seqlen_k)``, local
positions); broadcast dimensions are read with stride 0. The backward returns its gradient in
the bias's own shape, summed over the broadcast dimensions.

**Dropout** uses counter-based Philox: one ``(seed, offset)`` pair is one mask, the same in the
forward and the backward, reproducible across runs; ``return_mask=True`` also returns the
applied keep-mask (int8, 1 = kept; 0 outside the visible band).

**Dispatch.** The kernel variant follows from the call: dtype, head-dim bucket (the smallest of
16 32 48 64 80 96 128 160 192 224 256 that holds the head dim; narrower dims are zero-padded and
sliced back; q·k / v pairs 192/128 run unequal, other unequal pairs on the larger bucket), mask
mode, bias, dropout and varlen. The tuning config comes from the catalog's ``tuning`` table when
it has rules for the kernel (see :func:`select_config`), else config 0. The backward runs the
split scheme (preprocess, dk/dv, dq: bit-reproducible, and the faster one on the H200) unless
``scheme="atomic"`` or a catalog tuning rule asks for atomic dQ, or the images hold only that.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import interop
from ..errors import ArgumentError, CatalogError, KernelNotFound, UnsupportedError

__all__ = [
    "AttentionCall",
    "attention",
    "attention_backward",
    "attention_kernels",
    "backward_params",
    "forward_params",
    "head_dim_buckets",
    "select_config",
]

# Mirrors builder/kernels/attention.py (the runtime never imports the builder; a test keeps the
# two equal): the head dims the kernels are compiled for, and the unequal q·k / v pairs.
HEAD_DIM_BUCKETS = (16, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256)
UNEQUAL_HEAD_DIMS = ((192, 128),)
DTYPES = ("fp16", "bf16", "fp32")
# Declared stride divisibility (elements): Q/K/V/Out and gradients 16, Bias/dBias 8.
_ALIGN = 16
_BIAS_ALIGN = 8
_GRID_Y = 65535  # batch * heads is the grid's y extent
_I32_MAX = 2**31 - 1
_U64 = 2**64
_LAYOUTS = ("bhsd", "bshd")
_ALIGNS = ("top_left", "bottom_right")

FWD = "attn_fwd"
PRE = "attn_bwd_preprocess"
DKDV = "attn_bwd_dkdv"
DQ = "attn_bwd_dq"
CONVERT = "attn_bwd_dq_convert"


# ---------------------------------------------------------------------------------------------
# Dispatch: pure functions of the call's facts and of what the images hold.
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionCall:
    """The facts of one attention call that decide which kernels run.

    ``causal`` is the kernels' mask mode (0 none, 1 band aligned top-left, 2 bottom-right);
    ``causal_equivalent`` says the two alignments coincide for this call (equal lengths), so
    either compiled mode may serve it. ``dropout`` is 0 off, 1 on, 2 on and the mask returned.
    """

    dtype: str
    head_dim: int
    head_dim_v: int
    causal: int = 0
    causal_equivalent: bool = False
    bias: bool = False
    dropout: int = 0
    varlen: bool = False
    seqlen_q: int = 0
    seqlen_k: int = 0

    def describe(self) -> str:
        """The combination in words, for error messages."""
        parts = [self.dtype, f"head dim {self.head_dim}" + (f"/{self.head_dim_v}" if self.head_dim_v != self.head_dim
                                                           else "")]
        parts.append({0: "no mask", 1: "causal/window top-left", 2: "causal/window bottom-right"}[self.causal])
        if self.bias:
            parts.append("bias")
        if self.dropout:
            parts.append("dropout" + (" with mask" if self.dropout == 2 else ""))
        if self.varlen:
            parts.append("varlen")
        return ", ".join(parts)


Available = Callable[[str, Mapping[str, Any]], bool]


def _everything(name: str, params: Mapping[str, Any]) -> bool:
    return True


def bucket(head_dim: int) -> int:
    """The smallest compiled head-dim bucket holding ``head_dim`` (1..256)."""
    for b in HEAD_DIM_BUCKETS:
        if b >= head_dim:
            return b
    raise UnsupportedError(f"head dim {head_dim} exceeds the largest supported head dim {HEAD_DIM_BUCKETS[-1]}; "
                           f"supported: 1..{HEAD_DIM_BUCKETS[-1]} (compiled buckets "
                           f"{', '.join(map(str, HEAD_DIM_BUCKETS))}; others are zero-padded)")


def head_dim_buckets(head_dim: int, head_dim_v: int) -> list[tuple[int, int]]:
    """Compiled (q·k, v) head-dim pairs able to run these head dims, best first.

    Equal dims use their bucket; an unequal pair runs as such when it is compiled
    (``UNEQUAL_HEAD_DIMS``), and otherwise on the larger bucket for both (zero padding
    changes neither the scores nor the kept output columns).
    """
    bq, bv = bucket(head_dim), bucket(head_dim_v)
    if bq == bv:
        return [(bq, bq)]
    wide = max(bq, bv)
    return [(bq, bv), (wide, wide)] if (bq, bv) in UNEQUAL_HEAD_DIMS else [(wide, wide)]


def _first(name: str, candidates: list[dict], available: Available) -> dict:
    # The first candidate the images hold; if none, the first, so that the library's
    # KernelNotFound explains what is missing.
    for c in candidates:
        if available(name, c):
            return c
    return candidates[0]


def _causal_modes(call: AttentionCall) -> list[int]:
    if call.causal and call.causal_equivalent:
        # Equal lengths: both alignments give the same band; the default build has mode 2.
        return [2, 1]
    return [call.causal]


def forward_params(call: AttentionCall, available: Available | None = None) -> dict[str, Any]:
    """The ``attn_fwd`` spec (catalog parameters) for a call.

    ``available(kernel, params)`` says whether the images hold such a variant; among
    equivalent choices (head-dim pairs, causal alignments) the first available is taken.
    """
    available = available or _everything
    candidates = [{"dtype": call.dtype, "HEAD_DIM": dk, "HEAD_DIM_V": dv, "CAUSAL": c, "BIAS": int(call.bias),
                   "DROPOUT": call.dropout, "VARLEN": int(call.varlen)}
                  for dk, dv in head_dim_buckets(call.head_dim, call.head_dim_v) for c in _causal_modes(call)]
    return _first(FWD, candidates, available)


def backward_params(call: AttentionCall, available: Available | None = None, *, deterministic: bool = False,
                    dbias: bool = True, mode: str | None = None) -> tuple[str, dict[str, dict[str, Any]]]:
    """The backward scheme and the spec of each kernel it launches, in launch order.

    Returns ``("split", {preprocess, dkdv, dq})`` by default: deterministic, and on the H200
    also the faster scheme (docs/performance.md: the atomic-dQ dk/dv kernel was 1.1-1.9x slower
    at D=128). ``("atomic", {preprocess, dkdv, convert})`` when ``mode == "atomic"`` (e.g. from
    the tuning table) or when the images hold only the atomic kernels; never when
    ``deterministic``. ``dbias``: the dk/dv kernel also writes dBias (its ``BIAS=2``).
    """
    available = available or _everything
    dropout = int(bool(call.dropout))
    bias_dkdv = (2 if dbias else 1) if call.bias else 0

    def scheme(atomic: int, dk: int, dv: int, causal: int) -> dict[str, dict[str, Any]]:
        common = {"dtype": call.dtype, "HEAD_DIM": dk, "HEAD_DIM_V": dv}
        masks = {"CAUSAL": causal, "DROPOUT": dropout, "VARLEN": int(call.varlen)}
        kernels = {PRE: {**common, "VARLEN": int(call.varlen), "DQ_ATOMIC": atomic},
                   DKDV: {**common, **masks, "BIAS": bias_dkdv, "DQ_ATOMIC": atomic}}
        if atomic:
            kernels[CONVERT] = {"dtype": call.dtype, "HEAD_DIM": dk, "VARLEN": int(call.varlen)}
        else:
            kernels[DQ] = {**common, **masks, "BIAS": int(call.bias)}
        return kernels

    shapes = [(dk, dv, c) for dk, dv in head_dim_buckets(call.head_dim, call.head_dim_v)
              for c in _causal_modes(call)]
    order = [1, 0] if mode == "atomic" else [0, 1]
    for atomic in order:
        if atomic and deterministic:
            continue
        for dk, dv, c in shapes:
            kernels = scheme(atomic, dk, dv, c)
            if all(available(n, p) for n, p in kernels.items()):
                return ("atomic" if atomic else "split"), kernels
    return "split", scheme(0, *shapes[0])


def _in_range(value: int, bounds: Any, where: str) -> bool:
    if bounds is None:
        return True
    if not (isinstance(bounds, (list, tuple)) and len(bounds) == 2):
        raise CatalogError(f"catalog {where} must be [low, high] (high may be null), got {bounds!r}")
    lo, hi = bounds
    return (lo is None or value >= lo) and (hi is None or value <= hi)


def select_config(rules: Any, *, kernel: str, spec: Mapping[str, Any], seqlen_q: int, seqlen_k: int,
                  arch: str | Callable[[], str] | None = None) -> int:
    """The tuning config index for a call, from a catalog ``tuning[kernel]`` rule list.

    Each rule is an object; the first whose conditions all hold gives ``config`` (an index
    into the kernel's config table). Conditions, all optional: ``arch`` (catalog arch, e.g.
    ``"sm90"``), ``spec`` (a subset of the variant's spec), ``seqlen_q`` / ``seqlen_k``
    (inclusive ``[low, high]`` ranges, ``null`` for open ends). No rule matching: 0, the
    kernel's default. The operator caches its choice per power-of-two length bin, so range
    bounds should be powers of two. For the backward, rules under ``"attn_bwd_mode"`` give ``"mode"``
    (``"split"`` or ``"atomic"``) instead of ``config`` (see :func:`select_mode`).

    Example catalog fragment::

        "tuning": {"attn_fwd": [{"arch": "sm90", "spec": {"HEAD_DIM": 128}, "seqlen_k": [4096, null],
                                 "config": 2}]}
    """
    rule = _matching_rule(rules, kernel, spec, seqlen_q, seqlen_k, arch)
    if rule is None:
        return 0
    index = rule.get("config", 0)
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise CatalogError(f"catalog tuning[{kernel!r}] rule {rule!r}: config must be an integer >= 0")
    return index


def select_mode(rules: Any, *, spec: Mapping[str, Any], seqlen_q: int, seqlen_k: int,
                arch: str | Callable[[], str] | None = None) -> str | None:
    """The backward scheme a ``tuning["attn_bwd_mode"]`` rule asks for, or None."""
    rule = _matching_rule(rules, "attn_bwd_mode", spec, seqlen_q, seqlen_k, arch)
    if rule is None:
        return None
    mode = rule.get("mode")
    if mode not in ("split", "atomic"):
        raise CatalogError(f"catalog tuning['attn_bwd_mode'] rule {rule!r}: mode must be 'split' or 'atomic'")
    return mode


def _matching_rule(rules: Any, kernel: str, spec: Mapping[str, Any], seqlen_q: int, seqlen_k: int,
                   arch: str | Callable[[], str] | None) -> dict | None:
    if not rules:
        return None
    if not isinstance(rules, list):
        raise CatalogError(f"catalog tuning[{kernel!r}] must be a list of rules, got {type(rules).__name__}")
    for i, rule in enumerate(rules):
        where = f"tuning[{kernel!r}][{i}]"
        if not isinstance(rule, dict):
            raise CatalogError(f"catalog {where} must be an object, got {rule!r}")
        want = rule.get("spec", {})
        if not isinstance(want, dict):
            raise CatalogError(f"catalog {where}.spec must be an object, got {want!r}")
        if any(spec.get(key) != value for key, value in want.items()):
            continue
        if not (_in_range(seqlen_q, rule.get("seqlen_q"), where + ".seqlen_q")
                and _in_range(seqlen_k, rule.get("seqlen_k"), where + ".seqlen_k")):
            continue
        if "arch" in rule:
            # Asked last: finding the device's arch may need the driver.
            if callable(arch):
                arch = arch()
            if rule["arch"] != arch:
                continue
        return rule
    return None


# ---------------------------------------------------------------------------------------------
# Libraries: availability, tuning, handles (cached per library).
# ---------------------------------------------------------------------------------------------

def _default_library() -> Any:
    from ..library import default_library

    return default_library()


class _Kernels:
    """Per-library caches: which variants exist, the tuning table, handles per call shape."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self.lock = threading.Lock()
        self.available_cache: dict[tuple, bool] = {}
        self.handles: dict[tuple, Any] = {}
        self.plans: dict[tuple, Any] = {}
        self.arch: dict[int, str] = {}
        tuning: dict[str, Any] = {}
        for cat in getattr(lib, "catalogs", ()):
            for name, rules in (cat.tuning or {}).items():
                tuning.setdefault(name, rules)  # the first folder's table wins, like its variants
        self.tuning = tuning

    def available(self, name: str, params: Mapping[str, Any]) -> bool:
        key = (name, tuple(sorted(params.items())))
        hit = self.available_cache.get(key)
        if hit is None:
            hit = self.available_cache[key] = _available(self.lib, name, params)
        return hit

    def device_arch(self, device: int) -> str:
        arch = self.arch.get(device)
        if arch is None:
            from .. import arch as _arch

            built = sorted({(v.target.backend, v.target.arch) for v in self.lib.variants})
            if len(built) == 1:
                # Images of one arch: the device must run that arch, or the launch will say why.
                arch = built[0][1]
            else:
                driver = self.lib.driver
                raw = _arch.normalize(driver.backend, driver.device_arch(max(device, 0)))
                arch = _arch.pick_target(driver.backend, raw, sorted(a for b, a in built if b == driver.backend))
            self.arch[device] = arch
        return arch

    def _call_key(self, call: AttentionCall, device: int, *extra: Any) -> tuple:
        # Lengths matter only to tuning rules, and to those only through their ranges.
        tuned = bool(self.tuning)
        return (call.dtype, call.head_dim, call.head_dim_v, call.causal, call.causal_equivalent, call.bias,
                call.dropout, call.varlen, _seqlen_bin(call.seqlen_q) if tuned else 0,
                _seqlen_bin(call.seqlen_k) if tuned else 0, device, *extra)

    def forward(self, call: AttentionCall, device: int) -> tuple[dict[str, Any], Any]:
        """The forward's spec and kernel handle for a call (cached per call shape)."""
        key = self._call_key(call, device)
        hit = self.plans.get(key)
        if hit is None:
            spec = forward_params(call, self.available)
            hit = self.plans[key] = (spec, self.handle(FWD, spec, call, device))
        return hit

    def backward(self, call: AttentionCall, device: int, deterministic: bool, dbias: bool,
                 scheme: str | None = None) -> tuple[str, dict[str, dict[str, Any]], dict[str, Any]]:
        """The backward's scheme, specs and handles for a call (cached per call shape)."""
        key = self._call_key(call, device, "bwd", deterministic, dbias, scheme)
        hit = self.plans.get(key)
        if hit is None:
            mode = scheme
            rules = self.tuning.get("attn_bwd_mode")
            if rules and not deterministic and scheme is None:
                mode = select_mode(rules, spec={"dtype": call.dtype, "HEAD_DIM": bucket(call.head_dim)},
                                   seqlen_q=call.seqlen_q, seqlen_k=call.seqlen_k,
                                   arch=lambda: self.device_arch(device))
            mode, specs = backward_params(call, self.available, deterministic=deterministic, dbias=dbias, mode=mode)
            handles = {name: self.handle(name, spec, call, device) for name, spec in specs.items()}
            hit = self.plans[key] = (mode, specs, handles)
        return hit

    def handle(self, name: str, spec: dict[str, Any], call: AttentionCall, device: int) -> Any:
        rules = self.tuning.get(name)
        key = (name, tuple(sorted(spec.items())), device,
               _seqlen_bin(call.seqlen_q) if rules else 0, _seqlen_bin(call.seqlen_k) if rules else 0)
        handle = self.handles.get(key)
        if handle is not None:
            return handle
        params = dict(spec)
        if rules:
            index = select_config(rules, kernel=name, spec=spec, seqlen_q=call.seqlen_q, seqlen_k=call.seqlen_k,
                                  arch=lambda: self.device_arch(device))
            if index:
                params.update(config_params(self.lib.variants, name, spec, index, self.device_arch(device)))
        try:
            handle = self.lib.kernel(name, **params)
        except KernelNotFound as e:
            raise KernelNotFound(
                f"attention ({call.describe()}) needs {name} with {_show(spec)}, which these images lack; "
                f"build it (`python -m builder build --set full --kernels {name}`) or use a supported "
                f"combination. {e}") from None
        with self.lock:
            self.handles[key] = handle
        return handle


def _seqlen_bin(n: int) -> int:
    # Tuning rules cut sequence lengths into ranges; caching per power of two bounds the cache
    # while rules at powers of two (the usual cut points) stay exact.
    return max(n, 1).bit_length()


def _show(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def config_params(variants: Sequence[Any], name: str, spec: Mapping[str, Any], index: int,
                  arch: str) -> dict[str, Any]:
    """Parameters selecting config ``index`` of ``name``/``spec`` on ``arch``; {} (config 0)
    when that config was not built."""
    for v in variants:
        if v.kernel == name and v.config.index == index and v.target.arch == arch and \
                all(v.spec.get(k) == val for k, val in spec.items()):
            return {**v.config.constexprs, "num_warps": v.config.num_warps, "num_stages": v.config.num_stages}
    return {}


def _available(lib: Any, name: str, params: Mapping[str, Any]) -> bool:
    from ..select import match

    return bool(match(lib.variants, name, params).accepted)


_KERNELS: dict[int, _Kernels] = {}
_KERNELS_LOCK = threading.Lock()


def _kernels_of(library: Any) -> _Kernels:
    lib = library if library is not None else _default_library()
    ks = _KERNELS.get(id(lib))
    if ks is None or ks.lib is not lib:
        with _KERNELS_LOCK:
            ks = _KERNELS.get(id(lib))
            if ks is None or ks.lib is not lib:
                ks = _KERNELS[id(lib)] = _Kernels(lib)
    return ks


# ---------------------------------------------------------------------------------------------
# Arrays: describe any input, allocate and copy in the working framework (torch or CuPy).
# ---------------------------------------------------------------------------------------------

def _describe(obj: Any, name: str) -> interop.ArrayInfo:
    try:
        return interop.describe(obj)
    except ArgumentError as e:
        raise ArgumentError(f"{name}: {e}") from None
    except UnsupportedError as e:
        raise UnsupportedError(f"{name}: {e}") from None


class _TorchArrays:
    framework = "torch"

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
                       "i8": torch.int8, "i32": torch.int32}

    def convert(self, obj: Any, info: interop.ArrayInfo) -> Any:
        torch = self.torch
        if isinstance(obj, torch.Tensor):
            # The kernels are outside autograd; copies made here must not join the caller's graph.
            return obj.detach() if obj.requires_grad else obj
        if hasattr(obj, "__dlpack__"):
            return torch.from_dlpack(obj)
        return torch.as_tensor(obj, device=torch.device("cuda", max(info.device, 0)))

    def empty(self, shape: tuple[int, ...], dtype: str, like: Any) -> Any:
        return self.torch.empty(shape, dtype=self.dtypes[dtype], device=like.device)

    def zeros(self, shape: tuple[int, ...], dtype: str, like: Any) -> Any:
        return self.torch.zeros(shape, dtype=self.dtypes[dtype], device=like.device)

    def full(self, shape: tuple[int, ...], value: float, dtype: str, like: Any) -> Any:
        return self.torch.full(shape, value, dtype=self.dtypes[dtype], device=like.device)

    def reshape(self, x: Any, shape: tuple[int, ...]) -> Any:
        return x.reshape(shape)

    def sum_keep(self, x: Any, dims: tuple[int, ...], dtype: str) -> Any:
        return x.sum(dim=dims, keepdim=True, dtype=self.torch.float32).to(self.dtypes[dtype])

    def contiguous(self, x: Any) -> Any:
        return x.contiguous()

    def max_len(self, cu: Any) -> int:
        return int((cu[1:] - cu[:-1]).max().item()) if cu.shape[0] > 1 else 0


class _CupyArrays:
    framework = "cupy"

    def __init__(self) -> None:
        import cupy

        self.cupy = cupy
        self.dtypes = {"fp16": "float16", "fp32": "float32", "i8": "int8", "i32": "int32"}

    def convert(self, obj: Any, info: interop.ArrayInfo) -> Any:
        cupy = self.cupy
        if isinstance(obj, cupy.ndarray):
            return obj
        with cupy.cuda.Device(max(info.device, 0)):
            return cupy.from_dlpack(obj) if hasattr(obj, "__dlpack__") else cupy.asarray(obj)

    def _dtype(self, dtype: str) -> str:
        if dtype not in self.dtypes:
            raise UnsupportedError(f"CuPy has no {dtype} dtype; pass torch tensors for {dtype} attention")
        return self.dtypes[dtype]

    def empty(self, shape: tuple[int, ...], dtype: str, like: Any) -> Any:
        with like.device:
            return self.cupy.empty(shape, dtype=self._dtype(dtype))

    def zeros(self, shape: tuple[int, ...], dtype: str, like: Any) -> Any:
        with like.device:
            return self.cupy.zeros(shape, dtype=self._dtype(dtype))

    def full(self, shape: tuple[int, ...], value: float, dtype: str, like: Any) -> Any:
        with like.device:
            return self.cupy.full(shape, value, dtype=self._dtype(dtype))

    def reshape(self, x: Any, shape: tuple[int, ...]) -> Any:
        return x.reshape(shape)

    def sum_keep(self, x: Any, dims: tuple[int, ...], dtype: str) -> Any:
        return x.sum(axis=dims, keepdims=True, dtype="float32").astype(self._dtype(dtype))

    def contiguous(self, x: Any) -> Any:
        return self.cupy.ascontiguousarray(x)

    def max_len(self, cu: Any) -> int:
        return int((cu[1:] - cu[:-1]).max()) if cu.shape[0] > 1 else 0


_ARRAYS: dict[str, Any] = {}


def _arrays_for(framework: str) -> Any:
    """The framework that allocates outputs: the input's for torch and CuPy, else torch, else CuPy."""
    xp = _ARRAYS.get(framework)
    if xp is not None:
        return xp
    order = [framework] if framework in ("torch", "cupy") else ["torch", "cupy"]
    for name in order:
        try:
            xp = _TorchArrays() if name == "torch" else _CupyArrays()
        except ImportError:
            continue
        _ARRAYS[framework] = xp
        return xp
    raise UnsupportedError(f"attention on {framework} arrays allocates its outputs and scratch with torch or CuPy, "
                           f"and neither is installed; install one (pip install torch, or cupy-cuda12x)")


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


# ---------------------------------------------------------------------------------------------
# Operands: (batch, head, row) strides as the kernels see them; zero copy when possible.
# ---------------------------------------------------------------------------------------------

@dataclass
class _Operand:
    """One (batch, heads, rows, dim) tensor as the kernels address it."""

    array: Any
    strides: tuple[int, int, int]  # batch, head, row (elements)


def _bhs(shape: Sequence[int], strides: Sequence[int], layout: str, varlen: bool
         ) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(extents, strides) of the batch, head and row axes; batch is absent (0) under varlen."""
    if varlen:
        return (1, shape[1], shape[0]), (0, strides[1], strides[0])
    if layout == "bhsd":
        return (shape[0], shape[1], shape[2]), (strides[0], strides[1], strides[2])
    return (shape[0], shape[2], shape[1]), (strides[0], strides[2], strides[1])


def _kernel_strides(extents: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    # An axis of extent 1 is never stepped over; 0 satisfies any divisibility the kernel assumes.
    return tuple(0 if e <= 1 else s for e, s in zip(extents, strides))


def _addressable(info: interop.ArrayInfo, strides: Sequence[int], width: int, multiple: int) -> bool:
    """Can the kernels read this array in place as rows of ``width`` elements?"""
    dim_ok = info.shape[-1] == width and (info.strides[-1] == 1 or info.shape[-1] <= 1)
    return (dim_ok and info.ptr % 16 == 0 and all(s >= 0 and s % multiple == 0 for s in strides)
            and strides[-1] <= _I32_MAX)


def _operand(xp: Any, obj: Any, info: interop.ArrayInfo, layout: str, varlen: bool, width: int) -> _Operand:
    """The array itself when addressable with rows of ``width``, else a zero-padded contiguous copy."""
    extents, strides = _bhs(info.shape, info.strides, layout, varlen)
    strides = _kernel_strides(extents, strides)
    if _addressable(info, strides, width, _ALIGN):
        return _Operand(obj, strides)
    shape = tuple(info.shape[:-1]) + (width,)
    buf = xp.zeros(shape, info.dtype, obj) if width != info.shape[-1] else xp.empty(shape, info.dtype, obj)
    buf[..., :info.shape[-1]] = obj
    extents, strides = _bhs(shape, _contiguous_strides(shape), layout, varlen)
    return _Operand(buf, _kernel_strides(extents, strides))


class _Output:
    """An output the kernel writes: the caller's array, a fresh exact one, or a padded buffer
    copied into the exact one afterwards."""

    def __init__(self, xp: Any, shape: tuple[int, ...], dtype: str, like: Any, layout: str, varlen: bool,
                 width: int, user: Any = None, user_info: interop.ArrayInfo | None = None,
                 fill: float | None = None) -> None:
        self.result = user
        self.buffer = None
        if user is not None:
            extents, strides = _bhs(user_info.shape, user_info.strides, layout, varlen)
            strides = _kernel_strides(extents, strides)
            if _addressable(user_info, strides, width, _ALIGN):
                self.array, self.strides = xp.convert(user, user_info), strides
                return
            self.target = xp.convert(user, user_info)
        padded = tuple(shape[:-1]) + (width,)
        if fill is not None:
            arr = xp.full(padded, fill, dtype, like)
        else:
            arr = xp.empty(padded, dtype, like)
        extents, strides = _bhs(padded, _contiguous_strides(padded), layout, varlen)
        self.array, self.strides = arr, _kernel_strides(extents, strides)
        if user is None and width == shape[-1]:
            self.result = arr
        else:
            self.buffer = arr
            if user is None:
                self.target = xp.empty(shape, dtype, like)
                self.result = self.target

    def finish(self) -> Any:
        if self.buffer is not None:
            self.target[...] = self.buffer[..., :self.target.shape[-1]]
        return self.result


# ---------------------------------------------------------------------------------------------
# Validation: every argument checked before anything is allocated or launched.
# ---------------------------------------------------------------------------------------------

@dataclass
class _Problem:
    """A validated call: facts, argument infos and the scalar arguments of the kernels."""

    q: Any
    k: Any
    v: Any
    qi: interop.ArrayInfo
    ki: interop.ArrayInfo
    vi: interop.ArrayInfo
    layout: str
    varlen: bool
    batch: int
    heads_q: int
    heads_k: int
    seqlen_q: int  # dense length, or max_seqlen under varlen
    seqlen_k: int
    rows_q: int  # rows of the q/out arrays per (batch, head): seqlen_q, or total_q under varlen
    rows_k: int
    head_dim: int
    head_dim_v: int
    dtype: str
    device: int
    causal_mode: int
    causal_equivalent: bool
    window_left: int
    window_right: int
    scale: float
    dropout_p: float
    seed: int
    offset: int
    bias: Any = None
    bias_info: interop.ArrayInfo | None = None
    cu_q: Any = None
    cu_k: Any = None
    cu_qi: interop.ArrayInfo | None = None
    cu_ki: interop.ArrayInfo | None = None

    def call(self, dropout: int) -> AttentionCall:
        return AttentionCall(self.dtype, self.head_dim, self.head_dim_v, self.causal_mode, self.causal_equivalent,
                             self.bias is not None, dropout, self.varlen, self.seqlen_q, self.seqlen_k)

    def out_shape(self, width: int | None = None) -> tuple[int, ...]:
        d = self.head_dim_v if width is None else width
        if self.varlen:
            return (self.rows_q, self.heads_q, d)
        if self.layout == "bhsd":
            return (self.batch, self.heads_q, self.seqlen_q, d)
        return (self.batch, self.seqlen_q, self.heads_q, d)

    def lse_shape(self) -> tuple[int, ...]:
        return (self.heads_q, self.rows_q) if self.varlen else (self.batch, self.heads_q, self.seqlen_q)

    def bias_full_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads_q, self.seqlen_q, self.seqlen_k)

    def scalars(self) -> dict[str, Any]:
        return {"batch": self.batch, "num_heads_q": self.heads_q, "num_heads_k": self.heads_k,
                "seqlen_q": self.seqlen_q, "seqlen_k": self.seqlen_k, "sm_scale": self.scale,
                "dropout_p": self.dropout_p, "philox_seed": self.seed, "philox_offset": self.offset,
                "window_left": self.window_left, "window_right": self.window_right}


def _int_arg(value: Any, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import operator

            value = operator.index(value)
        except TypeError:
            raise ArgumentError(f"{name} must be an integer, got {value!r}") from None
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ArgumentError(f"{name} must be {bounds}, got {value}")
    return value


def _same_device(infos: Sequence[tuple[str, interop.ArrayInfo]]) -> int:
    device, first = -1, ""
    for name, info in infos:
        if info.device < 0:
            continue  # unknown (CAI without a resolver): the launch path checks the pointer
        if device < 0:
            device, first = info.device, name
        elif info.device != device:
            raise ArgumentError(f"{name} is on device {info.device} but {first} is on device {device}; "
                                f"every array must be on one GPU")
    return device


def _mask(causal: Any, window: Any, align: str, seqlen_q: int, seqlen_k: int, varlen: bool, same_cu: bool
          ) -> tuple[int, bool, int, int]:
    """(CAUSAL mode, alignments equivalent, window_left, window_right) from the user's options."""
    if not isinstance(causal, bool):
        raise ArgumentError(f"causal must be True or False, got {causal!r}; choose the diagonal with "
                            f"align='top_left' or 'bottom_right'")
    if align not in _ALIGNS:
        raise ArgumentError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    if window is not None:
        ok = isinstance(window, (tuple, list)) and len(window) == 2 and all(
            isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)
        if not ok:
            raise ArgumentError(f"window must be (left, right), two integers >= -1 (-1: unbounded), got {window!r}")
        left, right = window
    else:
        left, right = -1, -1
    if causal:
        if right not in (-1, 0):
            raise ArgumentError(f"causal=True hides every key right of the diagonal, but window={tuple(window)} asks "
                                f"for {right} keys there; pass window=({left}, 0) or causal=False")
        right = 0
    elif left < 0 and right < 0:
        return 0, False, -1, -1
    equivalent = (not varlen and seqlen_q == seqlen_k) or (varlen and same_cu)
    return (1 if align == "top_left" else 2), equivalent, left, right


def _prepare(q: Any, k: Any, v: Any, *, causal: Any, window: Any, align: str, bias: Any, dropout_p: Any,
             seed: Any, offset: Any, scale: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
             max_seqlen_k: Any, layout: str) -> _Problem:
    if layout not in _LAYOUTS:
        raise ArgumentError(f"layout must be 'bhsd' (batch, heads, seqlen, head_dim) or 'bshd' (batch, seqlen, "
                            f"heads, head_dim), got {layout!r}")
    qi, ki, vi = _describe(q, "q"), _describe(k, "k"), _describe(v, "v")
    if qi.dtype not in DTYPES:
        raise UnsupportedError(f"q has dtype {qi.dtype}; attention supports {', '.join(DTYPES)}")
    for name, info in (("k", ki), ("v", vi)):
        if info.dtype != qi.dtype:
            raise ArgumentError(f"{name} has dtype {info.dtype} but q has {qi.dtype}; q, k, v (and bias) must "
                                f"share one dtype")
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    infos = [("q", qi), ("k", ki), ("v", vi)]
    cu_qi = cu_ki = None
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ArgumentError("variable-length attention needs both cu_seqlens_q and cu_seqlens_k "
                                "(int32 prefix sums of the sequence lengths, batch + 1 entries)")
        for name, info in (("q", qi), ("k", ki), ("v", vi)):
            if len(info.shape) != 3:
                raise ArgumentError(f"{name} must be 3-D (total, heads, head_dim) with cu_seqlens, got shape "
                                    f"{tuple(info.shape)}")
        cu_qi, cu_ki = _describe(cu_seqlens_q, "cu_seqlens_q"), _describe(cu_seqlens_k, "cu_seqlens_k")
        for name, info in (("cu_seqlens_q", cu_qi), ("cu_seqlens_k", cu_ki)):
            if info.dtype != "i32":
                raise ArgumentError(f"{name} must be int32, got {info.dtype}; convert it, e.g. cu.to(torch.int32)")
            if len(info.shape) != 1 or info.shape[0] < 2:
                raise ArgumentError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(info.shape)}")
            if info.strides[0] != 1:
                raise ArgumentError(f"{name} must be contiguous, got stride {info.strides[0]}")
        if cu_qi.shape != cu_ki.shape:
            raise ArgumentError(f"cu_seqlens_q has {cu_qi.shape[0]} entries but cu_seqlens_k has {cu_ki.shape[0]}; "
                                f"both are batch + 1 long")
        infos += [("cu_seqlens_q", cu_qi), ("cu_seqlens_k", cu_ki)]
        batch = cu_qi.shape[0] - 1
        rows_q, heads_q, dq_ = qi.shape
        rows_k, heads_k, dk_ = ki.shape
        rows_v, heads_v, dv_ = vi.shape
        if rows_v != rows_k:
            raise ArgumentError(f"v has {rows_v} rows but k has {rows_k}; k and v hold the same keys")
        seqlen_q = seqlen_k = -1
    else:
        for name, info in (("q", qi), ("k", ki), ("v", vi)):
            if len(info.shape) != 4:
                axes = "(batch, heads, seqlen, head_dim)" if layout == "bhsd" else "(batch, seqlen, heads, head_dim)"
                raise ArgumentError(f"{name} must be 4-D {axes} for layout={layout!r}, got shape "
                                    f"{tuple(info.shape)} (packed varlen arrays need cu_seqlens_q/k)")
        if max_seqlen_q is not None or max_seqlen_k is not None:
            raise ArgumentError("max_seqlen_q/max_seqlen_k only apply with cu_seqlens_q/cu_seqlens_k")
        (batch, heads_q, seqlen_q), _ = _bhs(qi.shape, qi.strides, layout, False)
        (batch_k, heads_k, seqlen_k), _ = _bhs(ki.shape, ki.strides, layout, False)
        (batch_v, heads_v, seqlen_v), _ = _bhs(vi.shape, vi.strides, layout, False)
        dq_, dk_, dv_ = qi.shape[3], ki.shape[3], vi.shape[3]
        for name, b in (("k", batch_k), ("v", batch_v)):
            if b != batch:
                raise ArgumentError(f"{name} has batch {b} but q has batch {batch}")
        if seqlen_v != seqlen_k:
            raise ArgumentError(f"v has seqlen {seqlen_v} but k has {seqlen_k}; k and v hold the same keys")
        rows_q, rows_k = seqlen_q, seqlen_k
    if dk_ != dq_:
        raise ArgumentError(f"k has head dim {dk_} but q has {dq_}; q·k needs equal head dims (v's may differ)")
    for what, d in (("q·k", dq_), ("v", dv_)):
        if d < 1:
            raise ArgumentError(f"the {what} head dim is {d}; it must be at least 1")
        if d > HEAD_DIM_BUCKETS[-1]:
            raise UnsupportedError(f"the {what} head dim {d} exceeds the largest supported head dim "
                                   f"{HEAD_DIM_BUCKETS[-1]}; supported: 1..{HEAD_DIM_BUCKETS[-1]} (compiled "
                                   f"buckets {', '.join(map(str, HEAD_DIM_BUCKETS))}; others are zero-padded)")
    if heads_v != heads_k:
        raise ArgumentError(f"v has {heads_v} heads but k has {heads_k}; k and v share their heads")
    if heads_k < 1 or heads_q % heads_k:
        raise ArgumentError(f"q has {heads_q} heads, not a multiple of k's {heads_k}; grouped-query attention "
                            f"needs num_heads_q % num_heads_k == 0 (MQA: 1 key/value head)")
    if batch * heads_q > _GRID_Y:
        raise UnsupportedError(f"batch * heads_q = {batch} * {heads_q} = {batch * heads_q} exceeds {_GRID_Y}, the "
                               f"kernels' grid limit; split the batch into chunks of at most "
                               f"{max(_GRID_Y // max(heads_q, 1), 1)}")
    if max(rows_q, rows_k) > _I32_MAX:
        raise UnsupportedError(f"sequences of {max(rows_q, rows_k)} rows exceed the kernels' 32-bit row index")
    device = _same_device(infos)

    # Scalars.
    if scale is None:
        scale = 1.0 / math.sqrt(dq_)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ArgumentError(f"scale must be a finite number, got {scale!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ArgumentError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if dropout_p > 0:
        if seed is None:
            raise ArgumentError(f"dropout_p={dropout_p} needs seed= (and offset=): the backward must replay the "
                                f"forward's mask from the same (seed, offset)")
        seed = _int_arg(seed, "seed", 0, _U64 - 1)
        offset = _int_arg(offset, "offset", 0, _U64 - 1)
    else:
        seed, offset = 0, 0

    if varlen:
        if max_seqlen_q is None or max_seqlen_k is None:
            # Reading the lengths back synchronises with the device; callers in a hot loop pass them.
            xp = _arrays_for(cu_qi.framework)
            if max_seqlen_q is None:
                max_seqlen_q = xp.max_len(xp.convert(cu_seqlens_q, cu_qi))
            if max_seqlen_k is None:
                max_seqlen_k = xp.max_len(xp.convert(cu_seqlens_k, cu_ki))
        seqlen_q = _int_arg(max_seqlen_q, "max_seqlen_q", 0, _I32_MAX)
        seqlen_k = _int_arg(max_seqlen_k, "max_seqlen_k", 0, _I32_MAX)
    same_cu = cu_seqlens_q is cu_seqlens_k and cu_seqlens_q is not None
    causal_mode, equivalent, left, right = _mask(causal, window, align, seqlen_q, seqlen_k, varlen, same_cu)

    p = _Problem(q, k, v, qi, ki, vi, layout, varlen, batch, heads_q, heads_k, seqlen_q, seqlen_k, rows_q, rows_k,
                 dq_, dv_, qi.dtype, device, causal_mode, equivalent, left, right, float(scale), float(dropout_p),
                 seed, offset, cu_q=cu_seqlens_q, cu_k=cu_seqlens_k, cu_qi=cu_qi, cu_ki=cu_ki)
    if bias is not None:
        bi = _describe(bias, "bias")
        if bi.dtype != qi.dtype:
            raise ArgumentError(f"bias has dtype {bi.dtype} but q has {qi.dtype}; q, k, v (and bias) must share "
                                f"one dtype")
        full = p.bias_full_shape()
        shape = tuple(bi.shape)
        padded = (1,) * (4 - len(shape)) + shape
        if not 1 <= len(shape) <= 4 or any(e not in (1, f) for e, f in zip(padded, full)):
            what = "(batch, heads_q, max_seqlen_q, max_seqlen_k)" if varlen else "(batch, heads_q, seqlen_q, seqlen_k)"
            raise ArgumentError(f"bias of shape {shape} does not broadcast to {what} = {full}")
        _same_device(infos + [("bias", bi)])
        p.bias, p.bias_info = bias, bi
    return p


def _bias_operand(xp: Any, p: _Problem, like: Any) -> tuple[Any, tuple[int, int, int]]:
    """The bias as the kernels read it: (batch, head, row) strides, unit stride over keys,
    stride 0 over broadcast dims; copied with rows padded to 8 when it cannot be read in place."""
    bi = p.bias_info
    nd = len(bi.shape)
    extents = (1,) * (4 - nd) + tuple(bi.shape)
    strides = (0,) * (4 - nd) + tuple(bi.strides)
    full = p.bias_full_shape()
    kstrides = tuple(0 if e == 1 else s for e, s in zip(extents[:3], strides[:3]))
    keys_ok = extents[3] == full[3] and (strides[3] == 1 or full[3] <= 1)
    if keys_ok and bi.ptr % 16 == 0 and all(s >= 0 and s % _BIAS_ALIGN == 0 for s in kstrides) \
            and kstrides[2] <= _I32_MAX:
        return xp.convert(p.bias, bi), kstrides
    width = _round_up(max(full[3], 1), _BIAS_ALIGN)
    shape = extents[:3] + (width,)
    buf = xp.zeros(shape, p.dtype, like)
    buf[..., :full[3]] = xp.reshape(xp.convert(p.bias, bi), extents)
    cs = _contiguous_strides(shape)
    return buf, tuple(0 if e == 1 else s for e, s in zip(extents[:3], cs[:3]))


def _named(prefix: str, row: str, strides: Sequence[int]) -> dict[str, int]:
    return {f"stride_{prefix}z": strides[0], f"stride_{prefix}h": strides[1], f"stride_{prefix}{row}": strides[2]}


def _launch(handle: Any, values: Mapping[str, Any]) -> None:
    # Arguments by name, in the order the catalog lists them.
    handle(*[values[name] for name in handle.arg_names])


# ---------------------------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------------------------

def attention(q: Any, k: Any, v: Any, *, causal: bool = False, window: tuple[int, int] | None = None,
              align: str = "top_left", bias: Any = None, dropout_p: float = 0.0, seed: int | None = None,
              offset: int = 0, scale: float | None = None, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
              max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, layout: str = "bhsd",
              out: Any = None, lse: Any = None, return_mask: bool = False, library: Any = None) -> tuple:
    """Scaled dot-product attention forward: ``softmax(q kᵀ · scale + bias, masked) v`` and its logsumexp.

    Arguments:
        q, k, v: GPU arrays of one dtype (fp16, bf16 or fp32), ``(B, H, S, D)`` for
            ``layout="bhsd"``, ``(B, S, H, D)`` for ``"bshd"``, or packed ``(total, H, D)`` with
            ``cu_seqlens_*``. k/v may have fewer heads than q (GQA/MQA: a divisor); v's head dim
            may differ from q's. Head dims 1..256.
        causal: hide keys right of the diagonal (see ``align``).
        window: ``(left, right)`` sliding window around the diagonal; -1 leaves a side unbounded.
        align: ``"top_left"`` or ``"bottom_right"``: where the diagonal lies when the query and key
            lengths differ.
        bias: additive, broadcastable to ``(B, Hq, Sq, Sk)``.
        dropout_p, seed, offset: dropout probability in [0, 1) and its Philox ``(seed, offset)``;
            the backward needs the same pair.
        scale: multiplies ``q kᵀ``; default ``1/sqrt(head_dim)``.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: variable-length batches.
        layout: ``"bhsd"`` or ``"bshd"`` (ignored for packed varlen arrays).
        out, lse: preallocated outputs (else allocated, see the module docs).
        return_mask: also return the dropout keep-mask (testing).
        library: a :class:`aotriton_rt.Library`; default :func:`aotriton_rt.default_library`.

    Returns:
        ``(out, lse)``, or ``(out, lse, mask)`` with ``return_mask``. ``out`` has q's layout and
        v's head dim; ``lse`` is fp32 ``(B, Hq, Sq)``, or ``(Hq, total_q)`` for varlen.

    Raises:
        ArgumentError: an argument is malformed (shapes, dtypes, devices, values); nothing has run.
        UnsupportedError: a combination the kernels cannot compute (message lists what they can).
        KernelNotFound: the images lack the variant this call needs (message names it).

    Example::

        out, lse = attention(q, k, v, causal=True, dropout_p=0.1, seed=1234)
    """
    # Issue #13: 1..16 query rows (decoding) run on the split-KV decode kernels when the call
    # allows it (dense, no bias/dropout/out/lse, bottom-right or no mask); None: not taken.
    from .decode import route_from_attention

    routed = route_from_attention(q, k, v, causal=causal, window=window, align=align, bias=bias,
                                  dropout_p=dropout_p, scale=scale, cu_seqlens_q=cu_seqlens_q,
                                  cu_seqlens_k=cu_seqlens_k, layout=layout, out=out, lse=lse,
                                  return_mask=return_mask, library=library)
    if routed is not None:
        return routed
    p = _prepare(q, k, v, causal=causal, window=window, align=align, bias=bias, dropout_p=dropout_p, seed=seed,
                 offset=offset, scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, layout=layout)
    if return_mask and p.dropout_p == 0:
        raise ArgumentError("return_mask=True returns the dropout mask, so it needs dropout_p > 0")
    out_i = _check_output(out, "out", p.out_shape(), p.dtype, p)
    lse_i = _check_output(lse, "lse", p.lse_shape(), "fp32", p)
    ks = _kernels_of(library)
    call = p.call(2 if return_mask else 1 if p.dropout_p else 0)
    spec, handle = ks.forward(call, p.device)
    return _forward(p, ks, handle, spec, out, out_i, lse, lse_i, return_mask)


def _check_output(obj: Any, name: str, shape: tuple[int, ...], dtype: str, p: _Problem
                  ) -> interop.ArrayInfo | None:
    if obj is None:
        return None
    info = _describe(obj, name)
    if tuple(info.shape) != tuple(shape) or info.dtype != dtype:
        raise ArgumentError(f"{name} must have shape {tuple(shape)} and dtype {dtype}, got {tuple(info.shape)} "
                            f"{info.dtype}")
    if info.readonly:
        raise ArgumentError(f"{name} is read-only; pass a writable array")
    _same_device([("q", p.qi), (name, info)])
    return info


def _working(p: _Problem) -> tuple[Any, Any, Any, Any]:
    xp = _arrays_for(p.qi.framework)
    return xp, xp.convert(p.q, p.qi), xp.convert(p.k, p.ki), xp.convert(p.v, p.vi)


def _forward(p: _Problem, ks: _Kernels, handle: Any, spec: dict, out: Any, out_i: Any, lse: Any, lse_i: Any,
             return_mask: bool) -> tuple:
    xp, q, k, v = _working(p)
    width_q, width_v = spec["HEAD_DIM"], spec["HEAD_DIM_V"]
    o = _Output(xp, p.out_shape(), p.dtype, q, p.layout, p.varlen, width_v, out, out_i)
    lse_out = _lse_output(xp, p, q, lse, lse_i)
    mask = None
    if return_mask:
        mask = xp.zeros((p.batch, p.heads_q, p.seqlen_q, p.seqlen_k), "i8", q)
    empty = p.batch == 0 or p.heads_q == 0 or p.rows_q == 0
    if empty or p.rows_k == 0 or p.seqlen_k == 0 or p.seqlen_q == 0:
        # No programs (nothing to compute) or no keys: rows that see no key are 0 with lse -inf.
        if not empty:
            o.array[...] = 0
            lse_out.array[...] = float("-inf")
        return _results(o.finish(), lse_out.finish(), mask, return_mask)
    qo = _operand(xp, q, p.qi, p.layout, p.varlen, width_q)
    ko = _operand(xp, k, p.ki, p.layout, p.varlen, width_q)
    vo = _operand(xp, v, p.vi, p.layout, p.varlen, width_v)
    values = {"Q": qo.array, "K": ko.array, "V": vo.array, "Out": o.array, "LSE": lse_out.array,
              "DropMask": mask, **_named("q", "m", qo.strides), **_named("k", "n", ko.strides),
              **_named("v", "n", vo.strides), **_named("o", "m", o.strides),
              "stride_lz": lse_out.strides[0], "stride_lh": lse_out.strides[1], **p.scalars()}
    values.update(_bias_values(xp, p, q))
    values.update(_varlen_values(xp, p))
    values.update(_named("dm", "m", _contiguous_strides(mask.shape)[:3]) if mask is not None
                  else _named("dm", "m", (0, 0, 0)))
    _launch(handle, values)
    return _results(o.finish(), lse_out.finish(), mask, return_mask)


def _results(out: Any, lse: Any, mask: Any, return_mask: bool) -> tuple:
    return (out, lse, mask) if return_mask else (out, lse)


class _LseOutput:
    """The fp32 logsumexp (or Delta) buffer and its (batch, head) strides; rows unit-strided."""

    def __init__(self, array: Any, strides: tuple[int, int], target: Any = None) -> None:
        self.array, self.strides, self.target = array, strides, target

    def finish(self) -> Any:
        if self.target is None:
            return self.array
        self.target[...] = self.array
        return self.target


def _lse_strides(p: _Problem, info: interop.ArrayInfo) -> tuple[int, int] | None:
    """Kernel strides of a caller's LSE array, or None when it must be copied."""
    if p.varlen:
        ok = info.shape[1] <= 1 or info.strides[1] == 1
        return (0, 0 if info.shape[0] <= 1 else info.strides[0]) if ok else None
    ok = info.shape[2] <= 1 or info.strides[2] == 1
    return (0 if info.shape[0] <= 1 else info.strides[0], 0 if info.shape[1] <= 1 else info.strides[1]) if ok \
        else None


def _lse_output(xp: Any, p: _Problem, like: Any, user: Any, info: Any) -> _LseOutput:
    if user is not None:
        strides = _lse_strides(p, info)
        if strides is not None and min(strides) >= 0:
            return _LseOutput(user, strides)
    shape = p.lse_shape()
    arr = xp.empty(shape, "fp32", like)
    cs = _contiguous_strides(shape)
    strides = (0, cs[0]) if p.varlen else (cs[0], cs[1])
    return _LseOutput(arr, strides, None if user is None else xp.convert(user, info))


def _bias_values(xp: Any, p: _Problem, like: Any) -> dict[str, Any]:
    if p.bias is None:
        return {"Bias": None, **_named("b", "m", (0, 0, 0))}
    arr, strides = _bias_operand(xp, p, like)
    return {"Bias": arr, **_named("b", "m", strides)}


def _varlen_values(xp: Any, p: _Problem) -> dict[str, Any]:
    if not p.varlen:
        return {"cu_seqlens_q": None, "cu_seqlens_k": None}
    return {"cu_seqlens_q": xp.convert(p.cu_q, p.cu_qi), "cu_seqlens_k": xp.convert(p.cu_k, p.cu_ki)}


def attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *, causal: bool = False,
                       window: tuple[int, int] | None = None, align: str = "top_left", bias: Any = None,
                       dropout_p: float = 0.0, seed: int | None = None, offset: int = 0, scale: float | None = None,
                       cu_seqlens_q: Any = None, cu_seqlens_k: Any = None, max_seqlen_q: int | None = None,
                       max_seqlen_k: int | None = None, layout: str = "bhsd", deterministic: bool = False,
                       scheme: str | None = None, bias_grad: bool = True, dq: Any = None, dk: Any = None,
                       dv: Any = None, library: Any = None) -> tuple:
    """Gradients of :func:`attention` with respect to q, k, v and the bias.

    Takes the forward's inputs, its ``out`` and ``lse``, the gradient ``dout`` (shaped like
    ``out``) and the same options (the same ``seed``/``offset`` replay the forward's dropout
    mask). The split scheme runs by default (bit-reproducible; ``deterministic=True`` insists on
    it); ``scheme="atomic"`` asks for the atomic-dQ scheme (dQ summed with fp32 atomics: dk, dv
    and dbias stay reproducible, dq does not), as a catalog tuning rule may. ``bias_grad=False``
    skips dbias (saves a ``(B, Hq, Sq, Sk)`` buffer). ``dq``/``dk``/``dv``: preallocated outputs.

    Returns:
        ``(dq, dk, dv, dbias)``: shaped like q, k, v (dk/dv summed over each GQA group) and like
        ``bias`` (summed over its broadcast dims); ``dbias`` is None without a bias or with
        ``bias_grad=False``.

    Raises: as :func:`attention`.

    Example::

        dq, dk, dv, dbias = attention_backward(dout, q, k, v, out, lse, bias=b, causal=True)
    """
    p = _prepare(q, k, v, causal=causal, window=window, align=align, bias=bias, dropout_p=dropout_p, seed=seed,
                 offset=offset, scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, layout=layout)
    if not isinstance(deterministic, bool):
        raise ArgumentError(f"deterministic must be True or False, got {deterministic!r}")
    _check_scheme(scheme, deterministic)
    doi = _describe(dout, "dout")
    oi = _describe(out, "out")
    li = _describe(lse, "lse")
    for name, info in (("dout", doi), ("out", oi)):
        if tuple(info.shape) != p.out_shape() or info.dtype != p.dtype:
            raise ArgumentError(f"{name} must have shape {p.out_shape()} and dtype {p.dtype} (the forward's output), "
                                f"got {tuple(info.shape)} {info.dtype}")
    if tuple(li.shape) != p.lse_shape() or li.dtype != "fp32":
        raise ArgumentError(f"lse must have shape {p.lse_shape()} and dtype fp32 (the forward's logsumexp), got "
                            f"{tuple(li.shape)} {li.dtype}")
    _same_device([("q", p.qi), ("dout", doi), ("out", oi), ("lse", li)])
    outs = [_check_output(g, n, s, p.dtype, p) for g, n, s in
            ((dq, "dq", tuple(p.qi.shape)), (dk, "dk", tuple(p.ki.shape)), (dv, "dv", tuple(p.vi.shape)))]
    ks = _kernels_of(library)
    call = p.call(1 if p.dropout_p else 0)
    want_dbias = bias is not None and bool(bias_grad)
    mode, specs, handles = ks.backward(call, p.device, deterministic, want_dbias, scheme)
    return _backward(p, specs, handles, mode, dout, doi, out, oi, lse, li, (dq, dk, dv), outs, want_dbias)


def _backward(p: _Problem, specs: dict, handles: dict, mode: str, dout: Any, doi: Any, out: Any, oi: Any,
              lse: Any, li: Any, user_grads: tuple, grad_infos: list, want_dbias: bool) -> tuple:
    xp, q, k, v = _working(p)
    width_q, width_v = specs[PRE]["HEAD_DIM"], specs[PRE]["HEAD_DIM_V"]
    g_dq = _Output(xp, tuple(p.qi.shape), p.dtype, q, p.layout, p.varlen, width_q, user_grads[0], grad_infos[0])
    g_dk = _Output(xp, tuple(p.ki.shape), p.dtype, q, p.layout, p.varlen, width_q, user_grads[1], grad_infos[1])
    g_dv = _Output(xp, tuple(p.vi.shape), p.dtype, q, p.layout, p.varlen, width_v, user_grads[2], grad_infos[2])
    dbias_buf = None
    full = p.bias_full_shape()
    if want_dbias:
        # The kernel writes the full, unbroadcast dS; rows padded to 8 keep its stride promise.
        # Under varlen the positions past each sequence are never visited: zero them.
        shape = full[:3] + (_round_up(max(full[3], 1), _BIAS_ALIGN),)
        dbias_buf = xp.zeros(shape, p.dtype, q) if p.varlen else xp.empty(shape, p.dtype, q)
    if p.batch == 0 or p.heads_q == 0 or p.rows_q == 0 or p.rows_k == 0 or p.seqlen_q == 0 or p.seqlen_k == 0:
        for g in (g_dq, g_dk, g_dv):
            g.array[...] = 0
        if dbias_buf is not None:
            dbias_buf[...] = 0
        return (g_dq.finish(), g_dk.finish(), g_dv.finish(), _reduce_dbias(xp, p, dbias_buf))
    qo = _operand(xp, q, p.qi, p.layout, p.varlen, width_q)
    ko = _operand(xp, k, p.ki, p.layout, p.varlen, width_q)
    vo = _operand(xp, v, p.vi, p.layout, p.varlen, width_v)
    doo = _operand(xp, xp.convert(dout, doi), doi, p.layout, p.varlen, width_v)
    oo = _operand(xp, xp.convert(out, oi), oi, p.layout, p.varlen, width_v)
    # Delta is written with LSE's strides (the kernels share them): both are made contiguous.
    lse_arr = xp.contiguous(xp.convert(lse, li))
    cs = _contiguous_strides(p.lse_shape())
    lse_strides = (0, cs[0]) if p.varlen else (cs[0], cs[1])
    delta = xp.empty(p.lse_shape(), "fp32", q)
    values = {"Q": qo.array, "K": ko.array, "V": vo.array, "DO": doo.array, "Out": oo.array, "LSE": lse_arr,
              "Delta": delta, "DQ": g_dq.array, "DK": g_dk.array, "DV": g_dv.array,
              **_named("q", "m", qo.strides), **_named("k", "n", ko.strides), **_named("v", "n", vo.strides),
              **_named("do", "m", doo.strides), **_named("o", "m", oo.strides), **_named("dq", "m", g_dq.strides),
              **_named("dk", "n", g_dk.strides), **_named("dv", "n", g_dv.strides),
              "stride_lz": lse_strides[0], "stride_lh": lse_strides[1], **p.scalars()}
    values.update(_bias_values(xp, p, q))
    values.update(_varlen_values(xp, p))
    if dbias_buf is not None:
        values["DBias"] = dbias_buf
        values.update(_named("db", "m", _contiguous_strides(dbias_buf.shape)[:3]))
    else:
        values["DBias"] = None
        values.update(_named("db", "m", (0, 0, 0)))
    if mode == "atomic":
        shape = tuple(p.qi.shape[:-1]) + (width_q,)
        dqacc = xp.empty(shape, "fp32", q)
        extents, strides = _bhs(shape, _contiguous_strides(shape), p.layout, p.varlen)
        values["DQacc"] = dqacc
        values.update(_named("dqa", "m", _kernel_strides(extents, strides)))
        order = (PRE, DKDV, CONVERT)
    else:
        values["DQacc"] = None
        values.update(_named("dqa", "m", (0, 0, 0)))
        order = (PRE, DKDV, DQ)
    for name in order:
        _launch(handles[name], values)
    return (g_dq.finish(), g_dk.finish(), g_dv.finish(), _reduce_dbias(xp, p, dbias_buf))


def _reduce_dbias(xp: Any, p: _Problem, buf: Any) -> Any:
    """dBias in the bias's own shape: the kernel's full dS summed over the broadcast dims."""
    if buf is None:
        return None
    bi = p.bias_info
    full = p.bias_full_shape()
    extents = (1,) * (4 - len(bi.shape)) + tuple(bi.shape)
    grad = buf[..., :full[3]]
    dims = tuple(i for i in range(4) if extents[i] == 1 and full[i] != 1)
    if dims:
        grad = xp.sum_keep(grad, dims, p.dtype)
    return xp.contiguous(xp.reshape(grad, tuple(bi.shape)))


def attention_kernels(q: Any, k: Any, v: Any, *, backward: bool = False, deterministic: bool = False,
                      scheme: str | None = None, return_mask: bool = False, bias_grad: bool = True,
                      library: Any = None, **options: Any) -> dict[str, Any]:
    """The kernel handles a call with these arguments launches, by catalog kernel name.

    Takes :func:`attention`'s arguments (and, with ``backward=True``, the backward's
    ``deterministic``/``scheme``/``bias_grad``); launches nothing. ``handle.variant(device)`` gives the
    exact variant (spec and tuning config) a launch on ``device`` uses. Benchmarks use it to
    run the Triton JIT of the same source with the same config.

    Example::

        fwd = attention_kernels(q, k, v, causal=True)["attn_fwd"]
        print(fwd.variant(0).config)
    """
    p = _prepare(q, k, v, causal=options.pop("causal", False), window=options.pop("window", None),
                 align=options.pop("align", "top_left"), bias=options.pop("bias", None),
                 dropout_p=options.pop("dropout_p", 0.0), seed=options.pop("seed", None),
                 offset=options.pop("offset", 0), scale=options.pop("scale", None),
                 cu_seqlens_q=options.pop("cu_seqlens_q", None), cu_seqlens_k=options.pop("cu_seqlens_k", None),
                 max_seqlen_q=options.pop("max_seqlen_q", None), max_seqlen_k=options.pop("max_seqlen_k", None),
                 layout=options.pop("layout", "bhsd"))
    if options:
        raise ArgumentError(f"unknown option(s) {', '.join(sorted(options))}")
    ks = _kernels_of(library)
    if not backward:
        return {FWD: ks.forward(p.call(2 if return_mask else 1 if p.dropout_p else 0), p.device)[1]}
    _check_scheme(scheme, bool(deterministic))
    return dict(ks.backward(p.call(1 if p.dropout_p else 0), p.device, bool(deterministic),
                            p.bias is not None and bool(bias_grad), scheme)[2])


def _check_scheme(scheme: Any, deterministic: bool) -> None:
    if scheme not in (None, "split", "atomic"):
        raise ArgumentError(f"scheme must be None, 'split' or 'atomic', got {scheme!r}")
    if scheme == "atomic" and deterministic:
        raise UnsupportedError("scheme='atomic' sums dq with atomics and is not deterministic; "
                               "drop deterministic=True or use scheme='split'")

