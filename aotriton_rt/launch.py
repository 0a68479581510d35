"""How a kernel is launched: :class:`Kernel`, a handle on one kernel specialization.

The first call of a handle writes its launch function (unrolled argument checks, one pack into
the variant's struct, one driver call, see :meth:`Kernel._generate`); later calls go straight
to it. A handle loads its variant on a device at the first launch there, through its
:class:`~aotriton_rt.library.Library` (:class:`KernelSource` says what a handle asks of it),
which owns the catalogs, the loaded modules and the global scratch (:mod:`aotriton_rt.scratch`:
private to each stream and each captured graph).
:meth:`Kernel.prepare` gives callers that validate a call signature once (the attention
operator's plans) a launch that skips the per-call checks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

from . import interop
from .arguments import INT_RANGES as _INT_RANGES
from .arguments import Packer, scalar_checker
from .catalog import Variant
from .errors import ArgumentError, KernelNotFound, LaunchError, shown
from .interop import MAX_STREAM as _MAX_STREAM

MAX_DEVICES = 64
_NO_DEVICE = -2  # None and raw integer pointers carry no device


def _none_pointer(obj: Any) -> tuple[int, int]:
    return 0, _NO_DEVICE


def _raw_pointer(obj: Any) -> tuple[int, int]:
    return int(obj), _NO_DEVICE


class _Missing:
    """The default of every argument of a generated launcher: the slow paths refuse it by name."""

    def __repr__(self) -> str:
        return "<required>"


_MISSING = _Missing()


class DeviceState:
    """One variant loaded on one device: its launcher, packer and scratch needs.

    ``plain``: for a PDL variant, the launcher without the PDL attribute (made on the first
    :meth:`Kernel.prepare` that asks for it, then kept); ``function``: the loaded function it
    is made from."""

    __slots__ = ("variant", "packer", "launcher", "grid_fn", "checks", "scratch_size", "function", "plain")

    def __init__(self, variant: Variant, packer: Packer, launcher: Any, function: int = 0,
                 pdl: bool | None = None) -> None:
        self.variant = variant
        self.packer = packer
        self.launcher = launcher
        self.function = function
        self.plain = None if (variant.pdl if pdl is None else pdl) else launcher
        self.grid_fn = packer.grid_fn
        self.checks = packer.run_checks if packer.checks else None
        self.scratch_size = variant.scratch["global_size"] * variant.num_ctas

    def plain_launcher(self, driver: Any) -> Any:
        """The launcher of a PDL variant without the PDL attribute (``Kernel.prepare(pdl=False)``),
        made by ``driver`` once and then kept."""
        with _PLAIN_LOCK:
            if self.plain is None:
                v = self.variant
                self.plain = driver.make_launcher(
                    self.function, struct=self.packer.struct, num_threads=v.num_threads, shared=v.shared,
                    cooperative=v.cooperative, pdl=False, cluster_dims=v.cluster_dims)
            return self.plain


_PLAIN_LOCK = threading.Lock()


class KernelSource(Protocol):
    """What a :class:`Kernel` asks of the :class:`~aotriton_rt.library.Library` that made it."""

    #: The backend arrays are checked against, known without loading a driver.
    backend_now: str
    #: Global scratch per stream and captured graph (:class:`aotriton_rt.scratch.ScratchPool`).
    scratch: Any

    @property
    def backend(self) -> str: ...

    @property
    def driver(self) -> Any: ...

    def load_kernel(self, kernel: Kernel, device: int) -> DeviceState:
        """``kernel``'s variant for ``device``, its module loaded there (once per variant)."""
        ...


