"""How a variant is chosen: a pure function of catalog entries, device facts and call facts.

Selection explains itself. When nothing matches, the error lists the candidates that were
rejected and why, so "no variant" always comes with the fix.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .catalog import Variant
from .errors import KernelNotFound


@dataclass
class Selection:
    """The outcome of a selection: matching variants (best first) and the rejections."""

    accepted: list[Variant] = field(default_factory=list)
    rejected: list[tuple[Variant, str]] = field(default_factory=list)

    def explain(self, limit: int = 8) -> str:
        lines = [f"  {_describe(v)}: {why}" for v, why in self.rejected[:limit]]
        if len(self.rejected) > limit:
            lines.append(f"  ... and {len(self.rejected) - limit} more")
        return "\n".join(lines)


def _describe(v: Variant) -> str:
    params = ", ".join(f"{k}={val}" for k, val in v.params.items())
    return f"{v.kernel}[{params}] #{v.config.index} @{v.target.arch}"


def _same(a: Any, b: Any) -> bool:
    # A bool axis may be asked for as 0/1 and vice versa; strings compare exactly.
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return a == b and (isinstance(a, float) == isinstance(b, float))


def match(variants: Iterable[Variant], kernel: str, want: Mapping[str, Any],
          archs: list[str] | None = None) -> Selection:
    """Variants of ``kernel`` whose params match ``want`` and whose arch is in ``archs``.

    ``want`` keys may name spec axes, config constexprs, ``num_warps`` or ``num_stages``.
    Accepted variants are ordered by ``archs`` preference, then by config index.
    """
    sel = Selection()
    for v in variants:
        if v.kernel != kernel:
            continue
        if archs is not None and v.target.arch not in archs:
            sel.rejected.append((v, f"built for {v.target.arch}, device needs {' or '.join(archs)}"))
            continue
        params = {**v.params, "num_warps": v.config.num_warps, "num_stages": v.config.num_stages}
        why = None
        for key, value in want.items():
            if key not in params:
                why = f"has no parameter {key!r} (it has {', '.join(params)})"
                break
            if not _same(params[key], value):
                why = f"{key}={params[key]!r}, asked {value!r}"
                break
        if why:
            sel.rejected.append((v, why))
        else:
            sel.accepted.append(v)
    # Rejections for the right arch say more than "wrong arch": list them first.
    sel.rejected.sort(key=lambda r: r[1].startswith("built for "))
    order = {a: i for i, a in enumerate(archs or [])}
    sel.accepted.sort(key=lambda v: (order.get(v.target.arch, 0), v.config.index, v.key))
    return sel


#: Targets with an image wheel of the full set, installed as an extra of the runtime package
#: (``pyproject.toml``'s ``images-<target>-full``; a test keeps the two in step).
IMAGE_WHEEL_TARGETS = ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1151", "gfx1201", "sm80", "sm90")


def remedy(kernel: str, archs: Iterable[str] | None) -> str:
    """How to get the variants of ``kernel`` a device of ``archs`` needs: the image wheel of the
    full set, or a build that adds them to an image folder."""
    archs = list(archs or [])
    wheels = [a for a in archs if a in IMAGE_WHEEL_TARGETS]
    targets = ",".join(archs) if archs else "<target>"
    build = (f"`python -m builder build --set full --kernels {kernel} --targets {targets} --add --out <image folder>`")
    if wheels:
        return f"install the full set for this GPU (`pip install 'aotriton-rt[images-{wheels[0]}-full]'`) or {build}"
    return build


def _summary(variants: list[Variant], kernel: str, want: Mapping[str, Any], archs: list[str] | None) -> str:
    """One line saying why nothing matched: an unknown parameter, no variant for the device, or
    the values the device's variants have for the first parameter that missed."""
    mine = [v for v in variants if v.kernel == kernel]
    names = sorted({k for v in mine for k in v.params} | {"num_warps", "num_stages"})
    for key in want:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return f"{kernel!r} has no parameter {key!r}{hint}; its parameters: {', '.join(names)}"
    here = [v for v in mine if archs is None or v.target.arch in archs]
    if not here:
        built = sorted({v.target.arch for v in mine})
        return (f"these images hold {kernel!r} for {', '.join(built)}, none for {' or '.join(archs or [])}; "
                + remedy(kernel, archs))
    for key, value in want.items():
        remaining = [v for v in here if key not in v.params or _same(v.params[key], value)]
        if not remaining:
            have = sorted({str(v.params[key]) for v in here if key in v.params})
            where = f" on {'/'.join(archs)}" if archs else ""
            return (f"no variant of {kernel!r} has {key}={value!r}{where} (these images have {key} "
                    f"{', '.join(have)}); " + remedy(kernel, archs))
        here = remaining
    return f"no variant of {kernel!r} matches; " + remedy(kernel, archs)


def select_one(variants: Iterable[Variant], kernel: str, want: Mapping[str, Any],
               archs: list[str] | None = None, *, known_kernels: Iterable[str] = ()) -> Variant:
    """The single best variant, or KernelNotFound with the rejection trace.

    Several matches differing only in tuning config resolve to the lowest config index (the
    kernel's default); matches that differ in a spec axis are ambiguous and refused.
    """
    variants = list(variants)
    sel = match(variants, kernel, want, archs)
    if not sel.accepted:
        if not sel.rejected:
            known = sorted(set(known_kernels) | {v.kernel for v in variants})
            raise KernelNotFound(f"no kernel named {kernel!r} in the catalog; "
                                 f"kernels: {', '.join(known) or 'none'}; " + remedy(kernel, archs))
        raise KernelNotFound(_summary(variants, kernel, want, archs))
    best = sel.accepted[0]
    rivals = [v for v in sel.accepted if v.target.arch == best.target.arch and v.spec != best.spec]
    if rivals:
        axes = sorted(k for k in best.spec if any(r.spec.get(k) != best.spec[k] for r in rivals))
        choices = {k: sorted({str(v.spec.get(k)) for v in sel.accepted}) for k in axes}
        raise KernelNotFound(f"{kernel!r} is ambiguous: also specify "
                             + "; ".join(f"{k} (one of {', '.join(c)})" for k, c in choices.items()))
    return best
