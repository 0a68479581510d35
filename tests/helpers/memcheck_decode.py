"""A representative decode subset to run under compute-sanitizer (not collected by pytest).

    AOTRITON_RT_IMAGES=.gpu-images compute-sanitizer --tool memcheck --error-exitcode 9 \\
        python tests/helpers/memcheck_decode.py

Contiguous and paged caches (page sizes 16, 48, 64 and 256: smaller than a key block, neither,
one block, several; a block table whose unused entries point far outside the cache, lengths 0,
1 and past a page edge), appends across page edges, speculative query rows with GQA tiles
taller than one block, sliding windows, forced splits (merged by the combine kernel; on sm90
the chain's PDL launches), head dims 64, 80 and 128, fp32, the attention() route, and lengths
past the block table without the debug check (the kernels must clamp, not fault).
Needs images with the gputest set (AOTRITON_RT_IMAGES).
"""

import os

import torch

import aotriton_rt
from aotriton_rt.ops.decode import decode_attention

torch.manual_seed(0)
dev = "cuda"
lib = aotriton_rt.Library(os.environ["AOTRITON_RT_IMAGES"]) if os.environ.get("AOTRITON_RT_IMAGES") else None


def paged(lens, page, hk, d, dtype, spare=3):
    blocks = max(-(-max(lens) // page), 1) + 1
    pages = sum(-(-n // page) for n in lens) + spare
    table = torch.full((len(lens), blocks), 1 << 30, dtype=torch.int32)
    order = torch.randperm(pages).tolist()
    it = iter(order)
    for b, n in enumerate(lens):
        for j in range(-(-n // page)):
            table[b, j] = next(it)
    k = torch.randn(pages, page, hk, d, device=dev, dtype=dtype)
    return k, torch.randn_like(k), table.to(dev)


def run(name, b=3, hq=8, hk=2, sq=1, d=64, dtype=torch.float16, page=None, lens=(37, 0, 1), new=0, **opts):
    lens_new = [n + new for n in lens]
    if page:
        k, v, table = paged(lens_new, page, hk, d, dtype)
    else:
        cap = max(lens_new) + 5
        k = torch.randn(b, cap, hk, d, device=dev, dtype=dtype)
        v, table = torch.randn_like(k), None
    q = torch.randn(b, sq, hq, d, device=dev, dtype=dtype)
    kn = torch.randn(b, new, hk, d, device=dev, dtype=dtype) if new else None
    vn = torch.randn_like(kn) if new else None
    seqlens = torch.tensor(lens, dtype=torch.int32, device=dev)
    out, lse = decode_attention(q, k, v, cache_seqlens=seqlens, block_table=table, k_new=kn, v_new=vn, library=lib,
                                **opts)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), name
    print(f"ok {name}")


run("contiguous, one split", num_splits=1)
run("contiguous, forced splits", num_splits=5, lens=(300, 0, 129))
run("paged 16, random table", page=16, lens=(33, 1, 16), num_splits=3)
run("paged 48, append across page edges", page=48, lens=(47, 95, 0), new=3, sq=3, causal=True)
run("speculative 16 rows, group 4 (two row blocks)", sq=16, page=16, lens=(70, 20, 16), causal=True, num_splits=2)
run("sliding window", page=16, sq=2, lens=(200, 3, 64), causal=True, window=(31, 0))
run("head dim 80", d=80, lens=(100, 7, 1))
run("head dim 128 bf16 paged", d=128, dtype=torch.bfloat16, page=32, lens=(500, 65, 2), causal=True)
run("paged 64, one table entry per key block", d=128, dtype=torch.bfloat16, page=64, lens=(700, 63, 0), new=2,
    causal=True, num_splits=4)
run("paged 256, seven splits merged by the combine kernel", d=128, dtype=torch.bfloat16, page=256, lens=(3000, 1, 255),
    hq=32, hk=8, num_splits=7)
for _ in range(2):  # again: the prepared launches
    run("paged 16, six splits, prepared launch", page=16, lens=(900, 1, 17), num_splits=6)
run("fp32", dtype=torch.float32, lens=(60, 0, 9), num_splits=2)
k, v, table = paged([40, 10], 16, 2, 64, torch.float16)
q = torch.randn(2, 1, 4, 64, device=dev, dtype=torch.float16)
decode_attention(q, k, v, cache_seqlens=torch.tensor([40, 1 << 20], dtype=torch.int32, device=dev),
                 block_table=table, check=False, library=lib)
torch.cuda.synchronize()
print("ok lengths past the block table are clamped")
q = torch.randn(4, 32, 1, 128, device=dev, dtype=torch.bfloat16)
kk = torch.randn(4, 8, 777, 128, device=dev, dtype=torch.bfloat16)
aotriton_rt.attention(q, kk, kk, causal=True, align="bottom_right", library=lib)
torch.cuda.synchronize()
print("ok attention() route")
