"""transformers models on the real kernels of the default images (marker ``gpu``).

Tiny randomly initialised models of several families (Llama with GQA, Mistral with a sliding
window shorter than the prompts, Qwen2, Phi-3 at head dim 96, Gemma 3 with local and global
layers, gpt-oss with attention sinks and a window on alternate layers, a BERT encoder) run in
bf16 with ``attn_implementation="aotriton"`` and with SDPA, on a left-padded batch and on packed
sequences. The reference is the same model in fp32 with SDPA (eager attention for gpt-oss, which
SDPA cannot run): ours must be as close to it as bf16 SDPA (eager) is (logits on real tokens,
loss gradients), and greedy generations must agree with bf16 SDPA's on at least 95% of the tokens.

Images: ``AOTRITON_RT_DEFAULT_IMAGES`` (``python -m builder build --set default --targets
<arch>``), else built here for this GPU's arch (the ``default_lib`` fixture).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.gpu

_COMMON = {"vocab_size": 257, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
           "num_attention_heads": 4, "max_position_embeddings": 512, "pad_token_id": 0}
MODELS = {
    "llama_gqa": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 1, "head_dim": 64}),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", {"num_key_value_heads": 2, "sliding_window": 24,
                                                                "head_dim": 128, "num_attention_heads": 2}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 2}),
    "phi3_d96": ("Phi3Config", "Phi3ForCausalLM", {"num_key_value_heads": 4, "hidden_size": 384}),
    "gemma3_local": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                     {"num_key_value_heads": 2, "head_dim": 128, "sliding_window": 16,
                      "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}),
    # Attention sinks (s_aux) on every layer, a window on alternate ones; SDPA cannot run them,
    # so the reference and the bf16 baseline are transformers' eager attention. Every expert on
    # every token: top-k routing would turn rounding-level differences into other experts.
    "gpt_oss_sinks": ("GptOssConfig", "GptOssForCausalLM",
                      {"num_key_value_heads": 2, "head_dim": 64, "sliding_window": 16, "num_local_experts": 2,
                       "num_experts_per_tok": 2, "intermediate_size": 256,
                       "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    # Gemma 2's logit softcap (50, at head dim 256) on every layer, a window on one; inference
    # only here (the default images hold no head-dim-256 backward).
    "gemma2_softcap": ("Gemma2Config", "Gemma2ForCausalLM",
                       {"num_key_value_heads": 2, "head_dim": 256, "sliding_window": 16, "attn_logit_softcapping": 50.0,
                        "final_logit_softcapping": None,
                        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    # Gemma 2 27B's attention (head dim 128, cap 50): the default images serve its inference; its
    # training (the softcap backward) runs on the gputest images (test_gemma2_trains_on_...).
    "gemma2_softcap_d128": ("Gemma2Config", "Gemma2ForCausalLM",
                            {"num_key_value_heads": 2, "head_dim": 128, "num_attention_heads": 2,
                             "sliding_window": 16, "attn_logit_softcapping": 50.0, "final_logit_softcapping": None,
                             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    # Without dropout: the comparison needs equal computations (the default images hold no dropout).
    "bert": ("BertConfig", "BertForMaskedLM", {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}),
}
DECODERS = [m for m in MODELS if m != "bert"]
LENGTHS = (37, 120, 5, 77)  # left-padded prompts


#: The reference attention where SDPA cannot serve a model.
REFERENCE = {"gpt_oss_sinks": "eager", "gemma2_softcap": "eager", "gemma2_softcap_d128": "eager"}
#: Models the default images serve for inference only (no softcap backward): logits and generation.
INFERENCE_ONLY = ("gemma2_softcap", "gemma2_softcap_d128")


def _models(name: str, attn: str) -> tuple[Any, Any, Any]:
    """(fp32 SDPA reference, bf16 SDPA, bf16 aotriton) with the same weights, on the GPU (eager
    instead of SDPA for the models in :data:`REFERENCE`)."""
    config_cls, model_cls, extras = MODELS[name]
    config = getattr(transformers, config_cls)(**{**_COMMON, **extras})
    torch.manual_seed(0)
    ref = getattr(transformers, model_cls)(copy.deepcopy(config)).cuda().eval()
    ref.set_attn_implementation(REFERENCE.get(name, "sdpa"))
    sdpa = copy.deepcopy(ref).to(torch.bfloat16)
    ours = copy.deepcopy(ref).to(torch.bfloat16)
    ours.set_attn_implementation(attn)
    return ref, sdpa, ours


def _batch() -> tuple[Any, Any]:
    width = max(LENGTHS)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 257, (len(LENGTHS), width), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        mask[row, width - n:] = 1
    return ids.masked_fill(mask == 0, 0).cuda(), mask.cuda()


@pytest.fixture
def name_registered(default_lib):
    import aotriton_rt.integrations.transformers as hf

    return hf.register(library=default_lib)


def _err(a: Any, b: Any) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_padded_logits_and_gradients_are_as_close_to_fp32_as_sdpa(name_registered: str, name: str) -> None:
    _check_padded(name, name_registered, gradients=name not in INFERENCE_ONLY)


def test_gemma2_trains_on_the_softcap_backward_of_the_gputest_images(gpu_images) -> None:
    """Gemma 2 27B's attention (head dim 128, cap 50, a window on alternate layers) in training:
    logits and loss gradients of a left-padded batch as close to fp32 as bf16 eager attention,
    on the gputest images' softcap backward (the default images hold its forward only)."""
    import aotriton_rt
    import aotriton_rt.integrations.transformers as hf

    try:
        _check_padded("gemma2_softcap_d128", hf.register(library=aotriton_rt.Library(gpu_images)), gradients=True)
    finally:
        hf.register(library=None)


