"""Ring (context-parallel) attention on CPU: the LSE merge, and the whole ring algorithm with simulated ranks.

The ranks are threads exchanging tensors through a barrier (``LocalRing``), and the block
kernels are an fp64 reference that computes what the attention kernels compute (the backward takes
the given, merged ``out``/``lse`` as the kernels do). So the algorithm of
``aotriton_rt.ops.ring`` (which block is attended how, the merge, the travelling dk/dv, the
autograd wiring) is proven against plain full-sequence attention without a GPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from aotriton_rt.errors import ArgumentError  # noqa: E402
from aotriton_rt.ops.ring import LocalRing, merge, ring_attention, ring_backward, ring_forward, run_local  # noqa: E402

# ---------------------------------------------------------------------------------------------
# An fp64 reference of the block kernels.
# ---------------------------------------------------------------------------------------------

def _expand(q, k, v):
    group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), group


def _scores(q, k, causal, scale):
    s = q @ k.transpose(-1, -2) * scale
    if causal:  # top-left aligned, as the kernel's default
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s


def ref_attend(q, k, v, causal, scale):
    k, v, _ = _expand(q, k, v)
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - finite.unsqueeze(-1)) @ v, lse


def ref_attend_backward(dout, q, k, v, out, lse, causal, scale):
    ke, ve, group = _expand(q, k, v)
    s = _scores(q, ke, causal, scale)
    p = torch.exp(s - torch.where(torch.isneginf(lse), float("inf"), lse).unsqueeze(-1))
    dv = p.transpose(-1, -2) @ dout
    delta = (dout * out).sum(-1, keepdim=True)
    ds = p * (dout @ ve.transpose(-1, -2) - delta)
    dq = ds @ ke * scale
    dk = ds.transpose(-1, -2) @ q * scale
    b, h, s_, d = k.shape
    return dq, dk.view(b, h, group, s_, d).sum(2), dv.view(b, h, group, s_, v.shape[-1]).sum(2)


def full_attention(q, k, v, causal, scale):
    k, v, _ = _expand(q, k, v)
    return torch.softmax(_scores(q, k, causal, scale), dim=-1) @ v


# ---------------------------------------------------------------------------------------------
# Simulated ranks.
# ---------------------------------------------------------------------------------------------

def run_ranks(world, body):
    """``body(rank, ring)`` on ``world`` threads; their results in rank order, and the rings."""
    rings = []

    def wrapped(rank, ring):
        rings.append(ring)
        return body(rank, ring)

    results = run_local(world, wrapped, timeout=60)
    return results, sorted(rings, key=lambda r: r.rank)


def problem(world, causal, heads_kv=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, h, s, d = 2, 4, 8 * world, 16
    q = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, heads_kv, s, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, heads_kv, s, d, generator=gen, dtype=torch.float64)
    dout = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64)
    return q, k, v, dout, d ** -0.5


# ---------------------------------------------------------------------------------------------
# The merge.
# ---------------------------------------------------------------------------------------------

def test_merging_two_key_halves_gives_attention_over_all_keys():
    q, k, v, _, scale = problem(1, False)
    out_a, lse_a = ref_attend(q, k[:, :, :3], v[:, :, :3], False, scale)
    out_b, lse_b = ref_attend(q, k[:, :, 3:], v[:, :, 3:], False, scale)
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    want_out, want_lse = ref_attend(q, k, v, False, scale)
    assert torch.allclose(out, want_out, atol=1e-12) and torch.allclose(lse, want_lse, atol=1e-12)
    # The order of the parts does not matter.
    out_ba, lse_ba = merge(out_b, lse_b, out_a, lse_a)
    assert torch.allclose(out_ba, out, atol=1e-12) and torch.equal(lse_ba, lse)


def test_a_part_with_no_visible_key_leaves_the_other_unchanged_and_two_empty_parts_give_zero_and_minus_inf():
    out_a = torch.randn(3, 5, 4, dtype=torch.float64)
    lse_a = torch.randn(3, 5, dtype=torch.float64)
    empty_out = torch.zeros_like(out_a)
    empty_lse = torch.full_like(lse_a, float("-inf"))
    out, lse = merge(out_a, lse_a, empty_out, empty_lse)
    assert torch.equal(out, out_a) and torch.equal(lse, lse_a)
    out, lse = merge(empty_out, empty_lse, out_a, lse_a)
    assert torch.equal(out, out_a) and torch.equal(lse, lse_a)
    out, lse = merge(empty_out, empty_lse, empty_out, empty_lse)
    assert not out.isnan().any() and torch.equal(out, empty_out)
    assert torch.isneginf(lse).all()
    # Mixed rows: only row 2 is empty in part b.
    lse_b = torch.randn(3, 5, dtype=torch.float64)
    lse_b[:, 2] = float("-inf")
    out_b = torch.randn(3, 5, 4, dtype=torch.float64)
    out_b[:, 2] = 0
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out[:, 2], out_a[:, 2]) and torch.equal(lse[:, 2], lse_a[:, 2])
    assert not torch.allclose(out[:, 3], out_a[:, 3])


def test_merge_of_16_bit_parts_computes_in_fp32():
    out_a, out_b = torch.randn(2, 6, 8).to(torch.bfloat16), torch.randn(2, 6, 8).to(torch.bfloat16)
    lse_a, lse_b = torch.randn(2, 6), torch.randn(2, 6)
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    want, _ = merge(out_a.double(), lse_a.double(), out_b.double(), lse_b.double())
    assert torch.allclose(out.double(), want, atol=1e-6)


def test_merge_refuses_parts_of_different_shapes():
    with pytest.raises(ArgumentError, match=r"merge: out shapes \(2, 4, 8\), \(2, 5, 8\) and lse shapes "
                                            r"\(2, 4\), \(2, 5\) do not match"):
        merge(torch.zeros(2, 4, 8), torch.zeros(2, 4), torch.zeros(2, 5, 8), torch.zeros(2, 5))


# ---------------------------------------------------------------------------------------------
# The ring, W simulated ranks.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_attention_equals_full_attention_forward_and_gradients(world, causal):
    q, k, v, dout, scale = problem(world, causal)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    want = full_attention(qf, kf, vf, causal, scale)
    want.backward(dout)
    _, want_lse = ref_attend(q, k, v, causal, scale)

    def body(rank, ring):
        ql, kl, vl = (t.chunk(world, dim=2)[rank].clone().requires_grad_() for t in (q, k, v))
        out, lse = ring_attention(ql, kl, vl, causal=causal, ring=ring, return_lse=True,
                                  attend=ref_attend, attend_backward=ref_attend_backward)
        out.backward(dout.chunk(world, dim=2)[rank])
        return out.detach(), lse, ql.grad, kl.grad, vl.grad

    results, rings = run_ranks(world, body)
    got = [torch.cat([r[i] for r in results], dim=2) for i in range(5)]
    assert torch.allclose(got[0], want, atol=1e-10)
    assert torch.allclose(got[1], want_lse, atol=1e-10)
    for name, g, w in zip(("dq", "dk", "dv"), got[2:], (qf.grad, kf.grad, vf.grad)):
        assert torch.allclose(g, w, atol=1e-10), name
    # forward: W-1 key/value shifts; backward: W-1 key/value shifts and W dk/dv shifts
    assert [r.shifts for r in rings] == [(world - 1) * 2 + world] * world


def test_ring_with_grouped_query_heads_equals_full_attention():
    world = 3
    q, k, v, dout, scale = problem(world, True, heads_kv=2, seed=1)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    full_attention(qf, kf, vf, True, scale).backward(dout)

    def body(rank, ring):
        ql, kl, vl, dl = (t.chunk(world, dim=2)[rank] for t in (q, k, v, dout))
        out, lse = ring_forward(ql, kl, vl, ring, causal=True, attend=ref_attend)
        return ring_backward(dl, ql, kl, vl, out, lse, ring, causal=True, attend_backward=ref_attend_backward)

    results, _ = run_ranks(world, body)
    for i, w in enumerate((qf.grad, kf.grad, vf.grad)):
        assert torch.allclose(torch.cat([r[i] for r in results], dim=2), w, atol=1e-10)


def test_a_wrong_block_rule_would_be_caught():
    """The test can fail: skipping nothing under the causal mask (every block attended fully) is wrong."""
    world = 2
    q, k, v, _, scale = problem(world, True)
    want = full_attention(q, k, v, True, scale)

    def body(rank, ring):
        ql, kl, vl = (t.chunk(world, dim=2)[rank] for t in (q, k, v))
        return ring_forward(ql, kl, vl, ring, causal=False, attend=ref_attend)[0]

    results, _ = run_ranks(world, body)
    assert not torch.allclose(torch.cat(results, dim=2), want, atol=1e-3)


def test_ring_refuses_chunks_of_different_lengths():
    q = torch.zeros(1, 2, 8, 16)
    with pytest.raises(ArgumentError, match=r"the local query chunk has 8 positions but the key chunk 4"):
        ring_forward(q, torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 16), LocalRing.create(1)[0])
    with pytest.raises(ArgumentError, match=r"ring attention takes \(B, H, S, D\) chunks"):
        ring_forward(torch.zeros(2, 8, 16), q, q, LocalRing.create(1)[0])


def test_distributed_ring_without_an_initialised_process_group_says_so():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(ArgumentError, match=r"ring attention needs torch.distributed initialised"):
        ring_attention(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8))


GLOO_RANK = r"""
import json, os, sys
import torch
import torch.distributed as dist
from aotriton_rt.ops.ring import ring_attention
from tests.runtime.test_ring import full_attention, problem, ref_attend, ref_attend_backward

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
q, k, v, dout, scale = problem(world, True, seed=3)
ql, kl, vl = (t.chunk(world, dim=2)[rank].clone().requires_grad_() for t in (q, k, v))
out = ring_attention(ql, kl, vl, causal=True, attend=ref_attend, attend_backward=ref_attend_backward)
out.backward(dout.chunk(world, dim=2)[rank])
qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
want = full_attention(qf, kf, vf, True, scale)
want.backward(dout)
err = max(float((g - w.chunk(world, dim=2)[rank]).abs().max())
          for g, w in ((out, want), (ql.grad, qf.grad), (kl.grad, kf.grad), (vl.grad, vf.grad)))
print(json.dumps({"rank": rank, "max_error": err}))
dist.destroy_process_group()
"""


def test_ring_over_a_real_gloo_process_group_of_two_processes_equals_full_attention(tmp_path):
    """DistributedRing itself: two processes on loopback, torch.distributed's gloo backend."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": "2", "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", GLOO_RANK], env=env, cwd=root, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(o["rank"] for o in outputs) == [0, 1]
    assert all(o["max_error"] < 1e-10 for o in outputs), outputs
