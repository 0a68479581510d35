"""``python -m builder tune``: time every built config of the attention kernels on this GPU, through
the runtime, into a tuning database (:mod:`builder.tuning` owns its format and decisions).

For each kernel asked (default: ``attn_fwd`` and each arch's own forward, ``attn_fwd_sm90``, as the
family declares them, then the portable and each arch's own dK/dV and dQ kernels; any kernel that
an attention forward or backward call launches on this arch), each combination of
dtype, head dim and causal mask asked, and each sequence-length bin (powers of two), it finds the
spec the operator dispatches for that call (:func:`launched_specs`: each kernel forced, so an arch
kernel the images route elsewhere is still tuned; a dK/dV kernel once per scheme, the atomic one's
``DQ_ATOMIC=1`` spec apart) and every config the image folder holds for it on this
GPU's arch. Kernels with one config are skipped. Each config is then run *by the runtime*: the
ordinary ``aotriton_rt.attention`` / ``attention_backward`` call on a library view whose tuning
table forces that config (:func:`forced_config`, a ``Library.with_tuning`` view), so what is timed
is what a user's call launches, images, packing and launch path included — never the JIT. Before
timing, every config's result is compared with config 0's; a config that disagrees is recorded as
wrong and never chosen.

``attn_bwd`` (:data:`BACKWARD`, asked by default and by ``--quick``) measures which kernels and
scheme the backward runs: per combination and bin, every distinct *whole* backward the images
can run for the call (:func:`backward_contenders`: split or atomic scheme, the arch's own or the
portable dK/dV kernel, the arch's own or the portable dQ kernel), each through
``attention_backward`` on a view forcing it (preprocess, dK/dV, dQ or convert: the kernels share
the L2 and the choice is about their sum), each part at the config that won its bin above (every
kernel's entries are measured first), checked against the first and timed the same way. Its
entries decide the ``attn_bwd_mode``, ``attn_bwd_dkdv_kernel`` and ``attn_bwd_dq_kernel`` rules
(:func:`builder.tuning.backward_decisions`); a mode rule is never asked by a deterministic call.

Shapes: each bin ``N`` runs ``seqlen_q = seqlen_k = N`` with ``heads`` heads (default 32) and
``batch = max(1, tokens / (N * heads))`` (default tokens 2**19: B=4 at N=4096, B=16 at N=1024,
B=1 at N=16384, the issue's benchmark shapes), so every bin fills the GPU the same way; the rule
format has no batch×heads condition. Timing: :func:`builder.gputime.time_rounds` (CUDA events,
rounds in shuffled order, medians). A backward kernel's configs are compared through the whole
backward, the other kernels fixed at their own choice, which ranks the configs the same way.

    python -m builder tune --images .gpu-images --out tuning.json --quick     # estimated ~1 min on an H200
    python -m builder tune --images .gpu-images --out bwd.json --quick --kernels attn_bwd   # the backward's choice
    python -m builder tune --images .gpu-images --out builder/tuning_db/sm90.json
    python -m builder tune --images .gpu-images --out cap.json --softcap 50 --head-dims 128,256  # the capped forwards
    python -m builder tune --recompute tuning.json --tolerance 0.02 --out tuning.json   # no GPU
    python -m builder tune --merge builder/tuning_db/sm90.json bwd.json --out builder/tuning_db/sm90.json  # no GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aotriton_rt import Library
from aotriton_rt.ops.attention.family import (
    ARCH_BACKWARDS,
    ARCH_FORWARDS,
    DKDV,
    DKDV_KERNEL_RULES,
    DQ,
    DQ_KERNEL_RULES,
    KERNEL_RULES,
    MODE_RULES,
    family_of,
)

from . import tuning

#: The forward kernels an attention call may run: the portable one and each arch's own.
FORWARDS = ("attn_fwd", *dict.fromkeys(ARCH_FORWARDS.values()))
#: The dK/dV kernels a split backward may run: the portable one and each arch's own.
DKDV_KERNELS = (DKDV, *dict.fromkeys(own[DKDV] for own in ARCH_BACKWARDS.values() if DKDV in own))
#: The dQ kernels a split backward may run: the portable one and each arch's own.
DQ_KERNELS = (DQ, *dict.fromkeys(own[DQ] for own in ARCH_BACKWARDS.values() if DQ in own))
#: ``--kernels`` name of the backward's kernel and scheme choice (:func:`backward_contenders`).
BACKWARD = tuning.BACKWARD
#: The backward's schemes, in contender order (the split one, the default, first).
SCHEMES = ("split", "atomic")
#: What ``tune`` measures by default: every forward's and backward kernel's configs, then the backward.
TUNABLE = (*FORWARDS, *DKDV_KERNELS, *DQ_KERNELS, BACKWARD)
#: What ``--quick`` measures: which forward serves each bin (and its configs), the arch's own backward
#: kernels' configs, and which backward.
QUICK = (*FORWARDS, *DKDV_KERNELS[1:], *DQ_KERNELS[1:], BACKWARD)
DEFAULT_BINS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_BINS = (1024, 2048, 4096, 8192, 16384)


def forced_forward(lib: Library, kernel: str) -> Library:
    """A view of ``lib`` (:meth:`aotriton_rt.Library.with_tuning`) whose attention forwards run
    ``kernel`` (one of :data:`FORWARDS`) wherever the images hold it for the call's spec, e.g.
    ``forced_forward(lib, "attn_fwd")`` for the portable forward where the sm90 one would serve."""
    return lib.with_tuning({KERNEL_RULES: [{"kernel": kernel}]})


def forced_dkdv(lib: Library, kernel: str) -> Library:
    """A view of ``lib`` whose split attention backwards run ``kernel`` (one of :data:`DKDV_KERNELS`)
    as their dK/dV kernel wherever the images hold it for the call's spec, e.g.
    ``forced_dkdv(lib, "attn_bwd_dkdv")`` for the portable one where the sm90 one would serve."""
    return lib.with_tuning({DKDV_KERNEL_RULES: [{"kernel": kernel}]})


class WithoutVariants(Library):
    """A view of a :class:`aotriton_rt.Library` (made by :func:`without_mask_mode`; its tuning
    table is the library's) that serves none of the variants ``_hide`` is true for: calls through
    it run on what is left, as if the images lacked them. Its tuning views keep hiding them."""

    _hide: Callable[[Any], bool]

    def variants_of(self, name: str) -> tuple:
        return tuple(v for v in super().variants_of(name) if not self._hide(v))


def without_mask_mode(lib: Library, mode: int) -> Library:
    """A view of ``lib`` without the attention variants of mask mode ``mode``, e.g.
    ``without_mask_mode(lib, 2)``: bottom-right calls then run on mode 1, aligned by its
    ``causal_align`` argument, as on the default set (which compiles no mode 2)."""
    hidden = lib._hide if isinstance(lib, WithoutVariants) else None
    view = lib._view(lib.tuning, type(lib) if hidden else WithoutVariants)
    view._hide = lambda v: v.spec.get("CAUSAL") == mode or (hidden is not None and hidden(v))
    return view


def without_kernel(lib: Library, kernel: str) -> Library:
    """A view of ``lib`` that serves none of ``kernel``'s variants, e.g. ``without_kernel(lib,
    "attn_fwd_fp8_sm90")``: FP8 calls then run the portable ``attn_fwd_fp8``, which no tuning
    rule chooses over the arch's own FP8 forward."""
    hidden = lib._hide if isinstance(lib, WithoutVariants) else None
    view = lib._view(lib.tuning, type(lib) if hidden else WithoutVariants)
    view._hide = lambda v: v.kernel == kernel or (hidden is not None and hidden(v))
    return view


