"""Context-parallel (ring) attention over ``torch.distributed``, built on the attention operator.

The sequence is split across the ranks of a process group: rank ``r`` holds the ``r``-th
contiguous chunk of q, k and v (``(B, H, S/W, D)``, layout ``bhsd``). The key/value chunks travel
around the ring (rank ``r`` sends to ``r + 1`` and receives from ``r - 1``), so after ``W`` steps
every query chunk has seen every key chunk. Each step runs the attention forward on one (query
chunk, key chunk) pair and merges the partial result into the running one through the
log-sum-exp that the forward returns (:func:`merge`). With ``causal=True`` (queries and keys
aligned, the usual decoder mask over the whole sequence) a rank's own chunk is attended
causally, the chunks of earlier ranks fully, and those of later ranks are skipped.

The backward runs the same ring: each pair's gradients come from the attention backward given
the *merged* output and log-sum-exp (so each pair's probabilities are the global ones); dq
accumulates where the query chunk lives, and dk/dv accumulators travel with their key chunk
and come home after a full turn.

Importing this module imports torch (like :mod:`aotriton_rt.ops.torch`). Example, one process
per GPU under ``torchrun``::

    from aotriton_rt.ops.ring import ring_attention
    out = ring_attention(q_local, k_local, v_local, causal=True)   # differentiable
    out.float().pow(2).sum().backward()

The communication is pluggable (:class:`Ring`): :class:`DistributedRing` sends with
``torch.distributed`` point-to-point operations (NCCL, or gloo for CPU tensors), and
:class:`LocalRing` simulates the ranks with threads of one process (tests, one GPU). The
block kernels are pluggable too (``attend``/``attend_backward``): by default the attention
operator's forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from ..errors import ArgumentError

__all__ = ["DistributedRing", "LocalRing", "Ring", "aotriton_blocks", "merge", "ring_attention", "ring_backward",
           "ring_forward", "run_local"]

#: ``attend(q, k, v, causal, scale) -> (out, lse)``: one block's forward; lse fp32 natural log.
Attend = Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]
#: ``attend_backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``.
AttendBackward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool, float],
                          tuple[Tensor, Tensor, Tensor]]


# ---------------------------------------------------------------------------------------------
# The merge
# ---------------------------------------------------------------------------------------------

def merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two partial attention results over disjoint key sets into the result over both.

    ``out_*`` are ``(..., S, D)`` softmax-weighted sums over each key set and ``lse_*`` the
    ``(..., S)`` natural-log log-sum-exp of the scaled scores; the result is
    ``lse = log(exp(lse_a) + exp(lse_b))`` and ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``.
    A row with no visible key in one part (``lse = -inf``) takes the other part as is; a row
    empty in both keeps ``lse = -inf`` and ``out = 0`` (never NaN). Computed in fp32 (fp64 for
    fp64 inputs) and returned in that precision.

    Example::

        out, lse = merge(out_a, lse_a, out_b, lse_b)
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ArgumentError(f"merge: out shapes {tuple(out_a.shape)}, {tuple(out_b.shape)} and lse shapes "
                            f"{tuple(lse_a.shape)}, {tuple(lse_b.shape)} do not match: out must be "
                            "(..., S, D) and lse (..., S), the same for both parts")
    wide = torch.float64 if torch.float64 in (out_a.dtype, lse_a.dtype) else torch.float32
    lse_a, lse_b = lse_a.to(wide), lse_b.to(wide)
    lse = torch.logaddexp(lse_a, lse_b)  # -inf with -inf gives -inf
    # Rows empty in both parts: subtract 0 instead of -inf, so the weights are exp(-inf) = 0.
    finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - finite).unsqueeze(-1)
    w_b = torch.exp(lse_b - finite).unsqueeze(-1)
    return w_a * out_a.to(wide) + w_b * out_b.to(wide), lse


# ---------------------------------------------------------------------------------------------
# Communication
# ---------------------------------------------------------------------------------------------

class Pending(Protocol):
    """A shift in flight: ``wait()`` returns the tensors received from the previous rank."""

    def wait(self) -> list[Tensor]: ...


class Ring(Protocol):
    """A ring of ``world`` ranks; this one is ``rank``. ``shift`` sends ``tensors`` to the next
    rank and receives the previous rank's (same shapes and dtypes), asynchronously."""

    rank: int
    world: int

    def shift(self, tensors: Sequence[Tensor]) -> Pending: ...


class _Done:
    def __init__(self, tensors: list[Tensor]) -> None:
        self._tensors = tensors

    def wait(self) -> list[Tensor]:
        return self._tensors


class _Requests:
    def __init__(self, requests: list[Any], received: list[Tensor]) -> None:
        self._requests = requests
        self._received = received

    def wait(self) -> list[Tensor]:
        for request in self._requests:
            request.wait()
        return self._received


