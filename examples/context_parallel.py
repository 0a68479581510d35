"""Context-parallel (ring) attention over torch.distributed, checked against one-GPU attention on the full sequence.

    torchrun --nproc_per_node=2 examples/context_parallel.py          # 2, 4 or 8 GPUs
    torchrun --nproc_per_node=1 examples/context_parallel.py          # the degenerate ring of one
    python examples/context_parallel.py --simulate 2                  # 2 ranks as threads on ONE GPU

Each rank holds one contiguous chunk of the sequence; key/value chunks travel around the ring
(NCCL send/recv, NVLink multicast off: NCCL_NVLS_ENABLE=0 is set here unless already set), the
partial outputs merge through the log-sum-exp that aotriton-rt's forward returns, and the
backward runs through the same ring (``aotriton_rt.ops.ring``). Rank 0 gathers the output and the
gradients and compares them with aotriton-rt's attention on the whole sequence on one GPU, and
both with an fp32 reference (AOTriton's bound: ``|ours - fp32| <= k |bf16 math - fp32| + eps``).
It times the ring's forward+backward against the one-GPU full-sequence forward+backward (median
of ``--iters``).

``--simulate N`` runs N ranks as threads of one process sharing one GPU (``LocalRing``): the ring's
math through the real kernels, without NCCL (which refuses two ranks on one device); its times
are not a scaling measurement.

Prints a summary table; with $OUT set writes ``context_parallel_w{N}.json`` there. Needs images
with the default set (AOTRITON_RT_IMAGES or ``--images``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import aotriton_rt  # noqa: E402
from aotriton_rt.ops.ring import aotriton_blocks, ring_attention, ring_backward, ring_forward, run_local  # noqa: E402
from aotriton_rt.ops.torch import attention  # noqa: E402

# (k, eps) per output, eps for bf16 (tests/runtime/test_attention_gpu.py's rule).
BOUNDS = {"out": (3.0, 8 * 2e-4), "dq": (4.0, 8 * 5e-4), "dk": (4.0, 8 * 5e-4), "dv": (4.0, 8 * 5e-4)}


def inputs(args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    """q, k, v, dout of the whole sequence, identical on every rank (one seed)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q_shape = (args.batch, args.heads, args.seqlen, args.dim)
    kv_shape = (args.batch, args.kv_heads, args.seqlen, args.dim)
    return [torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16)
            for s in (q_shape, kv_shape, kv_shape, q_shape)]


