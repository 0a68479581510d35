"""The GPU targets the builder knows, and parsing of ``--targets``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Target:
    """A compile target. ``arch`` is the catalog name ("gfx942", "sm90")."""

    backend: str
    arch: str
    warp_size: int

    def gpu_target(self):
        """The ``triton.backends.compiler.GPUTarget`` for this target (imports triton)."""
        from triton.backends.compiler import GPUTarget

        if self.backend == "cuda":
            # Triton turns capability 90 into sm_90a itself (wgmma, setmaxnreg).
            return GPUTarget("cuda", int(self.arch[2:]), self.warp_size)
        return GPUTarget("hip", self.arch, self.warp_size)

    def to_json(self) -> dict:
        return {"backend": self.backend, "arch": self.arch, "warp_size": self.warp_size}


KNOWN: dict[str, Target] = {t.arch: t for t in (
    Target("hip", "gfx908", 64), Target("hip", "gfx90a", 64), Target("hip", "gfx942", 64),
    Target("hip", "gfx950", 64), Target("hip", "gfx1100", 32), Target("hip", "gfx1101", 32),
    Target("hip", "gfx1151", 32), Target("hip", "gfx1200", 32), Target("hip", "gfx1201", 32),
    Target("cuda", "sm80", 32), Target("cuda", "sm86", 32), Target("cuda", "sm89", 32),
    Target("cuda", "sm90", 32),
)}
DEFAULT = ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1201", "sm80", "sm90")
ALIASES = {"hip": tuple(a for a in DEFAULT if a.startswith("gfx")),
           "cuda": tuple(a for a in DEFAULT if a.startswith("sm")), "default": DEFAULT}


class UnknownTarget(ValueError):
    pass


def parse_targets(text: str | None) -> list[Target]:
    """``"gfx942,sm90"`` → targets; ``None`` → the defaults. Aliases: hip, cuda, default."""
    names: list[str] = []
    for item in (text or "default").split(","):
        item = item.strip().lower().replace("sm_", "sm").removesuffix("a") if item.strip().startswith(
            ("sm", "SM")) else item.strip().lower()
        if not item:
            continue
        names.extend(ALIASES.get(item, (item,)))
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise UnknownTarget(f"unknown target {', '.join(unknown)}; known targets: "
                            f"{', '.join(KNOWN)} (aliases: {', '.join(ALIASES)})")
    return sorted({KNOWN[n] for n in names})
