"""Loaded catalogs: :class:`Library`, the image folders a process launches from.

Example::

    import aotriton_rt
    lib = aotriton_rt.Library()                  # finds images (see aotriton_rt.images)
    add = lib.kernel("add", dtype="fp32")
    add(x, y, out, x.numel())                    # grid from the catalog's rule
    add[(blocks,)](x, y, out, x.numel())         # or an explicit grid

A Library reads the catalogs' indexes at once and a kernel's shards at its first use, selects
variants (:mod:`aotriton_rt.select`), and per device loads modules; its
:class:`~aotriton_rt.scratch.ScratchPool` owns the global scratch.
The handles it gives out (:class:`~aotriton_rt.launch.Kernel`, where the launch happens) are
cheap to create and cached; modules load lazily on the first launch on each device, once,
under a lock. Launches from many threads are safe. :meth:`Library.with_tuning` gives a view of a
library that runs the same images under other tuning rules.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from . import arch as _arch
from .arguments import Packer
from .catalog import Catalog, Variant
from .errors import DriverError
from .images import find, read_image
from .launch import DeviceState, Kernel
from .scratch import ScratchPool, check_scratch
from .select import match, select_one
from .tuning import validate_table

T = TypeVar("T")

#: Every live Library by its :attr:`Library.op_key`: the torch ops carry a library as that
#: integer (their schema takes tensors and scalars only), and code compiled by torch.compile must
#: find it without having registered it while tracing. Keys are serial numbers, never reused; the
#: registry holds no state of a library, only the way back to it, and being weak it never keeps
#: one alive.
_LIVE: weakref.WeakValueDictionary[int, Library] = weakref.WeakValueDictionary()
_OP_KEYS = itertools.count(1)  # 0 is "the default library" in the ops' schema


def live_library(key: int) -> Library | None:
    """The live :class:`Library` whose :attr:`~Library.op_key` is ``key``, or None: a custom op's
    schema can carry the library only as an integer."""
    return _LIVE.get(key)


_STATE_LOCK = threading.RLock()  # reentrant: one state's factory may ask for another


def operator_state(library: Any, key: str, factory: Callable[[Any], T]) -> T:
    """The state operator ``key`` keeps for ``library`` (caches, plans, flags), made by
    ``factory(library)`` on first use and kept on the library object itself: it lives exactly as
    long as the library, and a view of a library (:meth:`Library.with_tuning`) has its own.

    Read through the object's ``__dict__``, so that any object standing in for a library (tests
    use a few) keeps its own state, and one forwarding unknown attributes to a library never
    answers with that library's state."""
    states = vars(library).get("_operator_states")
    if states is None:
        states = vars(library).setdefault("_operator_states", {})
    state = states.get(key)
    if state is None:
        with _STATE_LOCK:
            state = states.get(key)
            if state is None:
                state = states[key] = factory(library)
    return state