def forced_split(lib: Library, dkdv: str, dq: str) -> Library:
    """A view of ``lib`` whose split attention backwards run ``dkdv`` (one of :data:`DKDV_KERNELS`)
    and ``dq`` (one of :data:`DQ_KERNELS`) wherever the images hold them for the call's spec, e.g.
    ``forced_split(lib, "attn_bwd_dkdv_sm90", "attn_bwd_dq")``: the Gluon dK/dV beside the portable dQ."""
    return lib.with_tuning({DKDV_KERNEL_RULES: [{"kernel": dkdv}], DQ_KERNEL_RULES: [{"kernel": dq}]})


def config_rules(kernel: str, index: int) -> dict[str, list]:
    """The rules that send every call of ``kernel`` to config ``index`` (and, for a forward, dK/dV
    or dQ kernel, every forward or split backward to that kernel; the other backward role keeps
    the images' own routing)."""
    rules: dict[str, list] = {kernel: [{"config": index}]}
    if kernel in FORWARDS:
        rules[KERNEL_RULES] = [{"kernel": kernel}]
    if kernel in DKDV_KERNELS:
        rules[DKDV_KERNEL_RULES] = [{"kernel": kernel}]
    if kernel in DQ_KERNELS:
        rules[DQ_KERNEL_RULES] = [{"kernel": kernel}]
    return rules


