"""The GPU targets the builder knows, and parsing of ``--targets``.

A target is the catalog's own :class:`aotriton_rt.catalog.Target` (backend, arch as the catalog
names it, warp size): the builder compiles for exactly what the catalog will say.
"""

from __future__ import annotations

from aotriton_rt.catalog import Target


def gpu_target(target: Target):
    """The ``triton.backends.compiler.GPUTarget`` for ``target`` (imports triton)."""
    from triton.backends.compiler import GPUTarget

    if target.backend == "cuda":
        # Triton turns capability 90 into sm_90a itself (wgmma, setmaxnreg).
        return GPUTarget("cuda", int(target.arch[2:]), target.warp_size)
    return GPUTarget("hip", target.arch, target.warp_size)


def _order(target: Target) -> tuple:
    return target.backend, target.arch, target.warp_size


KNOWN: dict[str, Target] = {t.arch: t for t in (
    Target("hip", "gfx908", 64), Target("hip", "gfx90a", 64), Target("hip", "gfx942", 64),
    Target("hip", "gfx950", 64), Target("hip", "gfx1100", 32), Target("hip", "gfx1101", 32),
    Target("hip", "gfx1151", 32), Target("hip", "gfx1200", 32), Target("hip", "gfx1201", 32),
    Target("cuda", "sm80", 32), Target("cuda", "sm86", 32), Target("cuda", "sm89", 32),
    Target("cuda", "sm90", 32),
)}
#: The quickstart's and the runtime wheel's targets. gfx1151 (RDNA 3.5 APUs) is known and builds
#: every kernel (`--targets gfx1151`, its image wheels), but is not among them: its ~13% of the
#: default set's compile time would put the quickstart past its 10-minute budget on two cores
#: (docs/performance.md), and gfx1100 is the RDNA 3 target the defaults keep.
DEFAULT = ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1201", "sm80", "sm90")
#: Targets AMD lists that the pinned compiler cannot produce every kernel for: asked for by name,
#: they fail with the compiler version and what goes wrong, instead of a build that half works.
#: Each entry was measured by building the default set for it (tests/builder/test_registry.py).
BEYOND_COMPILER: dict[str, tuple[str, str]] = {
    "gfx1250": ("3.6.0", "its assembler rejects the attention backward kernels (\"amdgpu_user_sgpr_count "
                         "smaller than than implied by enabled user SGPRs\", then ld.lld finds no object); "
                         "add, softmax, the norms and attn_fwd do compile"),
}
ALIASES = {"hip": tuple(a for a in DEFAULT if a.startswith("gfx")),
           "cuda": tuple(a for a in DEFAULT if a.startswith("sm")), "default": DEFAULT}


class UnknownTarget(ValueError):
    pass


class TargetBeyondCompiler(UnknownTarget):
    """A real GPU target that the pinned Triton cannot compile the kernels for."""


def parse_targets(text: str | None) -> list[Target]:
    """``"gfx942,sm90"`` → targets; ``None`` → the defaults. Aliases: hip, cuda, default."""
    names: list[str] = []
    for item in (text or "default").split(","):
        item = item.strip().lower().replace("sm_", "sm").removesuffix("a") if item.strip().startswith(
            ("sm", "SM")) else item.strip().lower()
        if not item:
            continue
        names.extend(ALIASES.get(item, (item,)))
    beyond = [n for n in names if n in BEYOND_COMPILER]
    if beyond:
        raise TargetBeyondCompiler("; ".join(
            f"{n} cannot be built with triton {BEYOND_COMPILER[n][0]}: {BEYOND_COMPILER[n][1]}" for n in beyond)
            + " (a newer Triton may; until the builder pins one, leave it out of --targets)")
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise UnknownTarget(f"unknown target {', '.join(unknown)}; known targets: "
                            f"{', '.join(KNOWN)} (aliases: {', '.join(ALIASES)})")
    return sorted({KNOWN[n] for n in names}, key=_order)