class DistributedRing:
    """The ring of a ``torch.distributed`` process group (default: the world), through
    ``batch_isend_irecv`` (NCCL for CUDA tensors, gloo for CPU ones). One rank: no communication.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ArgumentError("ring attention needs torch.distributed initialised "
                                "(torch.distributed.init_process_group), or pass ring=")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        ranks = [dist.get_global_rank(group, i) if group is not None else i for i in range(self.world)]
        self._next = ranks[(self.rank + 1) % self.world]
        self._previous = ranks[(self.rank - 1) % self.world]

    def shift(self, tensors: Sequence[Tensor]) -> Pending:
        if self.world == 1:
            return _Done(list(tensors))
        dist = self._dist
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self._next, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, t, self._previous, self.group) for t in received]
        return _Requests(dist.batch_isend_irecv(ops), received)


class LocalRing:
    """Ranks simulated by threads of one process: ``LocalRing.create(world)`` gives one ring per
    rank, to be driven from ``world`` threads at once (each ``shift`` is a barrier across them).

    For tests and for running the algorithm on one device; the transfer is a copy (``clone``).
    Do not mix with autograd on CUDA tensors: torch runs CUDA backward work on one engine thread
    per device, which serialises the ranks; call :func:`ring_forward`/:func:`ring_backward`.
    """

    def __init__(self, board: _Board, rank: int) -> None:
        self._board = board
        self.rank = rank
        self.world = board.world

    @classmethod
    def create(cls, world: int, timeout: float = 300.0) -> list[LocalRing]:
        board = _Board(world, timeout)
        return [cls(board, rank) for rank in range(world)]

    @property
    def shifts(self) -> int:
        """How many shifts this rank has made."""
        return self._board.shifts[self.rank]

    def abort(self) -> None:
        """Break the barrier, so that the other ranks fail instead of waiting (call on an error)."""
        self._board.barrier.abort()

    def shift(self, tensors: Sequence[Tensor]) -> Pending:
        return _Done(self._board.exchange(self.rank, tensors))


class _Board:
    def __init__(self, world: int, timeout: float) -> None:
        import threading

        self.world = world
        self.slots: list[list[Tensor]] = [[] for _ in range(world)]
        self.shifts = [0] * world
        self.barrier = threading.Barrier(world, timeout=timeout)

    def exchange(self, rank: int, tensors: Sequence[Tensor]) -> list[Tensor]:
        self.slots[rank] = [t.clone() for t in tensors]
        self.shifts[rank] += 1
        self.barrier.wait()
        got = self.slots[(rank - 1) % self.world]
        self.barrier.wait()
        return got


def run_local(world: int, body: Callable[[int, LocalRing], Any], timeout: float = 300.0) -> list[Any]:
    """``body(rank, ring)`` on ``world`` threads over a :class:`LocalRing`; results in rank order.

    The first error of any rank is raised (the others are released from the barrier).
    """
    import threading

    rings = LocalRing.create(world, timeout)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = body(rank, rings[rank])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)
            rings[rank].abort()

    threads = [threading.Thread(target=target, args=(rank,), name=f"ring-rank-{rank}") for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


# ---------------------------------------------------------------------------------------------
# The algorithm
# ---------------------------------------------------------------------------------------------

def aotriton_blocks(library: Any = None) -> tuple[Attend, AttendBackward]:
    """The block kernels of the attention operator (on ``library``, default the process-wide one)."""
    from .attention import attention, attention_backward

    def attend(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        out, lse = attention(q, k, v, causal=causal, scale=scale, library=library)
        return out, lse

    def attend_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv, _ = attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, library=library)
        return dq, dk, dv

    return attend, attend_backward


def _block_mode(rank: int, source: int, causal: bool) -> bool | None:
    """How the query chunk of ``rank`` sees the key chunk of ``source``: causally (True),
    fully (False), or not at all (None: a later chunk under the causal mask)."""
    if not causal:
        return False
    if source == rank:
        return True
    return False if source < rank else None


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ArgumentError(f"ring attention takes (B, H, S, D) chunks (layout bhsd), got q {tuple(q.shape)}, "
                            f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[2] != v.shape[2] or k.shape[:2] != v.shape[:2]:
        raise ArgumentError(f"ring attention: k {tuple(k.shape)} and v {tuple(v.shape)} must agree on batch, "
                            "heads and sequence length")
    if q.shape[2] != k.shape[2]:
        raise ArgumentError(f"ring attention: the local query chunk has {q.shape[2]} positions but the key "
                            f"chunk {k.shape[2]}; every rank holds equal chunks of one sequence")


def ring_forward(q: Tensor, k: Tensor, v: Tensor, ring: Ring, *, causal: bool = False, scale: float | None = None,
                 attend: Attend | None = None) -> tuple[Tensor, Tensor]:
    """This rank's chunk of attention over the whole ring's sequence: ``(out, lse)``.

    ``out`` has q's dtype; ``lse`` is fp32 (fp64 for fp64 inputs), ``(B, H, S/W)``. The next key
    chunk's transfer overlaps the current block's attention.
    """
    _check(q, k, v)
    attend = attend or aotriton_blocks()[0]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out = lse = None
    kv = [k, v]
    for step in range(ring.world):
        source = (ring.rank - step) % ring.world
        pending = ring.shift(kv) if step < ring.world - 1 else None
        mode = _block_mode(ring.rank, source, causal)
        if mode is not None:
            block_out, block_lse = attend(q, kv[0], kv[1], mode, scale)
            if out is None:
                wide = torch.float64 if q.dtype == torch.float64 else torch.float32
                out, lse = block_out.to(wide), block_lse.to(wide)
            else:
                out, lse = merge(out, lse, block_out, block_lse)
        if pending is not None:
            kv = pending.wait()
    assert out is not None and lse is not None  # the rank's own chunk is always attended
    return out.to(q.dtype), lse


def ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, ring: Ring, *,
                  causal: bool = False, scale: float | None = None,
                  attend_backward: AttendBackward | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`ring_forward` for this rank's chunks: ``(dq, dk, dv)`` in the inputs' dtype.

    Each (query chunk, key chunk) pair's backward takes the merged ``out``/``lse``; dk/dv
    accumulate (fp32) in buffers that travel with their key chunk and reach its rank after a
    full turn.
    """
    _check(q, k, v)
    attend_backward = attend_backward or aotriton_blocks()[1]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = lse.to(torch.float32) if wide == torch.float32 else lse
    dq = torch.zeros(q.shape, dtype=wide, device=q.device)
    dk = torch.zeros(k.shape, dtype=wide, device=k.device)
    dv = torch.zeros(v.shape, dtype=wide, device=v.device)
    kv = [k, v]
    for step in range(ring.world):
        source = (ring.rank - step) % ring.world
        last = step == ring.world - 1
        mode = _block_mode(ring.rank, source, causal)
        pending_kv = ring.shift(kv) if not last else None
        if mode is not None:
            bq, bk, bv = attend_backward(dout, q, kv[0], kv[1], out, lse, mode, scale)
            dq += bq
            dk += bk
            dv += bv
        # The accumulators follow their key chunk; after the last step they go home.
        dk, dv = ring.shift([dk, dv]).wait()
        if pending_kv is not None:
            kv = pending_kv.wait()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, ring: Ring, causal: bool, scale: float | None,
                attend: Attend | None, attend_backward: AttendBackward | None) -> tuple[Tensor, Tensor]:
        out, lse = ring_forward(q, k, v, ring, causal=causal, scale=scale, attend=attend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (ring, causal, scale, attend_backward)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dlse: Tensor | None) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        ring, causal, scale, attend_backward = ctx.options
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, ring, causal=causal, scale=scale,
                                   attend_backward=attend_backward)
        return dq, dk, dv, None, None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
                   group: Any = None, ring: Ring | None = None, return_lse: bool = False, library: Any = None,
                   attend: Attend | None = None, attend_backward: AttendBackward | None = None
                   ) -> Tensor | tuple[Tensor, Tensor]:
    """Differentiable context-parallel attention: this rank's output chunk (and its lse with ``return_lse``).

    Arguments:
        q, k, v: this rank's chunks, ``(B, H, S/W, D)``, of one sequence split evenly in rank
            order; k/v may have fewer heads (GQA).
        causal: the decoder mask over the whole sequence.
        scale: multiplies ``q kᵀ``; default ``1/sqrt(D)``.
        group: the ``torch.distributed`` process group (default: the world); ``ring`` replaces it.
        return_lse: also return the fp32 ``(B, H, S/W)`` log-sum-exp of this rank's rows.
        library: the :class:`aotriton_rt.Library` of the default block kernels.
        attend, attend_backward: other block kernels (default: aotriton-rt's attention).

    Example::

        out = ring_attention(q.chunk(world, dim=2)[rank], k.chunk(world, dim=2)[rank],
                             v.chunk(world, dim=2)[rank], causal=True)
    """
    if ring is None:
        ring = DistributedRing(group)
    if attend is None or attend_backward is None:
        default_attend, default_backward = aotriton_blocks(library)
        attend, attend_backward = attend or default_attend, attend_backward or default_backward
    out, lse = _RingAttention.apply(q, k, v, ring, causal, scale, attend, attend_backward)
    return (out, lse) if return_lse else out