def forced_config(lib: Library, kernel: str, index: int) -> Library:
    """A view of ``lib`` sending every call of ``kernel`` to config ``index`` (:func:`config_rules`)."""
    return lib.with_tuning(config_rules(kernel, index))


def backward_contenders(lib: Library, arch: str, dtype: str, head_dim: int,
                        causal: bool) -> tuple[dict[str, Any], list[tuple[int, dict, Library]]]:
    """What a :data:`BACKWARD` entry times for a call: the call's spec (the one ``attn_bwd_mode``
    rules are matched against, :func:`aotriton_rt.ops.attention.dispatch.mode_spec`) and every
    distinct whole backward the images can run for it, as ``(index, params, view)``: ``view`` a
    tuning view of ``lib`` forcing the scheme and each part's kernel, ``params`` what it then
    runs, as the operator's own explain says (``{"scheme": "split", "attn_bwd_preprocess": ...,
    "attn_bwd_dkdv": "attn_bwd_dkdv_sm90", "attn_bwd_dq": "attn_bwd_dq"}``: part -> kernel).

    Tried in this order, each forced combination kept once (a kernel the images lack for the spec,
    or a scheme they lack, falls back to what they hold, which is then a combination already
    kept): the split scheme before the atomic one, each part's arch kernel before the portable
    one. So index 0 is the untuned default wherever the images hold it, and ties keep it. The
    atomic scheme's dK/dV kernel is forced like the split one's: an arch kernel with
    ``DQ_ATOMIC=1`` is timed where the dispatcher runs one. A combination the images would run
    only zero-padded on a wider head dim than the split default's (e.g. the atomic scheme of a
    D=64 call where only D=128 has it) is left out."""
    from aotriton_rt.errors import KernelNotFound
    from aotriton_rt.ops.attention import explain

    own = ARCH_BACKWARDS.get(arch, {})
    kept: dict[tuple, tuple[dict, Library]] = {}
    spec: dict[str, Any] = {}
    for scheme in SCHEMES:
        for dkdv in dict.fromkeys((own.get(DKDV, DKDV), DKDV)):
            for dq in dict.fromkeys((own.get(DQ, DQ), DQ)) if scheme == "split" else (None,):
                rules: dict[str, list] = {MODE_RULES: [{"mode": scheme}], DKDV_KERNEL_RULES: [{"kernel": dkdv}]}
                if dq is not None:
                    rules[DQ_KERNEL_RULES] = [{"kernel": dq}]
                view = lib.with_tuning(rules)
                try:
                    ex = explain(dtype=dtype, head_dim=head_dim, seqlen_q=1024, causal=causal, backward=True,
                                 deterministic=False, arch=arch, library=view)
                except KernelNotFound:  # images without this scheme's kernels for the call
                    continue
                spec = spec or dict(ex.scheme_spec)
                dims = {(p.spec.get("HEAD_DIM"), p.spec.get("HEAD_DIM_V")) for p in ex.kernels if p.role == DKDV}
                if dims != {(spec.get("HEAD_DIM"), spec.get("HEAD_DIM_V"))}:
                    continue  # a scheme held only at a wider head dim (zero-padded): never the faster one
                ran = (ex.scheme, tuple((p.kernel, tuning._spec_key(p.spec)) for p in ex.kernels))
                # Parts by family: an aligned sibling (at these lengths) is its family's kernel to the rules.
                kept.setdefault(ran, ({"scheme": ex.scheme, **{p.role: family_of(p.kernel) for p in ex.kernels}},
                                      view))
    return spec, [(i, params, view) for i, (params, view) in enumerate(kept.values())]


