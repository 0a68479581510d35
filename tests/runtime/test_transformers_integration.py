"""The transformers integration's mask handling, on CPU.

A small randomly initialised Llama runs twice with the same weights: with transformers' SDPA,
and with ``attn_implementation="aotriton"`` whose attention calls are served by an fp64
reference of ``aotriton_rt.ops.torch.attention``'s contract (GQA, bottom-right causal, additive
bias, rows that see no key output 0). Logits of causal prefill, of left-padded batches (on the
real tokens), and greedy generations with the cache must agree; the calls the model makes are
recorded (decoding steps must reach aotriton with one query row, no mask and the whole cache).
The GPU test (tests/runtime/test_decode_gpu.py) runs the real kernels. Needs transformers
(skipped without it).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CALLS: list[dict] = []


def _reference(q: Any, k: Any, v: Any, *, causal: bool, align: str, bias: Any, dropout_p: float, scale: Any,
               layout: str, library: Any, path: str = "autograd") -> Any:
    assert layout == "bshd" and align == "bottom_right" and dropout_p == 0.0
    CALLS.append({"q_len": q.shape[1], "k_len": k.shape[1], "causal": causal, "bias": bias is not None,
                  "heads": (q.shape[2], k.shape[2]), "path": path})
    qd, kd, vd = (t.transpose(1, 2).double() for t in (q, k, v))
    group = qd.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    s = qd @ kd.transpose(-1, -2) * (scale if scale is not None else qd.shape[-1] ** -0.5)
    if bias is not None:
        s = s + bias.double()
    sq, sk = s.shape[-2:]
    if causal:
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    seen = torch.isfinite(s).any(-1, keepdim=True)
    p = torch.softmax(torch.where(seen, s, 0.0), -1) * seen
    return (p @ vd).transpose(1, 2).to(q.dtype)


@pytest.fixture
def models(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    import aotriton_rt.integrations.transformers as hf
    import aotriton_rt.ops.attention as op_core
    import aotriton_rt.ops.decode as op_decode
    import aotriton_rt.ops.torch as op_torch

    def core(q: Any, k: Any, v: Any, **kw: Any) -> tuple:
        return _reference(q, k, v, dropout_p=0.0, path="core", **kw), None

    def decode(q: Any, k: Any, v: Any, *, causal: bool, scale: Any, layout: str, cache_layout: str,
               library: Any) -> tuple:
        assert cache_layout == "bshd"
        return _reference(q, k, v, causal=causal, align="bottom_right", bias=None, dropout_p=0.0, scale=scale,
                          layout=layout, library=library, path="decode"), None

    monkeypatch.setattr(op_torch, "attention", _reference)
    monkeypatch.setattr(op_core, "attention", core)
    monkeypatch.setattr(op_decode, "decode_attention", decode)
    name = hf.register()
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=128, pad_token_id=0)
    torch.manual_seed(0)
    sdpa = transformers.LlamaForCausalLM(copy.deepcopy(config)).eval()
    ours = transformers.LlamaForCausalLM(copy.deepcopy(config)).eval()
    ours.load_state_dict(sdpa.state_dict())
    ours.set_attn_implementation(name)
    sdpa.set_attn_implementation("sdpa")
    assert ours.config is not sdpa.config
    CALLS.clear()
    return sdpa, ours


def test_causal_prefill_logits_match_sdpa_with_gqa_and_no_mask(models: tuple) -> None:
    sdpa, ours = models
    ids = torch.randint(1, 101, (2, 23), generator=torch.Generator().manual_seed(1))  # > 16 rows: prefill
    with torch.no_grad():
        want = sdpa(ids).logits
        got = ours(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert CALLS and all(c["causal"] and not c["bias"] and c["heads"] == (4, 2) for c in CALLS)
    assert {c["path"] for c in CALLS} == {"core"}  # inference skips the autograd op


def test_left_padded_batch_matches_sdpa_on_the_real_tokens(models: tuple) -> None:
    sdpa, ours = models
    ids = torch.randint(1, 101, (3, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        want = sdpa(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)
    assert all(c["bias"] and not c["causal"] for c in CALLS)


def test_greedy_generation_with_the_cache_matches_sdpa_and_decodes_one_row_at_a_time(models: tuple) -> None:
    sdpa, ours = models
    ids = torch.randint(1, 101, (2, 7), generator=torch.Generator().manual_seed(3))
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        want = sdpa.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        got = ours.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    assert torch.equal(got, want)
    decode = [c for c in CALLS if c["q_len"] == 1]
    assert decode, "no decoding step reached aotriton"
    # One query row, no mask, every cached key: straight to the decode kernels.
    assert all(not c["causal"] and not c["bias"] and c["path"] == "decode" for c in decode)
    assert max(c["k_len"] for c in decode) == 7 + 6 - 1


def test_padded_generation_matches_sdpa(models: tuple) -> None:
    sdpa, ours = models
    ids = torch.randint(1, 101, (2, 8), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kw = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        want = sdpa.generate(ids, attention_mask=mask, **kw)
        got = ours.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(got, want)


def test_training_goes_through_the_autograd_op(models: tuple) -> None:
    _, ours = models
    ours.train()
    ids = torch.randint(1, 101, (2, 9), generator=torch.Generator().manual_seed(5))
    ours(ids).logits.float().pow(2).mean().backward()
    assert CALLS and {c["path"] for c in CALLS} == {"autograd"}


def test_softcap_is_refused_with_a_clear_error() -> None:
    from aotriton_rt import UnsupportedError
    from aotriton_rt.integrations.transformers import attention_forward

    q = torch.zeros(1, 2, 3, 16)
    with pytest.raises(UnsupportedError, match=r"aotriton attention does not support softcap"):
        attention_forward(torch.nn.Module(), q, q, q, None, softcap=30.0)
