"""aotriton-rt as a Hugging Face transformers attention implementation.

One call registers it::

    import aotriton_rt.integrations.transformers as aot_hf
    name = aot_hf.register()                       # "aotriton"
    model = LlamaForCausalLM(config, attn_implementation=name)   # or model.set_attn_implementation(name)

The attention function follows transformers' ``AttentionInterface`` contract (``(module, query,
key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs) -> (output,
None)`` with ``(B, H, S, D)`` inputs and a ``(B, S, H, D)`` output) and is registered with
transformers' SDPA mask builder (``AttentionMaskInterface``), so the model hands it the masks it
hands SDPA:

- **No mask** (no padding): causal prefill when the layer is causal and more than one query row
  is given (keys past the queries, the unused tail of an empty static cache, are cropped as
  SDPA does); a single query row (decoding with the cache) sees every cached key and runs on
  the split-KV decode kernels (``aotriton_rt.attention`` routes 1..16 query rows there).
- **A boolean or additive mask** (padded batches, sliding windows, static caches): an additive
  bias broadcast over the heads (-inf where the boolean mask is False). Query rows that see no
  key output 0 (SDPA would give NaN or a uniform average for them; they are padding).

GQA runs natively (K/V are not repeated). Training works (gradients through the autograd op
``aotriton_rt.ops.torch.attention``), with the module's dropout.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NAME", "attention_forward", "register"]

NAME = "aotriton"
_LIBRARY: dict[str, Any] = {"library": None}


def attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None, **kwargs: Any) -> tuple[Any, None]:
    """transformers ``AttentionInterface`` function on aotriton-rt: ``(attn_output (B, S, H, D), None)``."""
    import torch

    from ..errors import UnsupportedError
    from ..ops.torch import attention

    if kwargs.get("softcap") is not None:
        raise UnsupportedError("aotriton attention does not support softcap; use eager or flex_attention")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise UnsupportedError("aotriton attention does not support attention sinks; use eager")
    if kwargs.get("position_bias") is not None:
        raise UnsupportedError("aotriton attention does not take a position_bias; use sdpa")
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    bias = None
    if attention_mask is None:
        causal = bool(causal) and q_len > 1
        if causal and key.shape[2] > q_len:
            # Only an empty static cache gives no mask here: its keys past the queries are unused.
            key, value = key[:, :, :q_len], value[:, :, :q_len]
    else:
        causal = False
        mask = attention_mask[:, :, :, : key.shape[2]]
        if mask.dtype == torch.bool:
            bias = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~mask, float("-inf"))
        else:
            bias = mask.to(query.dtype)
    # (B, H, S, D) views read as BSHD: the output comes back (B, S, H, D), contiguous, as transformers wants it.
    q, k, v = query.transpose(1, 2), key.transpose(1,2), value.transpose(1, 2)
    dropout_p = float(dropout) if module.training else 0.0
    lib = _LIBRARY["library"]
    inference = not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
    if inference and not torch.compiler.is_compiling():
        # Generation: the core operators directly, without the autograd op's dispatch. Decoding
        # steps (no mask, 1..16 query rows) go straight to the decode kernels' cached launch plan.
        from ..errors import ArgumentError, KernelNotFound
        from ..ops import attention as core
        from ..ops.decode import MAX_SEQLEN_Q, decode_attention

        if bias is None and q_len <= MAX_SEQLEN_Q:
            try:
                return decode_attention(q, k, v, causal=causal, scale=scaling, layout="bshd", cache_layout="bshd",
                                        library=lib)[0], None
            except (ArgumentError, UnsupportedError, KernelNotFound):
                pass  # not a decode shape for these images: the general path below
        if dropout_p == 0.0:
            return core.attention(q, k, v, causal=causal, align="bottom_right", bias=bias, scale=scaling,
                                  layout="bshd", library=lib)[0], None
    out = attention(q, k, v, causal=causal, align="bottom_right", bias=bias, dropout_p=dropout_p, scale=scaling,
                    layout="bshd", library=lib)
    return out, None


def register(name: str = NAME, *, library: Any = None) -> str:
    """Register aotriton-rt with transformers under ``name`` (attention and mask functions).

    Pass the returned name as ``attn_implementation`` (``from_pretrained``, a model's
    constructor, or ``model.set_attn_implementation``). ``library``: the
    :class:`aotriton_rt.Library` to launch from (default: :func:`aotriton_rt.default_library`).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    _LIBRARY["library"] = library
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