def contender_name(params: dict) -> str:
    """A whole backward's params in a few words: ``split:dkdv_sm90+dq`` (the parts' kernels without
    ``attn_bwd_``; the preprocess kernel left out)."""
    parts = [str(k).removeprefix("attn_bwd_") for role, k in params.items()
             if role not in ("scheme", "attn_bwd_preprocess")]
    return f"{params.get('scheme')}:{'+'.join(parts)}"


def parse_bins(text: str) -> tuple[int, ...]:
    """``"512,1024"`` → (512, 1024); every bin a power of two >= 16, as the runtime caches choices
    per power-of-two length."""
    try:
        bins = tuple(sorted({int(b) for b in text.split(",") if b.strip()}))
    except ValueError:
        raise tuning.TuningError(f"--bins must be a comma list of integers, got {text!r}") from None
    bad = [b for b in bins if b < 16 or b & (b - 1)]
    if not bins or bad:
        raise tuning.TuningError(f"--bins must be powers of two >= 16, got {text!r}")
    return bins


def shape_of(n: int, heads: int, tokens: int) -> dict[str, int]:
    """The (batch, heads, seqlen_q, seqlen_k) a bin is measured at (see the module docs)."""
    return {"batch": max(1, tokens // (n * heads)), "heads": heads, "seqlen_q": n, "seqlen_k": n}


def configs_of(lib: Any, kernel: str, spec: dict, arch: str) -> list[tuple[int, dict]]:
    """(index, parameters) of every config the library holds for ``kernel``/``spec`` on ``arch``."""
    from aotriton_rt.select import match

    found = {}
    for v in match(lib.variants_of(kernel), kernel, spec, [arch]).accepted:
        if v.spec == spec:
            found.setdefault(v.config.index, {**v.config.constexprs, "num_warps": v.config.num_warps,
                                              "num_stages": v.config.num_stages})
    return sorted(found.items())


def _machine(arch: str, lib: Any) -> dict:
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    machine = {"gpu": props.name, "arch": arch, "sms": props.multi_processor_count,
               "torch": torch.__version__, "cuda": torch.version.cuda,
               "images_triton": sorted({c.triton_version for c in lib.catalogs})}
    try:
        import ctypes

        version = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
        machine["driver_api"] = f"{version.value // 1000}.{version.value % 1000 // 10}"
    except OSError:
        machine["driver_api"] = "unknown"
    try:
        import subprocess

        query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i",
                                str(torch.cuda.current_device())], capture_output=True, text=True, timeout=20)
        machine["driver"] = query.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        machine["driver"] = "unknown"
    return machine


def _same(a: Any, b: Any) -> bool:
    import torch

    a, b = a.float(), b.float()
    return bool(torch.isfinite(a).all()) and float((a - b).abs().max()) <= 2e-2 * max(1.0, float(b.abs().max()))