class Kernel:
    """A handle on one kernel specialization; launches on whatever device its tensors are on.

    Call it as ``k(*args, stream=None)`` to use the catalog's grid rule, or
    ``k[grid](*args, stream=None)`` with ``grid`` a tuple of 1–3 ints or a callable taking the
    variant's compile-time parameters. ``stream`` defaults to the current stream of the
    framework of the first tensor argument (torch, CuPy), else the legacy default stream.
    """

    def __init__(self, library: KernelSource, name: str, params: dict[str, Any], candidates: list[Variant],
                 raw_pointers: bool) -> None:
        self.library = library
        self.name = name
        self.params = params
        self.candidates = candidates
        first = candidates[0]
        for v in candidates[1:]:
            if [(a.name, a.type, a.divisibility) for a in v.args] != \
                    [(a.name, a.type, a.divisibility) for a in first.args]:
                raise KernelNotFound(f"{name}: variants {first.key[:16]} and {v.key[:16]} have different "
                                     "argument lists; specify more parameters")
        self.arg_names = [a.name for a in first.args]
        self._states: list[DeviceState | None] = [None] * MAX_DEVICES
        self._raw = raw_pointers

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"<aotriton_rt.Kernel {self.name}({params}) args=({', '.join(self.arg_names)})>"

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return partial(self.__call__, grid=grid)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        # The first call writes this handle's launch function and makes it the handle's
        # __call__ (through a per-handle subclass); later calls go straight to it.
        fn = self._generate(self.candidates[0])
        self.__class__ = type(f"Kernel_{self.name}", (Kernel,), {"__call__": fn, "__slots__": ()})
        return fn(self, *args, **kwargs)

    def variant(self, device: int = 0) -> Variant:
        """The variant this handle launches on ``device`` (loading it if needed)."""
        return self._state(device).variant

    # -- code generation -------------------------------------------------------------------
    def _generate(self, first: Variant) -> Callable[..., None]:
        """Write the launch function of this signature: unrolled checks, one pack, one call.

        Exact torch tensors take an inlined path (``data_ptr()``/``get_device()``); other
        arrays go through interop's per-type handlers. Everything that does not change
        between calls is folded in as a constant. No text of the catalog enters the source:
        arguments are the placeholders ``a0, a1, ...`` (renamed to the catalog's validated
        names only in the code object, for error messages and keyword calls), their names
        reach the error helpers as values, and numbers are re-printed by us.
        """
        import sys

        names = self.arg_names
        torch = sys.modules.get("torch")
        tensor = getattr(torch, "Tensor", None) if torch is not None else None
        torch_backend = "hip" if tensor is not None and getattr(torch.version, "hip", None) else "cuda"
        inline_torch = tensor is not None and torch_backend == self.library.backend_now
        env: dict[str, Any] = {
            "_T": tensor if inline_torch else type("_NoTorch", (), {}),
            "_ptr": self._pointer, "_state": self._state, "_states": self._states, "_n": MAX_DEVICES,
            "_wrong": _wrong_device, "_misaligned": _misaligned, "_indivisible": _indivisible,
            "_grid": _normalize_grid, "_stream": self._default_stream, "_scratch": self._scratch,
            "_nodev": self._no_device, "_extra": self._extra_args, "_stream_arg": _stream_value,
        }
        # A call that does not fit the signature reaches a slow path, never Python's TypeError:
        # a missing argument is _MISSING (refused where its pointer or scalar is read), an
        # unknown keyword lands in **kw (an empty dict per call, ~25 ns).
        env["_M"] = _MISSING
        if inline_torch:
            env["_ts"] = interop.stream_getter("torch")
        slot = {a.name: f"a{i}" for i, a in enumerate(first.args)}
        for i, a in enumerate(first.args):
            env[f"_nm{i}"] = a.name
        label = {a.name: f"_nm{i}" for i, a in enumerate(first.args)}
        params = "".join(f"{slot[n]}=_M, " for n in names)
        lines = [f"def __call__(self, {params}*extra, stream=None, grid=None, **kw):",
                 "    if extra or kw: _extra(extra, kw)"]
        ptrs = [a for a in first.args if a.is_pointer]
        for i, a in enumerate(ptrs):
            x, nm = slot[a.name], label[a.name]
            lines += [f"    if type({x}) is _T:",
                      f"        d{i} = {x}.get_device()",
                      f"        p{i} = {x}.data_ptr() if d{i} >= 0 else _ptr({x}, {nm}, stream)[0]",
                      "    else:",
                      f"        p{i}, d{i} = _ptr({x}, {nm}, stream)"]
        if ptrs:
            lines.append("    dev = d0 if d0 >= 0 else max(" + ", ".join(f"d{i}" for i in range(len(ptrs)))
                         + ", -2)" if len(ptrs) > 1 else "    dev = d0")
            lines.append("    if dev < 0: dev = _nodev()")
            for i, a in enumerate(ptrs[1:], start=1):
                # Negative: no device known (None, raw address, CAI without a resolver).
                lines.append(f"    if d{i} != dev and d{i} >= 0: _wrong({label[a.name]}, d{i}, dev)")
            for i, a in enumerate(ptrs):
                if a.divisibility > 1:
                    div = int(a.divisibility)
                    lines.append(f"    if p{i} % {div}: _misaligned({label[a.name]}, p{i}, {div})")
        else:
            lines.append("    dev = _nodev()")
        values = []
        k = 0
        for i, a in enumerate(first.args):
            if a.is_pointer:
                values.append(f"p{k}")
                k += 1
                continue
            x = slot[a.name]
            env[f"_c{i}"] = self._scalar_checker(a)
            if a.type in _INT_RANGES:
                lo, hi = _INT_RANGES[a.type]
                lines.append(f"    if type({x}) is not int or not {lo} <= {x} <= {hi}: {x} = _c{i}({x})")
            else:
                lines.append(f"    if type({x}) is not float: {x} = _c{i}({x})")
            if a.divisibility > 1:
                div = int(a.divisibility)
                lines.append(f"    if {x} % {div}: _indivisible({label[a.name]}, {x}, {div})")
            values.append(x)
        no_scratch = all(not v.scratch["global_size"] for v in self.candidates)
        no_checks = all(not v.checks for v in self.candidates)
        first_arg = slot[names[0]] if ptrs else "None"
        lines += [
            "    st = _states[dev] if 0 <= dev < _n else None",
            "    if st is None: st = _state(dev)",
            f"    vals = ({', '.join(values)},)",
        ]
        if not no_checks:
            lines.append("    if st.checks is not None: st.checks(vals)")
        lines += [
            "    if grid is None: gx, gy, gz = st.grid_fn(*vals)",
            "    else: gx, gy, gz = _grid(grid, st)",
            "    if stream is None:",
            f"        stream = _ts(dev) if type({first_arg}) is _T else _stream({first_arg}, dev)"
            if inline_torch and ptrs else f"        stream = _stream({first_arg}, dev)",
            f"    elif type(stream) is not int or not 0 <= stream <= {_MAX_STREAM}: stream = _stream_arg(stream)",
        ]
        if no_scratch:
            lines.append("    st.launcher(gx, gy, gz, stream, vals + (0, 0))")
        else:
            lines += [
                "    if not st.scratch_size: st.launcher(gx, gy, gz, stream, vals + (0, 0))",
                "    elif gx * gy * gz: _scratch(st, st.launcher, dev, gx, gy, gz, stream, vals)",
            ]
        code = compile("\n".join(lines), "<aotriton_rt launch>", "exec")
        exec(code, env)  # noqa: S102 - our own tokens only (see the docstring)
        fn = env["__call__"]
        # Error messages ("missing argument 'n'") and keyword calls use the catalog's names,
        # which the catalog validated as plain identifiers; renaming touches no executed text.
        varnames = list(fn.__code__.co_varnames)
        varnames[1:1 + len(names)] = names
        fn.__code__ = fn.__code__.replace(co_varnames=tuple(varnames))
        return fn

    def _extra_args(self, extra: tuple, kw: dict) -> None:
        if kw:
            raise ArgumentError(f"{self.name} got an unknown keyword argument {shown(next(iter(kw)))}; it takes "
                                f"{', '.join(self.arg_names)} (by position or name) and stream=, grid= by keyword")
        raise ArgumentError(f"{self.name} takes {len(self.arg_names)} arguments "
                            f"({', '.join(self.arg_names)}) but was given {len(self.arg_names) + len(extra)} "
                            "positionally; pass stream= and grid= by keyword")

    def _missing(self, name: str) -> None:
        raise ArgumentError(f"{self.name} takes {len(self.arg_names)} arguments ({', '.join(self.arg_names)}) "
                            f"but {name} was not given")

    def _scalar_checker(self, arg: Any) -> Callable[[Any], Any]:
        """The generated launcher's slow path for a scalar: scalar_checker, and a missing value refused."""
        check = scalar_checker(arg)

        def slow(value: Any) -> Any:
            if value is _MISSING:
                self._missing(arg.name)
            return check(value)
        return slow

    # -- prepared launches (operator plans) -----------------------------------------------------
    def prepare(self, device: int, values: Sequence[Any], *, pdl: bool = True) -> Callable[[int, tuple], None] | None:
        """A launch function for calls on ``device`` that differ from ``values`` only in pointers.

        For callers that validate a call signature once and launch it many times (the attention
        operator's plans): the scalars in ``values`` are converted and range-checked, their
        divisibility and the variant's checks verified and the grid computed here, once. The
        returned ``launch(stream, values)`` takes the same argument tuple with integer addresses
        in the pointer slots, which the caller has checked (on ``device``, 16-byte aligned), and
        skips every per-call check. Returns None when the variant promises more than 16-byte
        pointer alignment (the caller then calls the handle as usual).

        ``pdl=False`` launches a variant compiled for programmatic dependent launch (the
        catalog's ``launch.pdl``) without it: the stream then orders it after its predecessor
        as any launch (its in-kernel wait returns at once). The launcher without the attribute
        is made once per device and kept; the decision costs nothing per launch. Variants
        without PDL launch the same either way.

        Raises ArgumentError as a call with these scalars would; loads the module on ``device``.
        """
        st = self._state(device)
        vals = list(values)
        for i, a in enumerate(st.variant.args):
            if a.is_pointer:
                if a.divisibility > 16:
                    return None
                vals[i] = 0
                continue
            vals[i] = scalar_checker(a)(vals[i])
            if a.divisibility > 1 and vals[i] % a.divisibility:
                _indivisible(a.name, vals[i], a.divisibility)
        vals = tuple(vals)
        if st.checks is not None:
            st.checks(vals)
        gx, gy, gz = st.grid_fn(*vals)
        launcher = st.launcher if pdl else st.plain or st.plain_launcher(self.library.driver)
        if not st.scratch_size:
            hidden = (0, 0)

            def launch(stream: int, args: tuple) -> None:
                launcher(gx, gy, gz, stream, args + hidden)
        elif not gx * gy * gz:
            def launch(stream: int, args: tuple) -> None:
                return None
        else:
            run, nbytes = self.library.scratch.launch, gx * gy * gz * st.scratch_size

            def launch(stream: int, args: tuple) -> None:
                run(device, stream, nbytes, launcher, gx, gy, gz, args)
        return launch

    # -- slow paths ----------------------------------------------------------------------------
    def _pointer(self, obj: Any, name: str, stream: int | None) -> tuple[int, int]:
        handler = interop.pointer_reader(type(obj))
        if handler is not None:
            try:
                return handler(obj, self.library.backend_now, stream)
            except ArgumentError as e:
                raise ArgumentError(f"argument {name}: {e}") from None
        if obj is None:
            return _none_pointer(obj)
        if obj is _MISSING:
            self._missing(name)
        if isinstance(obj, int) and not isinstance(obj, bool):
            if not self._raw:
                raise ArgumentError(f"argument {name} is a plain integer {obj:#x}; raw addresses are "
                                    f"accepted only from lib.kernel({self.name!r}, raw_pointers=True)")
            return _raw_pointer(obj)
        try:
            return interop.pointer(obj, backend=self.library.backend, stream=stream)
        except ArgumentError as e:
            raise ArgumentError(f"argument {name}: {e}") from None

    def _no_device(self) -> int:
        return self.library.driver.current_device()

    def _default_stream(self, obj: Any, dev: int) -> int:
        getter = _STREAM_OF.get(type(obj))
        if getter is None:
            getter = _stream_getter(obj)
        try:
            return getter(obj, dev, self.library.backend_now)
        except ArgumentError as e:  # a producer's stream the protocol does not allow
            raise ArgumentError(f"argument {self.arg_names[0]}: {e}") from None

    def _state(self, dev: int) -> DeviceState:
        if not 0 <= dev < MAX_DEVICES:
            raise LaunchError(f"device index {dev} is out of range (0..{MAX_DEVICES - 1})")
        state = self._states[dev]
        if state is None:
            state = self.library.load_kernel(self, dev)
            self._states[dev] = state
        return state

    def _scratch(self, st: DeviceState, launcher: Any, dev: int, gx: int, gy: int, gz: int, stream: int,
                 vals: tuple) -> None:
        """Launch with global scratch private to ``stream`` (:mod:`aotriton_rt.scratch`)."""
        self.library.scratch.launch(dev, stream, gx * gy * gz * st.scratch_size, launcher, gx, gy, gz, vals)