class Library:
    """A loaded set of image folders: the catalog(s) and, per device, the loaded modules.

    Arguments:
        path: an image folder; by default the search of :mod:`aotriton_rt.images`.
        backend: "cuda" or "hip"; by default the first whose driver loads.

    Raises ImageFolderNotFound when no images are found and CatalogError when one is malformed.
    """

    def __init__(self, path: str | Path | None = None, *, backend: str | None = None) -> None:
        found = find(path)
        self.found = found
        # Only the catalogs' indexes are read here; a kernel's shards are read at its first use.
        self.catalogs = [Catalog.load(folder) for folder in found.folders]
        tuning: dict[str, list] = {}
        for cat in self.catalogs:
            for name, rules in (cat.tuning or {}).items():
                tuning.setdefault(name, rules)  # the first folder's table wins, like its variants
        self._tuning = tuning
        self._folder: dict[str, Path] = {}
        self._by_kernel: dict[str, tuple[Variant, ...]] = {}
        self._all: list[Variant] | None = None
        self._device_targets: Any = ...
        self._backend = backend
        backends = {b for b, _ in self.targets()}
        #: The backend arrays are checked against, known without loading a driver: the one asked
        #: for, else the only one the images are for (else "cuda"); once the driver is loaded,
        #: its backend. Launch paths read this; :attr:`backend` may load the driver to answer.
        self.backend_now = backend or (backends.pop() if len(backends) == 1 else "cuda")
        self._driver = None
        self._lock = threading.RLock()
        self._modules: dict[tuple[int, str], tuple[Any, Any]] = {}  # (device, key) -> (module, function)
        self._handles: dict[tuple, Kernel] = {}
        #: Global scratch, private to each stream and each captured graph.
        self.scratch = ScratchPool(lambda: self.driver)
        #: Each operator's state for this library, by operator (:func:`operator_state`): the
        #: attention dispatch caches and plans, the decode handles and fault flags. Made on first
        #: use, dropped with the library.
        self._operator_states: dict[str, Any] = {}
        #: This library's key in the torch ops' schema (:func:`live_library`): a serial number.
        self.op_key = next(_OP_KEYS)
        _LIVE[self.op_key] = self

    @property
    def tuning(self) -> dict[str, list]:
        """The tuning table operators choose configs, kernels and schemes by (kernel name → rules,
        :mod:`aotriton_rt.tuning`): the catalogs' (the first folder's wins a name), or a view's
        own (:meth:`with_tuning`). Read it, never change it."""
        return self._tuning

    def with_tuning(self, rules: Mapping[str, list]) -> Library:
        """A view of this library whose tuning table has ``rules`` (kernel name → rule list, as a
        catalog's ``tuning``) in place of this one's rules for those names; other names keep
        theirs. The view shares everything loaded (catalogs, the variants read, images, the
        modules loaded per device, driver, scratch); it has its own tuning table, kernel handles
        and operator state (plans, choices), so calls through it launch these images under its
        rules while calls through this library are unaffected. Views nest.

        Raises:
            CatalogError: a malformed rule (as a catalog's would be at load).

        Example::

            portable = lib.with_tuning({"attn_fwd_kernel": [{"kernel": "attn_fwd"}]})
            aotriton_rt.attention(q, k, v, library=portable)   # the portable forward everywhere
        """
        table = validate_table({**self._tuning, **rules}, "Library.with_tuning")
        return self._view(table)

    def _view(self, tuning: dict[str, list], cls: type[Library] | None = None) -> Library:
        """A view of this library (see :meth:`with_tuning`) with table ``tuning``, of class ``cls``
        (a subclass of this one's, e.g. a tool's view serving fewer variants; default: this one's):
        a copy of this object's attributes, so every loaded thing is shared, with its own
        ``tuning``, handles and operator state."""
        view = object.__new__(cls or type(self))
        # What this library sets later is the view's own to set: its driver once loaded (the
        # process's one driver per backend, whoever loads it), the list of every variant.
        vars(view).update(vars(self))
        view._tuning = tuning
        view._handles = {}
        view._operator_states = {}
        view.op_key = next(_OP_KEYS)
        _LIVE[view.op_key] = view
        return view

    def __repr__(self) -> str:
        return (f"<aotriton_rt.Library {sum(len(c.target_kernels()) for c in self.catalogs)} kernel/target "
                f"shards from {', '.join(str(f) for f in self.found.folders)}>")

    @property
    def variants(self) -> list[Variant]:
        """Every variant of every folder (the first folder wins a repeated key). Reads every
        shard: for tools such as ``info``; launches read only the kernels they use."""
        if self._all is None:
            with self._lock:
                if self._all is None:
                    self._all = self._merge(cat.variants for cat in self.catalogs)
        return self._all

    def _merge(self, groups: Any) -> list[Variant]:
        out: list[Variant] = []
        seen: set[str] = set()
        for folder, variants in zip(self.found.folders, groups):
            for v in variants:
                if v.key not in seen:
                    seen.add(v.key)
                    self._folder.setdefault(v.key, folder)
                    out.append(v)
        return out

    def variants_of(self, name: str) -> tuple[Variant, ...]:
        """The variants of kernel ``name`` on the targets this machine's GPUs can run (every
        target when that is unknown or none is built); reads only those shards."""
        hit = self._by_kernel.get(name)
        if hit is None:
            with self._lock:
                hit = self._by_kernel.get(name)
                if hit is None:
                    built = {(b, a) for cat in self.catalogs for b, a, k in cat.target_kernels() if k == name}
                    wanted = self._targets_here(built)
                    if wanted is not None and not built & wanted:
                        wanted = None  # nothing runs here: read all, so the error can list them
                    hit = self._by_kernel[name] = tuple(
                        self._merge(cat.variants_of(name, wanted) for cat in self.catalogs))
        return hit

    def _targets_here(self, built: set[tuple[str, str]]) -> set[tuple[str, str]] | None:
        """(backend, arch) pairs the visible devices run, or None (read every target)."""
        if len(built) <= 1:
            return None
        if self._device_targets is ...:
            wanted: set[tuple[str, str]] | None = None
            try:
                driver = self.driver
                wanted = set()
                for dev in range(driver.device_count()):
                    arch = _arch.normalize(driver.backend, driver.device_arch(dev))
                    wanted.update((driver.backend, a) for a in _arch.compatible(driver.backend, arch))
            except Exception:  # noqa: BLE001 - no driver or no device: every target is a candidate
                wanted = None
            self._device_targets = wanted
        return self._device_targets

    def targets(self) -> list[tuple[str, str]]:
        """(backend, arch) of every target the catalogs hold, from their indexes alone."""
        return sorted({(t.backend, t.arch) for cat in self.catalogs for t in cat.targets()})

    @property
    def kernels(self) -> list[str]:
        return sorted({k for cat in self.catalogs for k in cat.kernels})

    @property
    def driver(self):
        if self._driver is None:
            with self._lock:
                if self._driver is None:
                    from .drivers import default_driver, get_driver

                    self._driver = get_driver(self._backend) if self._backend else default_driver()
                    self.backend_now = self._driver.backend
        return self._driver

    @property
    def backend(self) -> str:
        """The backend this library launches on: the one asked for, else the default driver's
        (loading it to find out; :attr:`backend_now` answers without loading one)."""
        return self._backend or self.driver.backend

    def kernel(self, name: str, *, raw_pointers: bool = False, **params: Any) -> Kernel:
        """A launchable handle for kernel ``name`` with the given parameters.

        ``params`` select among variants by spec axes (e.g. ``dtype="fp16"``), config
        constexprs (``BLOCK=1024``), ``num_warps`` or ``num_stages``. Raises KernelNotFound
        naming what was rejected and why. ``raw_pointers=True`` accepts integer addresses.
        """
        cache_key = (name, raw_pointers, tuple(sorted(params.items())))
        handle = self._handles.get(cache_key)
        if handle is None:
            candidates = self.variants_of(name)
            sel = match(candidates, name, params)
            if not sel.accepted:
                select_one(candidates, name, params, known_kernels=self.kernels)  # raises with the explanation
            handle = Kernel(self, name, params, sel.accepted, raw_pointers)
            self._handles[cache_key] = handle
        return handle

    def load_kernel(self, handle: Kernel, dev: int) -> DeviceState:
        """The variant of ``handle`` that runs on device ``dev``, its module loaded there once and
        its launcher made: what a :class:`~aotriton_rt.launch.Kernel` asks at its first launch on
        a device. Raises KernelNotFound when no variant runs there."""
        driver = self.driver
        with self._lock:
            device_arch = _arch.normalize(driver.backend, driver.device_arch(dev))
            archs = _arch.compatible(driver.backend, device_arch)
            usable = [v for v in handle.candidates if v.target.backend == driver.backend]
            target = _arch.pick_target(driver.backend, device_arch, sorted({v.target.arch for v in usable}))
            variant = select_one(usable, handle.name, handle.params, [target] if target in archs else archs)
            check_scratch(handle.name, variant)
            packer = Packer(variant, driver.backend)
            mod_key = (dev, variant.key)
            if mod_key not in self._modules:
                raw = read_image(self._folder[variant.key], variant)
                module = driver.load_module(dev, raw)
                function = driver.get_function(dev, module, variant.symbol)
                driver.prepare_function(function, variant.shared)
                self._modules[mod_key] = (module, function)
            function = self._modules[mod_key][1]
            # Launches on one stream share its global scratch, so one may start only when the
            # previous has finished: a variant with scratch launches without PDL.
            pdl = variant.pdl and not variant.scratch["global_size"]
            launcher = driver.make_launcher(
                function, struct=packer.struct, num_threads=variant.num_threads, shared=variant.shared,
                cooperative=variant.cooperative, pdl=pdl, cluster_dims=variant.cluster_dims)
            return DeviceState(variant, packer, launcher, function, pdl)


_default: Library | None = None
_default_lock = threading.Lock()


def default_library() -> Library:
    """The process-wide Library over the default image search (created on first use)."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Library()
    return _default


def kernel(name: str, **params: Any) -> Kernel:
    """``default_library().kernel(name, **params)``."""
    return default_library().kernel(name, **params)


__all__ = ["Library", "default_library", "kernel", "DriverError"]