def measure(lib: Any, arch: str, kernels: Sequence[str], dtypes: Sequence[str], head_dims: Sequence[int],
            causals: Sequence[bool], bins: Sequence[int], *, heads: int = 32, tokens: int = 1 << 19,
            rounds: int = 5, seed: int = 0, flush_l2: bool = False, log=print, device: str = "cuda",
            clock: Any = None, softcap: float | None = None) -> list[tuning.Entry]:
    """Every entry of the database (GPU; see the module docs). ``device``/``clock``: where the inputs
    live and what times the calls (:class:`builder.gputime.CudaClock` by default); tests pass CPU ones.
    ``softcap``: the forwards' softcapped specs instead, every call with that cap (the backward's
    kernels and :data:`BACKWARD` are refused: their softcap specs run the portable kernels only)."""
    if softcap is not None and any(k not in FORWARDS for k in kernels):
        raise tuning.TuningError(f"softcap tunes the forwards ({', '.join(FORWARDS)}); asked also "
                                 f"{', '.join(k for k in kernels if k not in FORWARDS)}")
    views: dict[tuple[str, int, str], Library] = {}
    entries: list[tuning.Entry] = []
    timing = {"rounds": rounds, "seed": seed, "flush_l2": flush_l2, "device": device, "clock": clock,
              "softcap": softcap}
    for dtype, d, causal in itertools.product(dtypes, head_dims, causals):
        mask = "causal" if causal else "full"
        # Each kernel's configs first, so the whole backwards below run every part at its winner.
        chosen: list[tuning.Entry] = []
        launched = launched_specs(lib, arch, dtype, d, causal, softcap is not None)
        for kernel in kernels:
            if kernel == BACKWARD:
                continue
            mine = [(scheme, spec, backward) for (k, scheme), (spec, backward) in launched.items() if k == kernel]
            if not mine:
                log(f"{kernel}: not launched by {dtype} D{d} {mask} calls on {arch}")
                continue
            for scheme, spec, backward in mine:
                configs = configs_of(lib, kernel, spec, arch)
                label = f"{kernel} {dtype} D{d} {mask}" + (f" {scheme}" if scheme == "atomic" else "")
                if len(configs) < 2:
                    log(f"{label}: {len(configs)} config built, nothing to choose")
                    continue
                for index, _ in configs:
                    views.setdefault((kernel, index, scheme), lib.with_tuning(
                        {**config_rules(kernel, index), **({MODE_RULES: [{"mode": scheme}]} if backward else {})}))
                contenders = [(index, params, views[(kernel, index, scheme)]) for index, params in configs]
                for n in bins:
                    entry = _measure_bin(lib, kernel, backward, spec, contenders, dtype, d, causal,
                                         shape_of(n, heads, tokens), deterministic=scheme != "atomic", **timing,
                                         log=lambda m, where=f"{label} N{n}": log(f"  {where}: config {m}"))
                    chosen.append(entry)
                    _log_entry(log, f"{label} N{n}", entry)
        entries += chosen
        if BACKWARD in kernels:
            rules = tuning.decide(chosen, arch, "tune")
            base = lib.with_tuning({k: [{f: v for f, v in r.items() if f != "expect"} for r in rs]
                                    for k, rs in rules.items() if k not in tuning.DECISIONS}) if rules else lib
            spec, contenders = backward_contenders(base, arch, dtype, d, causal)
            label = f"{BACKWARD} {dtype} D{d} {mask}"
            if len(contenders) < 2:
                log(f"{label}: {len(contenders)} whole backward the images can run, nothing to choose")
            for n in bins if len(contenders) >= 2 else ():
                entry = _measure_bin(base, BACKWARD, True, spec, contenders, dtype, d, causal,
                                     shape_of(n, heads, tokens), deterministic=False, **timing,
                                     log=lambda m, where=f"{label} N{n}": log(f"  {where}: contender {m}"))
                entries.append(entry)
                _log_entry(log, f"{label} N{n}", entry, lambda t: f"{contender_name(t.params)} ")
    return entries


def launched_specs(lib: Library, arch: str, dtype: str, d: int, causal: bool,
                   softcap: bool = False) -> dict[tuple[str, str], tuple[dict, bool]]:
    """``(kernel family, scheme) -> (spec, backward)`` for every kernel whose configs a call of this
    dtype, head dim and mask could run on ``arch``: each forward (the portable one and the arch's
    own, each forced), the split backward's parts as the images route them and with the arch's own
    dK/dV and dQ forced (so their configs are tuned where the rules send the call elsewhere), and
    each dK/dV kernel of the atomic scheme (``DQ_ATOMIC=1``, scheme ``"atomic"``; ``"split"`` for
    the rest), where the images hold it at this head dim. ``softcap``: the forwards' softcapped
    specs only."""
    from aotriton_rt.errors import KernelNotFound
    from aotriton_rt.ops.attention import explain

    own = ARCH_BACKWARDS.get(arch, {})
    split = [lib, forced_split(lib, own.get(DKDV, DKDV), own.get(DQ, DQ))] if own else [lib]
    asks = [(False, "split", forced_forward(lib, f)) for f in FORWARDS]
    if not softcap:
        asks += ([(True, "split", v) for v in split]
                 + [(True, "atomic", lib.with_tuning({MODE_RULES: [{"mode": "atomic"}],
                                                      DKDV_KERNEL_RULES: [{"kernel": k}]})) for k in DKDV_KERNELS])
    launched: dict[tuple[str, str], tuple[dict, bool]] = {}
    for backward, scheme, view in asks:
        try:
            ex = explain(dtype=dtype, head_dim=d, seqlen_q=1024, causal=causal, backward=backward, arch=arch,
                         softcap=softcap,
                         deterministic=scheme == "split", library=view)
        except KernelNotFound:  # e.g. images without the backward: its kernels are not asked for
            continue
        if backward and ex.scheme != scheme:
            continue  # the images lack this scheme for the call
        for pick in ex.kernels:
            if scheme == "atomic" and (pick.role != DKDV or pick.spec.get("HEAD_DIM") != d):
                continue  # only the atomic dK/dV's configs differ; a wider head dim's never wins
            # An aligned sibling's configs are its family's (one config table, the family's rules).
            launched.setdefault((family_of(pick.kernel), scheme), (dict(pick.spec), backward))
    return launched