_STREAM_OF: dict[type, Callable[[Any, int, str], int]] = {}


def _stream_getter(obj: Any) -> Callable[[Any, int, str], int]:
    """How to find the default stream for arguments of ``type(obj)``, decided once per type;
    the getter is called as ``getter(obj, device, backend)``.

    torch and CuPy: their current stream on the device. Other ``__cuda_array_interface__`` v3
    producers: the stream they name, checked and mapped to the backend's handle by
    :func:`interop.cai_launch_stream` (None: the default stream; 1 and 2: the legacy and
    per-thread default streams; 0, negatives, 2**64 and up, non-integers: ArgumentError).
    Everything else (JAX and other DLPack producers, raw pointers), and arrays of a type whose
    interface refuses their dtype (JAX's bf16 arrays): the legacy default stream, which is also
    the stream DLPack producers were told the data is consumed on.
    """
    module = type(obj).__module__.partition(".")[0]
    if module in ("torch", "cupy"):
        fw = module
        getter = lambda o, dev, backend: interop.current_stream(fw, dev)
    elif hasattr(type(obj), "__cuda_array_interface__"):
        check = interop.cai_launch_stream

        def getter(o: Any, dev: int, backend: str) -> int:
            try:
                s = o.__cuda_array_interface__.get("stream")
            except AttributeError:  # a type that has the interface for some dtypes only (JAX: not
                return 0  # bf16): such arrays go through DLPack, consumed on the default stream
            # A handle (> 2) in range is the common case; the rest is checked and mapped.
            return s if type(s) is int and 2 < s <= _MAX_STREAM else check(o, backend)
    else:
        getter = lambda o, dev, backend: 0
    _STREAM_OF[type(obj)] = getter
    return getter


