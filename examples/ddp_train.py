"""Data-parallel training of a small transformer whose attention is aotriton-rt's, one process per GPU.

    torchrun --nproc_per_node=2 examples/ddp_train.py            # or 1, 4, 8
    torchrun --nproc_per_node=1 examples/ddp_train.py --compare $OUT/ddp_loss_w2_aotriton.json

A decoder (token embedding, causal self-attention through ``aotriton_rt.ops.torch.attention``, MLP)
learns a synthetic task that needs attention: to predict, at each position, the token ``LAG``
positions back. Every step draws one *global* batch from a seed (the same on every rank) and
each rank trains on its slice, so DDP's averaged gradients are those of the whole batch, and the
loss curve of N processes equals the one-process curve up to bf16 noise. ``--compare`` reads
another run's curve and prints the largest difference.

NCCL between the processes (gloo where there is no GPU), with NVLink multicast off
(NCCL_NVLS_ENABLE=0, set here unless already set). Prints the losses, a summary table, and with
$OUT set writes ``ddp_loss_w{world}_{attention}.json`` there. Needs images with the default set
(AOTRITON_RT_IMAGES, or ``--images``): ``python -m builder build --set default --targets sm90``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import aotriton_rt  # noqa: E402
from aotriton_rt.ops.torch import attention  # noqa: E402

LAG = 7


class Block(nn.Module):
    def __init__(self, width: int, heads: int, backend: str, library: aotriton_rt.Library | None) -> None:
        super().__init__()
        self.heads, self.backend, self.library = heads, backend, library
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, w // self.heads).unbind(2)
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))  # (B, S, H, D), read in place
        if self.backend == "aotriton":
            a = attention(q, k, v, causal=True, layout="bshd", library=self.library)
        else:  # torch's SDPA, for comparison
            a = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
        x = x + self.proj(a.reshape(b, s, w).to(x.dtype))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, layers: int, seqlen: int, backend: str,
                 library: aotriton_rt.Library | None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(seqlen, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads, backend, library) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def global_batch(step: int, batch: int, seqlen: int, vocab: int, device: torch.device) -> tuple:
    """The step's whole batch, identical on every rank: inputs and targets (-100: not scored)."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (batch, seqlen), generator=gen)
    target = torch.full_like(tokens, -100)
    target[:, LAG:] = tokens[:, :-LAG]
    return tokens.to(device), target.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32, help="global batch (split across ranks)")
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--attention", choices=("aotriton", "sdpa"), default="aotriton")
    parser.add_argument("--images", help="image folder (default: the usual search)")
    parser.add_argument("--compare", help="another run's ddp_loss_w*.json: print the largest loss difference")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:  # plain `python examples/ddp_train.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=torch.device("cuda", local_rank) if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the world size {world}")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    library = aotriton_rt.Library(args.images) if args.images else None

    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = Decoder(args.vocab, args.width, args.heads, args.layers, args.seqlen, args.attention, library).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    per_rank = args.batch // world
    losses: list[float] = []
    tokens_seen, started = 0, None
    for step in range(args.steps):
        if step == 5:  # time the steady state
            if cuda:
                torch.cuda.synchronize()
            started, tokens_seen = time.perf_counter(), 0
        tokens, target = global_batch(step, args.batch, args.seqlen, args.vocab, device)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = ddp(tokens[mine])
        loss = F.cross_entropy(logits.float().flatten(0, 1), target[mine].flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        tokens_seen += args.batch * args.seqlen
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started if started is not None else float("nan")

    if rank == 0:
        result = {"world": world, "attention": args.attention, "steps": args.steps, "batch": args.batch,
                  "seqlen": args.seqlen, "losses": losses, "tokens_per_s": tokens_seen / elapsed if elapsed else None,
                  "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
        diff = None
        if args.compare:
            other = json.loads(Path(args.compare).read_text())["losses"]
            n = min(len(other), len(losses))
            diff = max(abs(a - b) for a, b in zip(losses[:n], other[:n]))
            result["compare"] = {"file": args.compare, "max_abs_loss_difference": diff}
        first, last = losses[0], losses[-1]
        print("\nsummary")
        print(f"{'world':>6} {'attention':>9} {'steps':>6} {'loss first':>11} {'loss last':>10} {'tokens/s':>12}"
              f" {'max |Δloss| vs compare':>24}")
        print(f"{world:>6} {args.attention:>9} {args.steps:>6} {first:>11.4f} {last:>10.4f} "
              f"{result['tokens_per_s'] or float('nan'):>12.0f} {'' if diff is None else f'{diff:.4f}':>24}")
        if not math.isfinite(last) or last >= first:
            print("WARNING: the loss did not decrease")
        out = os.environ.get("OUT")
        if out:
            path = Path(out) / f"ddp_loss_w{world}_{args.attention}.json"
            path.write_text(json.dumps(result, indent=1))
            print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