def _check_padded(name: str, attn: str, gradients: bool) -> None:
    """Logits on the real tokens of a left-padded batch (and with ``gradients`` the loss's
    gradients) as close to the fp32 reference as bf16 SDPA's (eager: :data:`REFERENCE`)."""
    ref, sdpa, ours = _models(name, attn)
    ids, mask = _batch()
    real = mask.bool()
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits[real]
        base = _err(sdpa(ids, attention_mask=mask).logits[real], want)
        got = _err(ours(ids, attention_mask=mask).logits[real], want)
    assert got <= 2 * base + 1e-2, f"logits: ours {got:.3g} from fp32, bf16 SDPA {base:.3g}"
    if not gradients:
        return
    # Labels on real tokens, and not on a row's first one: the causal LM shifts them, so that one is
    # predicted from the last padded position, whose query sees no key. Such a row's output is
    # whatever an implementation defines (eager attention averages every value, ours is 0), so its
    # loss term would compare definitions, not arithmetic.
    after_pad = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1) == 0
    labels = ids.masked_fill((mask == 0) | after_pad, -100)
    grads = []
    for model in (ref, sdpa, ours):
        model.train()
        model.zero_grad()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    worst = []
    for n, g in grads[0].items():
        scale = g.abs().max().item() or 1.0
        base, got = _err(grads[1][n], g) / scale, _err(grads[2][n], g) / scale
        if got > 2 * base + 2e-2:
            worst.append(f"{n}: ours {got:.3g}, bf16 SDPA {base:.3g} (relative to the largest)")
    assert not worst, "\n".join(worst)


@pytest.mark.parametrize("name", DECODERS)
def test_packed_sequences_match_each_sequence_alone(name_registered: str, name: str) -> None:
    _, _, ours = _models(name, name_registered)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 257, (1, sum(LENGTHS)), generator=gen).cuda()
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None].cuda()
    with torch.no_grad():
        got = ours(ids, position_ids=position_ids).logits
        starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
        want = torch.cat([ours(ids[:, a:a + n]).logits for a, n in zip(starts, LENGTHS)], 1)
    err = _err(got, want)
    assert err <= 0.05 * want.abs().max().item(), f"packed vs alone: {err:.3g}"


def _forced(model: Any, ids: Any, mask: Any, tokens: Any) -> Any:
    """The greedy token ``model`` picks at each step of a cached generation that is fed
    ``tokens`` (another model's generation): one choice per step, never a cascade of them."""
    out = model(ids, attention_mask=mask, use_cache=True)
    picks = [out.logits[:, -1].argmax(-1)]
    for t in range(tokens.shape[1] - 1):
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        out = model(tokens[:, t:t + 1], attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
        picks.append(out.logits[:, -1].argmax(-1))
    return torch.stack(picks, 1)


@pytest.mark.parametrize("name", DECODERS)
def test_greedy_generation_of_a_left_padded_batch_agrees_with_sdpa(name_registered: str, name: str) -> None:
    # A random model's next-token logits are nearly flat: one rounding-level flip (bf16 SDPA
    # against fp32 SDPA flips some too) changes every later token of a free-running generation.
    # So each step's greedy choice is compared on the same prefix (SDPA's generation fed to both,
    # through the cache and the padding mask), and the free-running agreement is reported.
    _, sdpa, ours = _models(name, name_registered)
    ids, mask = _batch()
    kw = {"max_new_tokens": 32, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        want = sdpa.generate(ids, attention_mask=mask, **kw)[:, ids.shape[1]:]
        got = ours.generate(ids, attention_mask=mask, **kw)[:, ids.shape[1]:]
        steps = (_forced(ours, ids, mask, want) == _forced(sdpa, ids, mask, want)).float().mean().item()
    free = (got == want).float().mean().item()
    print(f"{name}: greedy choices on SDPA's prefix agree {steps:.1%}, free-running generations {free:.1%} "
          f"of {got.numel()} tokens")
    assert steps >= 0.95, f"{steps:.1%} of greedy choices agree with SDPA's on the same prefix"