def _wrong_device(name: str, got: int, want: int) -> None:
    raise ArgumentError(f"argument {name} is on device {got} but the other arguments are on device "
                        f"{want}; move it to device {want}")


def _misaligned(name: str, ptr: int, align: int) -> None:
    raise ArgumentError(f"argument {name} address {ptr:#x} is not {align}-byte aligned, which this "
                        f"kernel was compiled to assume; pass a tensor whose data starts on a "
                        f"{align}-byte boundary (e.g. .clone() a sliced view)")


def _indivisible(name: str, value: int, divisor: int) -> None:
    raise ArgumentError(f"argument {name} = {value} is not a multiple of {divisor}, which this kernel was "
                        f"compiled to assume; choose a variant compiled without that assumption")


def _normalize_grid(grid: Any, st: DeviceState) -> tuple[int, int, int]:
    if callable(grid):
        grid = grid(st.variant.params)
    if isinstance(grid, int):
        grid = (grid,)
    if not isinstance(grid, (tuple, list)) or not 1 <= len(grid) <= 3:
        raise ArgumentError(f"grid must be 1 to 3 integers, got {grid!r}"[:300])
    g = [*grid, 1, 1][:3]
    for i, (value, limit) in enumerate(zip(g, st.packer.grid_limits)):
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise ArgumentError(f"grid[{i}] = {value!r} must be an integer in [0, {limit}]"[:300])
        g[i] = value = value.__index__()
        if not 0 <= value <= limit:
            raise ArgumentError(f"grid[{i}] = {value} must be an integer in [0, {limit}] "
                                f"on {st.variant.target.backend} with {st.variant.num_threads} threads per block")
    return g[0], g[1], g[2]


def _stream_value(stream: Any) -> int:
    """The raw handle of a ``stream=`` that is not a plain in-range int, or ArgumentError.

    Accepts a framework stream object: torch (``cuda_stream``), CuPy (``ptr``), or an object with
    the CUDA stream protocol ``__cuda_stream__`` (returns ``(version, handle)``).
    """
    value = stream
    if not isinstance(stream, int) or isinstance(stream, bool):
        if isinstance(stream, (str, bytes, float, bool)) or stream is None:
            value = None
        elif hasattr(stream, "__cuda_stream__"):
            try:
                value = stream.__cuda_stream__()[1]
            except Exception:  # noqa: BLE001 - a broken protocol answer is refused below
                value = None
        else:
            value = getattr(stream, "cuda_stream", getattr(stream, "ptr", None))
        if isinstance(value, bool) or not isinstance(value, int):
            raise ArgumentError(f"stream must be a raw stream handle (an int in [0, 2**64)) or a torch/CuPy "
                                f"stream object, got {type(stream).__name__} {stream!r}"[:300])
    if not 0 <= value <= _MAX_STREAM:
        raise ArgumentError(f"stream {value} is not a stream handle: it must be in [0, 2**64)")
    return int(value)