def _log_entry(log, label: str, entry: tuning.Entry, name=lambda timing: "") -> None:
    """One measured bin in a line: each contender's index, ``name`` and time, then the winner."""
    best = tuning.winner(entry.timings)
    log(f"{label} B{entry.shape['batch']}: " + "  ".join(
        f"#{t.index} {name(t)}" + (f"{t.us:.1f}us" if t.us is not None else "-") for t in entry.timings)
        + f"  -> #{best.index if best else '-'}")


def _measure_bin(lib: Any, kernel: str, backward: bool, spec: dict, contenders: list[tuple[int, dict, Any]],
                 dtype: str, d: int, causal: bool, shape: dict[str, int], *, deterministic: bool, rounds: int,
                 seed: int, flush_l2: bool, log, device: str = "cuda", clock: Any = None,
                 softcap: float | None = None) -> tuning.Entry:
    """One entry: every contender ``(index, params, view)`` (a config of ``kernel``/``spec``, or a whole
    backward) run through the operator on its view, checked against the first, then timed
    together (:func:`builder.gputime.time_rounds`)."""
    import torch

    import aotriton_rt

    from .gputime import time_rounds

    b, h, n = shape["batch"], shape["heads"], shape["seqlen_q"]
    tdtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    gen = torch.Generator(device=device).manual_seed(seed)
    # (B, N, H, D) memory seen as (B, H, N, D): the layout models hold, read in place.
    q, k, v, do = (torch.randn(b, n, h, d, device=device, dtype=tdtype, generator=gen).transpose(1, 2)
                   for _ in range(4))
    cap = {"softcap": softcap} if softcap is not None else {}
    out, lse = aotriton_rt.attention(q, k, v, causal=causal, library=lib, **cap)

    def call(view: Any) -> Any:
        if not backward:
            return aotriton_rt.attention(q, k, v, causal=causal, library=view, **cap)
        return aotriton_rt.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=deterministic,
                                              library=view)

    fns, results, notes = {}, {}, {}
    for index, _, view in contenders:
        try:
            results[index] = call(view)
            fns[str(index)] = lambda view=view: call(view)
        except Exception as exc:  # noqa: BLE001 - recorded; the contender is never chosen
            notes[index] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    if device == "cuda":
        torch.cuda.synchronize()
    first = contenders[0][0]
    for index in list(results):
        ref = results.get(first)
        pairs = [(a, r) for a, r in zip(results[index], ref or ()) if a is not None and r is not None]
        if index != first and ref is not None and not all(_same(a, r) for a, r in pairs):
            notes[index] = f"wrong result: differs from {'contender' if kernel == BACKWARD else 'config'} #{first}"
            del fns[str(index)]
    stats = time_rounds(fns, rounds=rounds, seed=seed, flush_l2=flush_l2, log=log, clock=clock)
    timings = []
    for index, params, _ in contenders:
        st = stats.get(str(index))
        timings.append(tuning.Timing(index, params, None if st is None else st.median * 1e3,
                                     None if st is None else (st.low * 1e3, st.high * 1e3),
                                     notes.get(index, "" if st is not None else "failed while timed")))
    return tuning.Entry(kernel, spec, n, shape, tuple(timings))


