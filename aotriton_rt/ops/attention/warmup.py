"""Ready an attention call's kernels ahead of its first call: :func:`warmup`.

The first call of a kind pays for more than its launch: the catalog shards of the kernels that
may serve it are read and checked, the kernels are chosen, and each chosen image is read,
verified, decompressed and loaded as a module on the device (tens of milliseconds in all; see
``docs/performance.md``, "Host cost per call and the first call"). :func:`warmup` does all of
that for the calls it is told of, on the calling thread or on a background one, so that a
service's first request or a job's first step finds everything loaded. It launches nothing and
allocates nothing on the device.

What it readies is shared through the library: the dispatch's choices, the handles and the
loaded modules, each made once under the library's locks, so a call that arrives while a
background warm-up is still running waits for (or makes) the same objects, never a second copy.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from ...errors import ArgumentError
from .dispatch import kernels_of
from .explain import call_of, sinks_choice
from .family import SINKS_ARG

__all__ = ["warmup"]


def warmup(*, dtype: str = "bf16", head_dim: int = 128, seqlen: int = 1024, seqlen_k: int | None = None,
           head_dim_v: int | None = None, causal: bool = False, align: str = "top_left", varlen: bool = False,
           softcap: bool = False, alibi: bool = False, sinks: bool = False, backward: bool = False,
           deterministic: bool = False,
           device: int = 0, library: Any = None, background: bool = False) -> list[str] | Future:
    """Load now what an attention call with these facts will launch on ``device``.

    Arguments:
        dtype, head_dim, head_dim_v, causal, align, varlen: the call's facts, as for
            :func:`aotriton_rt.attention` (head dims the images do not compile warm the bucket
            the call would run on).
        softcap, alibi: the call passes a logit ``softcap`` / ``alibi_slopes`` (their variants).
        sinks: the call passes ``sinks`` (their kernels after the forward and the backward too).
        seqlen, seqlen_k: the lengths the call will see (``seqlen_k`` defaults to ``seqlen``):
            tuning rules choose kernels and configs by length range, so give a typical one.
        backward, deterministic: also ready the backward's kernels (the training step's).
        device: the device index to load on.
        library: a :class:`aotriton_rt.Library`; default :func:`aotriton_rt.default_library`.
        background: return at once with a :class:`concurrent.futures.Future` of the result,
            the work running on a daemon thread (its exception, if any, is the future's).

    Returns:
        one line per kernel readied, ``"<kernel>[<spec>] config #<i> on device <d>"``, in launch
        order (the forward's, then the backward's); or a Future of that list.

    Raises:
        ArgumentError: a malformed fact. KernelNotFound: the images lack a kernel the call needs
            (as the call itself would). NoDevice, DriverError: no usable device.

    Example::

        pending = aotriton_rt.warmup(dtype="bf16", head_dim=128, seqlen=4096, causal=True,
                                     backward=True, background=True)
        model = load_model()          # meanwhile
        pending.result()              # optional: surfaces a failure early
    """
    if not isinstance(background, bool):
        raise ArgumentError(f"background must be True or False, got {background!r}")
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ArgumentError(f"device must be a device index >= 0, got {device!r}")
    call = call_of(dtype=dtype, head_dim=head_dim, seqlen_q=seqlen, seqlen_k=seqlen_k, head_dim_v=head_dim_v,
                   causal=causal, align=align, varlen=varlen, softcap=softcap, alibi=alibi)
    if not isinstance(sinks, bool):
        raise ArgumentError(f"sinks must be True or False (whether the call passes it), got {sinks!r}")
    if not isinstance(backward, bool) or not isinstance(deterministic, bool):
        raise ArgumentError(f"backward and deterministic must be True or False, got {backward!r}, {deterministic!r}")

    def run() -> list[str]:
        ks = kernels_of(library)
        _, handle = ks.forward(call, device)
        handles = [handle]
        if backward:
            handles += list(ks.backward(call, device, deterministic, False)[2].values())
        if sinks:
            # A forward that takes the sinks joins them itself; older ones have the epilogue after them.
            after = (False, True)[SINKS_ARG in handle.arg_names:1 + backward]
            handles += [ks.handle(sinks_choice(call, bwd), call) for bwd in after]
        return [_ready(h, device) for h in handles]

    if not background:
        return run()
    future: Future = Future()

    def work() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(run())
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(e)

    threading.Thread(target=work, name="aotriton_rt-warmup", daemon=True).start()
    return future


def _ready(handle: Any, device: int) -> str:
    variant = handle.variant(device)  # loads the module (once per library and device)
    spec = ", ".join(f"{k}={v}" for k, v in variant.spec.items())
    return f"{variant.kernel}[{spec}] config #{variant.config.index} on device {device}"
