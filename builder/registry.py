"""What to build: kernel declarations and their expansion into compile jobs.

A kernel file in ``builder/kernels/`` holds a ``@triton.jit`` function and a ``KERNEL`` (or a
``KERNELS`` list) of :class:`KernelDecl` declaring its signature, specialization axes, tuning
configs (:class:`ConfigDecl`), exclusions and grid rule. ``docs/adding-a-kernel.md`` walks
through one. The ``Decl`` suffix keeps them apart from what they become: the catalog's
``Variant`` and ``Config`` (what was compiled, ``aotriton_rt.catalog``) and the runtime's
``Kernel`` (a launch handle, ``aotriton_rt.launch``).

Expansion is the cross product axes × configs × targets, minus exclusions, filtered by the build
set. Each job carries everything that determines its binary, and a ``key`` that hashes it: the
kernel's source (Triton's ``cache_key`` covers the function and the jit functions it calls), the
resolved signature, constexprs, attributes, compile options, target and Triton version.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import itertools
import json
import pkgutil
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .targets import Target

#: Build sets every kernel answers: "default" (small: quickstart, CI) and "full" (everything).
#: A kernel may declare more (e.g. "gputest"); a kernel that does not declare a set asked for
#: contributes its default set to it.
SETS = ("default", "full")
_FIELD = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True)
class ConfigDecl:
    """A declared tuning config: block-size constexprs, warps, pipeline stages, backend options.

    ``backends`` limits the config to "cuda" or "hip"; ``options`` go to ``triton.compile``
    (e.g. HIP's ``waves_per_eu``, ``matrix_instr_nonkdim``).
    """

    constexprs: Mapping[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2
    options: Mapping[str, Any] = field(default_factory=dict)
    backends: tuple[str, ...] = ("cuda", "hip")


SpecFn = Callable[[dict, Target], Any]
#: A per-spec value: ``spec -> value`` (the spec's axis values by name), e.g. divisibility that a
#: masked variant drops.
PerSpec = Callable[[Mapping[str, Any]], Any]


@dataclass(frozen=True)
class KernelDecl:
    """A kernel declaration. See the module docstring and docs/adding-a-kernel.md."""

    name: str
    fn: Any
    signature: Mapping[str, str]
    grid: tuple[str, str, str]
    axes: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    configs: Sequence[ConfigDecl] | SpecFn = (ConfigDecl(),)
    # Static, or per spec (``spec -> mapping``): what each variant's binary may assume.
    divisibility: Mapping[str, int] | PerSpec | None = None
    exclude: SpecFn | None = None
    sets: Mapping[str, SpecFn] = field(default_factory=dict)
    # Static, or per spec (``spec -> sequence of rules``): what each variant's launch checks.
    checks: Sequence[str] | PerSpec = ()
    # Catalog tuning rules for one target (``tuning[name]`` in the catalog; the builder adds
    # ``"arch"``): e.g. the decode kernels' split rule. None: no rules.
    tuning: Callable[[Target], list[dict]] | None = None
    # Which configs a build set keeps, by set name: a count keeps the first ones (#0 is what the
    # operators launch untuned), e.g. {"default": 1} leaves a target's alternates to the other
    # sets; a function of the spec and the target names the indices to keep (they keep their
    # numbers, which the tuning database's rules use).
    set_configs: Mapping[str, int | Callable[[Mapping[str, Any], Target], Sequence[int]]] = field(
        default_factory=dict)

    def __post_init__(self) -> None:
        arg_names = list(getattr(self.fn, "arg_names", []))
        if list(self.signature) != arg_names:
            raise ValueError(f"kernel {self.name}: signature names {list(self.signature)} must be "
                             f"the function's arguments in order: {arg_names}")
        for axis in self.axes:
            used = axis in self.signature or any(f"{{{axis}}}" in t for t in self.signature.values())
            if not used:
                raise ValueError(f"kernel {self.name}: axis {axis!r} is neither a constexpr "
                                 "argument nor used as {" + axis + "} in the signature")
        if "full" in self.sets:
            raise ValueError(f"kernel {self.name}: the full set is everything; it takes no predicate")

    def divisibility_for(self, spec: Mapping[str, Any]) -> Mapping[str, int] | None:
        """The divisibility ``spec``'s variants promise (None: the default, 16 on every pointer)."""
        div = self.divisibility(dict(spec)) if callable(self.divisibility) else self.divisibility
        if div is not None and not isinstance(div, Mapping):
            raise ValueError(f"kernel {self.name}: divisibility of spec {dict(spec)} must be a mapping of "
                             f"argument names to integers, got {type(div).__name__}")
        return div

    def checks_for(self, spec: Mapping[str, Any]) -> tuple[str, ...]:
        """The launch checks of ``spec``'s variants."""
        checks = self.checks(dict(spec)) if callable(self.checks) else self.checks
        if isinstance(checks, str) or not all(isinstance(c, str) for c in checks):
            raise ValueError(f"kernel {self.name}: checks of spec {dict(spec)} must be a sequence of strings, "
                             f"got {checks!r}")
        return tuple(checks)

    def configs_for(self, spec: dict, target: Target) -> list[ConfigDecl]:
        configs = self.configs(spec, target) if callable(self.configs) else self.configs
        return [c for c in configs if target.backend in c.backends]

    def grid_of(self, **values: Any) -> tuple[int, int, int]:
        """The grid rule evaluated for ``values`` (arguments and constexprs by name; extra names
        are ignored), the way the runtime evaluates it: for callers of the Triton JIT (tests,
        benchmarks), so they launch the grid the catalog promises rather than a copy of it."""
        names = tuple(sorted(values))
        return tuple(_grid_rule(self.grid, self.name, names)(*(values[n] for n in names)))


@functools.cache
def _grid_rule(grid: tuple[str, str, str], name: str, names: tuple[str, ...]) -> Callable:
    from aotriton_rt.arguments import compile_expr

    return compile_expr(f"({', '.join(grid)},)", names, {}, f"grid of {name}", allow_tuple=True)


@dataclass(frozen=True)
class Job:
    """One variant to compile: a kernel × spec × config × target, fully resolved."""

    kernel: str
    key: str
    target: Target
    spec: dict
    config_index: int
    config: ConfigDecl
    signature: dict  # name -> Triton type; "constexpr" for constexprs
    constexprs: dict
    divisibility: dict  # name -> int, for the non-constexpr args that have it
    grid: tuple[str, str, str]
    checks: tuple[str, ...] = ()
    package: str = "builder.kernels"  # where workers find the declaration again

    @property
    def label(self) -> str:
        spec = ",".join(f"{k}={v}" for k, v in self.spec.items())
        return f"{self.kernel}[{spec}]#{self.config_index}@{self.target.arch}"

    def options(self) -> dict:
        return {"num_warps": self.config.num_warps, "num_stages": self.config.num_stages,
                **dict(self.config.options)}


def load_kernels(package: str = "builder.kernels") -> dict[str, KernelDecl]:
    """Import every module of the kernels package and collect its KERNEL / KERNELS."""
    pkg = importlib.import_module(package)
    found: dict[str, KernelDecl] = {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        declared = list(getattr(module, "KERNELS", ()))
        if hasattr(module, "KERNEL"):
            declared.append(module.KERNEL)
        for k in declared:
            if k.name in found:
                raise ValueError(f"kernel name {k.name!r} is declared twice ({module.__name__})")
            found[k.name] = k
    return found


def tuning_of(kernels: Mapping[str, KernelDecl], jobs: Sequence[Job]) -> dict[str, list[dict]]:
    """The catalog ``tuning`` table for ``jobs``: each built kernel's declared rules for each
    target it is built for, tagged with the target's arch. A rule that picks a config none of
    ``jobs`` builds for that kernel and target (a set without the alternates) is left out."""
    table: dict[str, list[dict]] = {}
    built: dict[tuple[str, str], set[int]] = {}
    for job in jobs:
        built.setdefault((job.kernel, job.target.arch), set()).add(job.config_index)
    seen: set[tuple[str, str]] = set()
    for job in jobs:
        kernel = kernels.get(job.kernel)
        if kernel is None or kernel.tuning is None or (job.kernel, job.target.arch) in seen:
            continue
        seen.add((job.kernel, job.target.arch))
        configs = built[(job.kernel, job.target.arch)]
        table.setdefault(job.kernel, []).extend({"arch": job.target.arch, **rule} for rule in kernel.tuning(job.target)
                                                if rule.get("config", 0) in configs)
    return table


def _resolve_signature(kernel: KernelDecl, spec: dict) -> dict:
    def sub(t: str) -> str:
        return _FIELD.sub(lambda m: str(spec[m.group(1)]), t)
    return {name: sub(t) for name, t in kernel.signature.items()}


def expand(kernel: KernelDecl, targets: Sequence[Target], build_set: str, triton_version: str,
           source_key: str | None = None, package: str = "builder.kernels") -> list[Job]:
    """Every job of ``kernel`` for ``targets`` in ``build_set`` ("default" or "full")."""
    source_key = source_key or kernel.fn.cache_key
    axis_names = list(kernel.axes)
    defaults = _constexpr_defaults(kernel)
    jobs = []
    for target in targets:
        for values in itertools.product(*(kernel.axes[a] for a in axis_names)):
            spec = dict(zip(axis_names, values))
            if kernel.exclude and kernel.exclude(spec, target):
                continue
            in_set = kernel.sets.get(build_set, kernel.sets.get("default"))
            if build_set != "full" and in_set is not None and not in_set(spec, target):
                continue
            signature = _resolve_signature(kernel, spec)
            _check_types(kernel, signature)
            for index, config in _kept_configs(kernel, build_set, spec, target):
                constexprs = constexprs_of(signature, spec, config, defaults)
                missing = [n for n, v in constexprs.items() if v is None]
                if missing:
                    raise ValueError(f"kernel {kernel.name}: constexpr {', '.join(missing)} has no "
                                     f"value in spec {spec} or config #{index}")
                divisibility = _divisibility(kernel, signature, spec)
                job = Job(kernel.name, "", target, spec, index, config, signature, constexprs,
                          divisibility, tuple(kernel.grid), kernel.checks_for(spec), package)
                jobs.append(_with_key(job, source_key, triton_version))
    return jobs


def constexprs_of(signature: Mapping[str, str], spec: Mapping[str, Any], config: ConfigDecl,
                  defaults: Mapping[str, Any]) -> dict[str, Any]:
    """A job's constexpr values by name, in signature order: the spec's axis, else the config's
    value, else the kernel function's default (``defaults``, from :func:`_constexpr_defaults`);
    None where none of them has one."""
    return {n: spec[n] if n in spec else config.constexprs.get(n, defaults.get(n))
            for n, t in signature.items() if t == "constexpr"}


def _constexpr_defaults(kernel: KernelDecl) -> dict[str, Any]:
    """The kernel function's constexpr parameters that have a default value, by name: a config
    may leave such a parameter out (a lever named only by the configs that turn it on keeps the
    others' parameters, which the tuning database's rules check, as they were measured)."""
    import inspect

    fn = kernel.fn
    while hasattr(fn, "fn"):  # a JIT (or interpreted) function's Python function
        fn = fn.fn
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()
            if kernel.signature.get(name) == "constexpr" and p.default is not inspect.Parameter.empty}


def _kept_configs(kernel: KernelDecl, build_set: str, spec: dict, target: Target) -> list[tuple[int, ConfigDecl]]:
    """(index, config) of the configs ``build_set`` compiles for ``spec`` (``KernelDecl.set_configs``)."""
    configs = list(enumerate(kernel.configs_for(spec, target)))
    keep = kernel.set_configs.get(build_set)
    if keep is None:
        return configs
    if isinstance(keep, int):
        return configs[:keep]
    wanted = sorted(set(keep(spec, target)))
    if getattr(keep, "from_database", False):  # a database's rule may name a config the table lost
        wanted = [i for i in wanted if 0 <= i < len(configs)]
    if any(not 0 <= i < len(configs) for i in wanted):
        raise ValueError(f"kernel {kernel.name}: set {build_set!r} keeps configs {wanted} of spec {spec}, "
                         f"which has {len(configs)}")
    return [configs[i] for i in wanted]


def _check_types(kernel: KernelDecl, signature: dict) -> None:
    """Refuse, before compiling, argument types the runtime cannot pack."""
    from aotriton_rt.catalog import SCALAR_TYPES, is_pointer_type

    for name, t in signature.items():
        if t != "constexpr" and t not in SCALAR_TYPES and not is_pointer_type(t):
            raise ValueError(f"kernel {kernel.name}: argument {name} has type {t!r}, which the runtime "
                             f"cannot pass; use a pointer or one of {', '.join(SCALAR_TYPES)}")


def _divisibility(kernel: KernelDecl, signature: dict, spec: Mapping[str, Any] | None = None) -> dict:
    """The non-constexpr arguments' divisibility of ``spec``'s variants (a per-spec declaration
    needs ``spec``)."""
    if callable(kernel.divisibility) and spec is None:
        raise ValueError(f"kernel {kernel.name}: its divisibility is per spec; pass the spec")
    div = kernel.divisibility_for(spec or {})
    if div is None:
        return {n: 16 for n, t in signature.items() if t.startswith("*")}
    return {n: d for n, d in div.items() if signature.get(n, "constexpr") != "constexpr"}


def key_of(job: Job, source_key: str, triton_version: str) -> str:
    """The key of ``job`` (its own ``key`` field aside) for the kernel source ``source_key``
    (``fn.cache_key``) and Triton ``triton_version``: a Ray worker recomputes it to check that it
    has the source the build was expanded from."""
    text = json.dumps({
        "source": source_key, "kernel": job.kernel, "target": job.target.to_json(),
        "signature": job.signature, "constexprs": job.constexprs, "divisibility": job.divisibility,
        "options": job.options(), "grid": job.grid, "checks": job.checks, "triton": triton_version,
        "spec": job.spec, "config_index": job.config_index,
    }, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _with_key(job: Job, source_key: str, triton_version: str) -> Job:
    return Job(**{**job.__dict__, "key": key_of(job, source_key, triton_version)})


def known_sets(kernels: Mapping[str, KernelDecl]) -> list[str]:
    """Every build set name: the standard ones and those any kernel declares."""
    return sorted(set(SETS) | {name for k in kernels.values() for name in k.sets})


def select(kernels: Mapping[str, KernelDecl], names: str | None) -> list[KernelDecl]:
    """``--kernels add,softmax`` → those declarations; unknown names fail with the known ones."""
    if not names:
        return [kernels[n] for n in sorted(kernels)]
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in kernels]
    if unknown:
        raise ValueError(f"unknown kernel {', '.join(unknown)}; known kernels: {', '.join(sorted(kernels))}")
    return [kernels[n] for n in sorted(set(wanted))]


def shard(jobs: Sequence[Job], spec: str | None) -> list[Job]:
    """``--shard K/N``: the K-th of N deterministic slices (1-based), balanced round-robin."""
    ordered = sorted(jobs, key=lambda j: j.key)
    if not spec:
        return ordered
    m = re.fullmatch(r"(\d+)/(\d+)", spec.strip())
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ValueError(f"--shard must be K/N with 1 <= K <= N, got {spec!r}")
    k, n = int(m.group(1)), int(m.group(2))
    return ordered[k - 1::n]