def math_attention(q, k, v, dout, causal: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    """Output and q/k/v gradients of plain attention computed in ``dtype``, returned as fp32."""
    qc, kc, vc = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    s = qc @ kc.repeat_interleave(group, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ vc.repeat_interleave(group, 1)
    out.backward(dout.to(dtype))
    return [t.detach().float() for t in (out, qc.grad, kc.grad, vc.grad)]


def timed(fn, iters: int, sync) -> tuple[float, float]:
    """Median and spread (max - min) in ms of ``fn()`` over ``iters`` runs after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), max(times) - min(times)


def check(name: str, got: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> dict:
    k, eps = BOUNDS[name]
    err = (got.float() - hi).abs().max().item()
    bound = k * (lo - hi).abs().max().item() + eps * max(1.0, hi.abs().max().item())
    return {"error": err, "bound": bound, "ok": err <= bound}


def _device(index: int) -> torch.device:
    return torch.device("cuda", index)


def _sync() -> None:
    torch.cuda.synchronize()


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8, help="fewer than --heads: grouped-query attention")
    parser.add_argument("--seqlen", type=int, default=8192, help="the whole sequence (split across ranks)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--simulate", type=int, default=0, metavar="N", help="N ranks as threads on one GPU")
    parser.add_argument("--images", help="image folder (default: the usual search)")
    args = parser.parse_args()
    library = aotriton_rt.Library(args.images) if args.images else aotriton_rt.default_library()

    if args.simulate:
        world, rank, local_rank = args.simulate, 0, 0
    else:
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29518")
        local_rank = int(os.environ["LOCAL_RANK"])
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        else:  # no GPU: gloo, for a dry run of the ring on CPU with other block kernels
            dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    device = _device(local_rank)
    if args.seqlen % world:
        raise SystemExit(f"--seqlen {args.seqlen} must be a multiple of the number of ranks {world}")
    torch.backends.cuda.matmul.allow_tf32 = False
    q, k, v, dout = inputs(args, device)
    chunk = args.seqlen // world
    attend, attend_backward = aotriton_blocks(library)
    sync = _sync

    if args.simulate:
        def ring_step() -> list[torch.Tensor]:
            def body(r, ring):
                parts = [t[:, :, r * chunk:(r + 1) * chunk].contiguous() for t in (q, k, v, dout)]
                out, lse = ring_forward(*parts[:3], ring, causal=args.causal, attend=attend)
                grads = ring_backward(parts[3], *parts[:3], out, lse, ring, causal=args.causal,
                                      attend_backward=attend_backward)
                return [out, *grads]
            return run_local(world, body)

        per_rank = ring_step()
        gathered = [torch.cat([r[i] for r in per_rank], dim=2) for i in range(4)]
        ring_ms = timed(ring_step, args.iters, sync)
    else:
        mine = [t[:, :, rank * chunk:(rank + 1) * chunk].contiguous() for t in (q, k, v, dout)]

        def ring_step() -> list[torch.Tensor]:
            leaves = [t.detach().requires_grad_() for t in mine[:3]]
            out = ring_attention(*leaves, causal=args.causal, attend=attend, attend_backward=attend_backward)
            out.backward(mine[3])
            return [out.detach(), *(t.grad for t in leaves)]

        local = ring_step()
        gathered = []
        for t in local:
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous())
            gathered.append(torch.cat(parts, dim=2))
        dist.barrier()
        ring_ms = timed(ring_step, args.iters, sync)

    failed = False
    if rank == 0:
        def full_step() -> list[torch.Tensor]:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = attention(*leaves, causal=args.causal, library=library)
            out.backward(dout)
            return [out.detach(), *(t.grad for t in leaves)]

        full = full_step()
        full_ms = timed(full_step, args.iters, sync)
        hi = math_attention(q, k, v, dout, args.causal, torch.float32)
        lo = math_attention(q, k, v, dout, args.causal, torch.bfloat16)
        rows = {}
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            rows[name] = {"ring_vs_full_max_abs": (gathered[i].float() - full[i].float()).abs().max().item(),
                          "ring": check(name, gathered[i], hi[i], lo[i]),
                          "full": check(name, full[i], hi[i], lo[i])}
        mode = f"simulated {world} ranks on one GPU" if args.simulate else f"{world} rank(s), {dist.get_backend()}"
        print(f"\ncontext-parallel attention: {mode}; B={args.batch} H={args.heads}/{args.kv_heads} "
              f"S={args.seqlen} D={args.dim} causal={args.causal} bf16")
        print(f"{'output':>6} {'|ring-full|':>12} {'ring err':>10} {'full err':>10} {'bound':>10} {'ok':>4}")
        for name, r in rows.items():
            print(f"{name:>6} {r['ring_vs_full_max_abs']:>12.3e} {r['ring']['error']:>10.3e} "
                  f"{r['full']['error']:>10.3e} {r['ring']['bound']:>10.3e} {'yes' if r['ring']['ok'] else 'NO':>4}")
        print(f"fwd+bwd time, median of {args.iters} (spread): ring {ring_ms[0]:.2f} ms ({ring_ms[1]:.2f}), "
              f"one GPU full sequence {full_ms[0]:.2f} ms ({full_ms[1]:.2f}); ratio full/ring "
              f"{full_ms[0] / ring_ms[0]:.2f}")
        ok = all(r["ring"]["ok"] for r in rows.values())
        print("PASS" if ok else "FAIL: the ring's error exceeds the operator's bound")
        failed = not ok
        out = os.environ.get("OUT")
        if out:
            path = Path(out) / f"context_parallel_w{world}{'_simulated' if args.simulate else ''}.json"
            path.write_text(json.dumps({"world": world, "simulated": bool(args.simulate), "args": vars(args),
                                        "device": _device_name(device), "rows": rows,
                                        "ring_ms": ring_ms, "full_ms": full_ms, "ok": ok}, indent=1))
            print(f"wrote {path}")
    if not args.simulate:
        dist.barrier()
        dist.destroy_process_group()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