def _summary(db: dict) -> list[str]:
    """One line per (kernel, spec): the winner per bin."""
    rows: dict[str, list[str]] = {}
    for e in db["entries"]:
        s = e["spec"]
        key = (f"{e['kernel']:<14} {s.get('dtype')} D{s.get('HEAD_DIM')} "
               f"{'causal' if s.get('CAUSAL') else 'full':<6}")
        won = e["winner"]
        if won is not None and e["kernel"] == BACKWARD:
            won = next((f"{won}={contender_name(c['params'])}" for c in e["configs"] if c["index"] == won), won)
        rows.setdefault(key, []).append(f"{e['bin']}:#{won if won is not None else '-'}")
    return [f"{k}  {' '.join(v)}" for k, v in sorted(rows.items())]


def merged(paths: Sequence[str | Path], tolerance: float = tuning.DEFAULT_TOLERANCE) -> dict:
    """One database from ``paths`` (databases of one arch, e.g. the checked-in one, then a run that
    tuned only the backward or only the softcapped forwards): a later file's entries replace every
    entry of the (kernel, spec) pairs it measured, so no spec mixes bins of two runs, and the specs it
    did not measure keep theirs. The machine and method are the last file's; an entry measured on
    another GPU says so in its ``source`` (and so do the rules decided from it).

    Raises:
        TuningError: no file given, or files of different arches.
    """
    if not paths:
        raise tuning.TuningError("--merge needs at least one database")
    by_spec: dict[tuple, list[tuning.Entry]] = {}
    dbs = [(str(p), tuning.load(p)) for p in paths]
    arches = {db["arch"] for _, db in dbs}
    if len(arches) != 1:
        raise tuning.TuningError(f"--merge: databases of different arches ({', '.join(sorted(arches))})")
    last = dbs[-1][1]
    gpu = last.get("machine", {}).get("gpu")
    for where, db in dbs:
        other = db.get("machine", {}).get("gpu")
        note = f"python -m builder tune on {other}"[:tuning.MAX_SOURCE] if other != gpu else ""
        fresh: dict[tuple, list[tuning.Entry]] = {}
        for e in tuning.entries_of(db, where):
            if note and not e.source:
                e = dataclasses.replace(e, source=note)
            fresh.setdefault((e.kernel, tuple(sorted(e.spec.items()))), []).append(e)
        by_spec.update(fresh)
    return tuning.database([e for es in by_spec.values() for e in es], arch=arches.pop(),
                           machine=last.get("machine", {}), method=last.get("method", {}), tolerance=tolerance)


def main(args: argparse.Namespace) -> int:
    """The ``tune`` command (see :func:`add_cli`)."""
    import json
    import os

    from aotriton_rt.catalog import write_atomic

    out = Path(args.out)
    if args.recompute:
        old = tuning.load(args.recompute)
        entries = tuning.entries_of(old, args.recompute)
        db = tuning.database(entries, arch=old["arch"], machine=old.get("machine", {}), method=old.get("method", {}),
                             tolerance=args.tolerance)
    elif args.merge:
        db = merged(args.merge, args.tolerance)
    else:
        import torch

        import aotriton_rt
        from aotriton_rt.arch import target_arch

        if not torch.cuda.is_available():
            raise tuning.TuningError("tune needs a GPU (torch sees none); --recompute works without one")
        asked = args.kernels or ",".join(FORWARDS if args.softcap is not None else QUICK if args.quick else TUNABLE)
        kernels = [k.strip() for k in asked.split(",")]
        bins = parse_bins(args.bins) if args.bins else (QUICK_BINS if args.quick else DEFAULT_BINS)
        rounds = args.rounds or (3 if args.quick else 5)
        lib = aotriton_rt.Library(args.images)
        arch = target_arch(lib, torch.cuda.current_device())
        dtypes = [d.strip() for d in args.dtypes.split(",")]
        head_dims = [int(d) for d in args.head_dims.split(",")]
        causals = [bool(int(c)) for c in args.causal.split(",")]
        machine = _machine(arch, lib)
        print(f"tuning {', '.join(kernels)} on {machine['gpu']} ({arch}), images {lib.found.folders}, bins "
              f"{', '.join(map(str, bins))}, {rounds} rounds", flush=True)
        entries = measure(lib, arch, kernels, dtypes, head_dims, causals, bins, heads=args.heads,
                          tokens=args.tokens, rounds=rounds, seed=args.seed, flush_l2=args.flush_l2,
                          log=lambda m: print(m, flush=True), softcap=args.softcap)
        if not entries:
            raise tuning.TuningError(f"nothing to tune: no kernel of {', '.join(kernels)} has two configs (nor the "
                                     f"backward two kernels or schemes) built for these calls on {arch} in "
                                     f"{', '.join(map(str, lib.found.folders))}")
        method = {"rounds": rounds, "seed": args.seed, "order": "shuffle", "heads": args.heads, "tokens": args.tokens,
                  "flush_l2": args.flush_l2, "timing": "CUDA events per call, median per round, median of rounds",
                  **({"softcap": args.softcap} if args.softcap is not None else {})}
        db = tuning.database(entries, arch=arch, machine=machine, method=method, tolerance=args.tolerance)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, tuning.dumps(db))
    print("\n".join(_summary(db)))
    print(f"wrote {out}: {len(db['entries'])} entries, {sum(map(len, db['rules'].values()))} rules")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], out.name).write_bytes(tuning.dumps(db))
        Path(os.environ["OUT"], "tune-summary.json").write_text(json.dumps(_summary(db), indent=1))
    return 0


def add_cli(sub: Any) -> None:
    """Register ``tune`` on the builder's command parser."""
    from .wheels import CliHelp

    t = sub.add_parser("tune", help="time every built config on this GPU into a tuning database",
                       formatter_class=CliHelp, description=__doc__.split("\n\n")[0] + " Fold the result into "
                       "a build with `build --tuning-db FILE`, or check it in as builder/tuning_db/<arch>.json.")
    t.add_argument("--images", default=None, help="image folder built with every config of the kernels to tune "
                   "(e.g. `build --set gputest --targets sm90 --kernels attn_fwd,...`); default: the documented search")
    t.add_argument("--out", required=True, help="the tuning database to write")
    t.add_argument("--kernels", default=None, help="comma list of kernels that attention calls launch, and "
                   f"{BACKWARD} for which dK/dV and dQ kernels and scheme the backward runs (default: "
                   f"{','.join(TUNABLE)}; --quick: {','.join(QUICK)})")
    t.add_argument("--bins", default=None, help="sequence-length bins, powers of two (default "
                   f"{','.join(map(str, DEFAULT_BINS))}; --quick: {','.join(map(str, QUICK_BINS))})")
    t.add_argument("--dtypes", default="fp16,bf16")
    t.add_argument("--head-dims", default="64,128")
    t.add_argument("--causal", default="0,1", help="0 no mask, 1 causal")
    t.add_argument("--heads", type=int, default=32)
    t.add_argument("--tokens", type=int, default=1 << 19, help="batch = max(1, tokens / (N * heads)) per bin")
    t.add_argument("--rounds", type=int, default=None, help="timing rounds (default 5; --quick: 3)")
    t.add_argument("--seed", type=int, default=0, help="seeds the inputs and the contenders' shuffled order")
    t.add_argument("--tolerance", type=float, default=tuning.DEFAULT_TOLERANCE,
                   help="a config beats a lower index only when faster by more than this fraction")
    t.add_argument("--flush-l2", action="store_true", help="zero a 2x-L2 buffer before every timed call")
    t.add_argument("--softcap", type=float, default=None, metavar="CAP",
                   help=f"the forwards' softcapped specs, every call capped at CAP (with --kernels "
                   f"{','.join(FORWARDS)} only)")
    t.add_argument("--quick", action="store_true", help=f"the forward kernels, the arch's own backward kernels and "
                   f"{BACKWARD} only, 5 bins 1024..16384, 3 rounds")
    t.add_argument("--recompute", metavar="FILE", help="no GPU: decide the rules again from FILE's measurements "
                   "(e.g. with another --tolerance)")
    t.add_argument("--merge", metavar="FILE", nargs="+", help="no GPU: one database from several of one arch, each "
                   "file's entries replacing the earlier files' entries of every (kernel, spec) it measured")
    t.set_defaults(func=main)
