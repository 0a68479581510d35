"""aotriton-rt as a Hugging Face transformers attention implementation.

One call registers it::

    import aotriton_rt.integrations.transformers as aot_hf
    name = aot_hf.register()                       # "aotriton"
    model = LlamaForCausalLM(config, attn_implementation=name)   # or model.set_attn_implementation(name)

The attention function follows transformers' ``AttentionInterface`` contract (``(module, query,
key, value, attention_mask, dropout=0.0, scaling=None, **kwargs) -> (output, None)`` with
``(B, H, S, D)`` inputs and a ``(B, S, H, D)`` output). Its mask function is the one transformers
uses for FlashAttention: the model hands over the 2-D padding mask, or nothing when no token is
padding. Padding therefore never becomes a dense bias:

- **Padded batches** (left or right padding, prefill, training, generation): the real tokens are
  gathered into packed ``(total, H, D)`` arrays with ``cu_seqlens`` (one gather per array; the
  lengths are read once per forward pass, not per layer), attention runs on the variable-length
  kernels, and the output is scattered back with zeros at padded query positions. Queries align
  bottom-right with their keys per sequence, so a cached prefix is seen by every new token.
  Decoding steps of a left-padded batch (1..16 new rows, no gradient) skip the gathers: the
  split-KV decode kernels read the cache in place from each row's first real column
  (``cache_leftpad``).
- **Packed sequences** (``DataCollatorWithFlattening``: ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` keywords, or ``position_ids`` that restart within a single row): the
  variable-length kernels on the flattened batch, no cross-sequence attention.
- **No padding**: causal attention, bottom-right aligned (rows after a cached prefix see it);
  1..16 query rows (decoding with the cache) run on the split-KV decode kernels.
- **Sliding windows** (Mistral, Qwen2, Gemma local layers; the ``sliding_window`` keyword): the
  kernels' window, ``sliding_window - 1`` keys to the left.
- **Encoders** (BERT-style, ``is_causal=False``) with a padding mask: as padded batches, without
  the causal mask.
- **A 4-D mask the model was given** (anything but padding): an additive bias, which needs the
  bias kernels (``--set full`` images); KernelNotFound says so when the images lack them.

GQA runs natively (K/V are not repeated). Training works (gradients through the autograd op
``aotriton_rt.ops.torch.attention``, and through the gathers), with the module's dropout.

ALiBi models (BLOOM, MPT, Falcon with ``alibi``) never reach this function: transformers computes
their attention in the models' own modules (BLOOM's ``baddbmm`` over its alibi tensor, Falcon's
alibi added to a 4-D mask) and passes no slopes to an attention implementation. Call
``aotriton_rt.attention(..., alibi_slopes=...)`` for them directly.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["NAME", "attention_forward", "register"]

NAME = "aotriton"
_LIBRARY: dict[str, Any] = {"library": None}


class _Lengths:
    """Where a padding mask's real tokens are: flat indices, per-row (batch, position) indices,
    ``cu_seqlens`` and the longest sequence (read from the device once); each row's first real
    column if the mask is a pure left padding (:meth:`left_starts`, asked by decoding steps only)."""

    __slots__ = ("keep", "lens", "batch", "pos", "cu", "max_len", "total", "_starts")

    def __init__(self, mask: Any) -> None:
        import torch

        keep = mask if mask.dtype == torch.bool else mask != 0
        lens = keep.sum(-1, dtype=torch.int32)
        flat = torch.nonzero(keep.reshape(-1)).flatten()
        width = keep.shape[-1]
        self.keep, self.lens = keep, lens
        self.batch, self.pos = flat // width, flat % width
        self.cu = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
        self.max_len = int(lens.max()) if lens.numel() else 0
        self.total = int(flat.numel())
        self._starts: Any = ...  # not asked yet

    def left_starts(self) -> Any:
        """Each row's first real column (int32) when every row is zeros then ones, else None;
        one device read, on first use."""
        if self._starts is ...:
            import torch

            width = self.keep.shape[-1]
            starts = (width - self.lens).to(torch.int32)
            columns = torch.arange(width, device=self.keep.device)
            self._starts = starts if torch.equal(self.keep, columns[None, :] >= starts[:, None]) else None
        return self._starts


class _LengthsCache(threading.local):
    """The last masks' lengths, per thread: every layer of one forward pass gets the same mask
    tensor, so its lengths (one device read) are computed once. Keyed by the tensor itself
    (weakly) and its version counter, so a mask changed in place is read again."""

    def __init__(self) -> None:
        self.entries: list[tuple[Any, int, tuple, _Lengths]] = []

    def get(self, mask: Any, columns: int) -> _Lengths:
        """The lengths of the last ``columns`` columns of ``mask``."""
        version = mask._version
        for ref, ver, cols, lengths in self.entries:
            if ref() is mask and ver == version and cols == columns:
                return lengths
        lengths = _Lengths(mask[:, -columns:] if columns != mask.shape[-1] else mask)
        self.entries = [(weakref.ref(mask), version, columns, lengths), *self.entries[:3]]
        return lengths


_CACHE = _LengthsCache()


def _cu_from_positions(position_ids: Any) -> tuple[Any, int]:
    """cu_seqlens of one flattened row of packed sequences: a new one starts where the position
    id returns to its smallest value (0, or padding_idx + 1 for RoBERTa-like models)."""
    import torch

    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == pos.min()).flatten().to(torch.int32)
    cu = torch.cat((starts, torch.tensor([pos.numel()], dtype=torch.int32, device=pos.device)))
    return cu, int((cu[1:] - cu[:-1]).max())


def _packed(position_ids: Any, batch: int) -> bool:
    """Whether ``position_ids`` describe several sequences packed into one row."""
    import torch

    if position_ids is None or batch != 1 or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return False
    expect = torch.arange(position_ids.shape[1], device=position_ids.device) + position_ids.min()
    return bool((expect != position_ids[0]).any())


def _gather(x: Any, lengths: _Lengths) -> Any:
    """The real tokens of a ``(B, H, S, D)`` array as packed ``(total, H, D)``: one gather."""
    return x.transpose(1, 2)[lengths.batch, lengths.pos]


def attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                      scaling: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, **kwargs: Any) -> tuple[Any, None]:
    """transformers ``AttentionInterface`` function on aotriton-rt: ``(attn_output (B, S, H, D), None)``."""
    import torch

    from ..errors import UnsupportedError

    if kwargs.get("position_bias") is not None:
        raise UnsupportedError("aotriton attention does not take a position_bias; use sdpa")
    batch, _, q_len, _ = query.shape
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = None
    if sliding_window is not None and sliding_window > 0:
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    dropout_p = float(dropout) if module.training else 0.0
    # gpt-oss passes its per-head sink logits as ``s_aux``.
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    call = {"causal": causal, "window": window, "scale": scaling, "dropout_p": dropout_p, "sinks": sinks,
            "softcap": softcap or None}

    if attention_mask is not None and attention_mask.dim() == 2:
        return _padded(query, key, value, attention_mask, call), None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if attention_mask is None and (cu_q is not None and cu_k is not None or _packed(kwargs.get("position_ids"), batch)):
        return _flattened(query, key, value, kwargs, call), None

    bias = None
    if attention_mask is None:
        # No padding and every key written: a single query row sees them all; more rows see the
        # keys up to their own position (bottom-right: a cached prefix is seen by every row).
        causal = causal and q_len > 1
    else:
        # A 4-D mask the caller built (not padding): an additive bias over the heads.
        causal = False
        mask = attention_mask[:, :, :, : key.shape[2]]
        if mask.dtype == torch.bool:
            bias = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~mask, float("-inf"))
        else:
            bias = mask.to(query.dtype)
    call["causal"] = causal
    # (B, H, S, D) views read as BSHD: the output comes back (B, S, H, D), contiguous, as transformers wants it.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if bias is None:
        # Decoding steps (no mask, 1..16 query rows) go straight to the decode kernels' cached plan.
        out = _decode(q, k, v, call)
        if out is not None:
            return out, None
    return _run(q, k, v, call, bias=bias), None


def _inference(*arrays: Any) -> bool:
    import torch

    return (not (torch.is_grad_enabled() and any(a is not None and a.requires_grad for a in arrays))
            and not torch.compiler.is_compiling())


def _run(q: Any, k: Any, v: Any, call: dict, **varlen: Any) -> Any:
    """One attention call, bottom-right aligned: the core operator when nothing needs a gradient
    (and no dropout), else the autograd op."""
    lib = _LIBRARY["library"]
    layout = "bshd" if q.dim() == 4 else "bhsd"
    if call["dropout_p"] == 0.0 and _inference(q, k, v, call["sinks"]):
        from ..ops import attention as core

        return core.attention(q, k, v, causal=call["causal"], window=call["window"], align="bottom_right",
                              scale=call["scale"], layout=layout, sinks=call["sinks"], softcap=call["softcap"],
                              library=lib, **varlen)[0]
    from ..ops.torch import attention

    return attention(q, k, v, causal=call["causal"], window=call["window"], align="bottom_right",
                     dropout_p=call["dropout_p"], scale=call["scale"], layout=layout, sinks=call["sinks"],
                     softcap=call["softcap"], library=lib, **varlen)


def _padded(query: Any, key: Any, value: Any, mask: Any, call: dict) -> Any:
    """A batch with padding (``mask``: ``(B, L)``, true or nonzero at real tokens; the last ``L``
    keys are the ones it describes, the last ``S_q`` of its columns the queries)."""
    import torch

    batch, heads, q_len, _ = query.shape
    width = mask.shape[-1]
    if key.shape[2] > width:
        # A static cache longer than what has been written: its tail is unused.
        key, value = key[:, :, :width], value[:, :, :width]
    elif key.shape[2] < width:
        mask = mask[:, -key.shape[2]:]  # a sliding-window cache keeps the last keys
        width = key.shape[2]
    keys = _CACHE.get(mask, width)
    if q_len < width:
        starts = keys.left_starts()
        out = None if starts is None else _left_padded_decode(query, key, value, starts, call)
        if out is not None:
            return out
    queries = keys if q_len == width else _CACHE.get(mask, q_len)
    q, k, v = _gather(query, queries), _gather(key, keys), _gather(value, keys)
    out = _run(q, k, v, call, cu_seqlens_q=queries.cu, cu_seqlens_k=keys.cu, max_seqlen_q=queries.max_len,
               max_seqlen_k=keys.max_len)
    full = torch.zeros((batch, q_len, heads, out.shape[-1]), dtype=out.dtype, device=out.device)
    full[queries.batch, queries.pos] = out
    return full


def _decode(q: Any, k: Any, v: Any, call: dict, **lengths: Any) -> Any:
    """A decoding step (1..ROUTED_SEQLEN_Q query rows of ``(B, S, H, D)`` views against the
    cache) on the decode kernels, with the cache read in place, ``lengths`` as
    :func:`aotriton_rt.ops.decode.decode_attention` takes them; the output ``(B, S, H, D)``; a
    softcap (Gemma 2) and sinks (gpt-oss) go along. None when it cannot run there (a gradient or
    dropout to honour, a shape or images the decode kernels refuse, e.g. a softcap on images
    built before the decode kernel took it): the caller's general path then serves."""
    from ..errors import ArgumentError, KernelNotFound, UnsupportedError
    from ..ops.decode import ROUTED_SEQLEN_Q, decode_attention

    sinks = call["sinks"]
    if q.shape[1] > ROUTED_SEQLEN_Q or call["dropout_p"] != 0.0 or not _inference(q, k, v, sinks):
        return None
    try:
        return decode_attention(q, k, v, causal=call["causal"], window=call["window"], scale=call["scale"],
                                softcap=call["softcap"], layout="bshd", cache_layout="bshd", sinks=sinks,
                                library=_LIBRARY["library"], **lengths)[0]
    except (ArgumentError, UnsupportedError, KernelNotFound):
        return None


def _left_padded_decode(query: Any, key: Any, value: Any, starts: Any, call: dict) -> Any:
    """A decoding step of a left-padded batch (new rows after a cached prefix; ``starts``: each
    row's first real column): the decode kernels on the cache in place (``cache_leftpad``),
    nothing gathered; None where :func:`_decode` declines."""
    import torch

    q_len, width = query.shape[2], key.shape[2]
    # (B, H, S, D) views read as BSHD: the output comes back (B, S, H, D), as transformers wants it.
    out = _decode(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), call, cache_seqlens=width,
                  cache_leftpad=starts)
    if out is not None and q_len > 1:
        # Queries at padded columns output zeros (causal rows there already see no key).
        real = (width - q_len + torch.arange(q_len, device=out.device))[None, :] >= starts[:, None]
        out.masked_fill_(~real[:, :, None, None], 0)
    return out


def _flattened(query: Any, key: Any, value: Any, kwargs: dict, call: dict) -> Any:
    """Packed sequences in one row: the variable-length kernels over the flattened batch."""
    import torch

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = int(max_q) if max_q is not None else int((cu_q[1:] - cu_q[:-1]).max())
        max_k = int(max_k) if max_k is not None else int((cu_k[1:] - cu_k[:-1]).max())
    else:
        cu_q, max_q = _cu_from_positions(kwargs["position_ids"])
        cu_k, max_k = cu_q, max_q
    batch, heads, q_len, _ = query.shape
    q = query.transpose(1, 2).reshape(-1, heads, query.shape[-1])
    k = key.transpose(1, 2).reshape(-1, key.shape[1], key.shape[-1])
    v = value.transpose(1, 2).reshape(-1, value.shape[1], value.shape[-1])
    out = _run(q, k, v, call, cu_seqlens_q=cu_q.to(torch.int32), cu_seqlens_k=cu_k.to(torch.int32),
               max_seqlen_q=max_q, max_seqlen_k=max_k)
    return out.reshape(batch, q_len, heads, out.shape[-1])


def _mask_function() -> Any:
    """transformers' FlashAttention mask function (the 2-D padding mask, or None without padding)."""
    from transformers import masking_utils

    return masking_utils.flash_attention_mask


def register(name: str = NAME, *, library: Any = None) -> str:
    """Register aotriton-rt with transformers under ``name`` (attention and mask functions).

    Pass the returned name as ``attn_implementation`` (``from_pretrained``, a model's
    constructor, or ``model.set_attn_implementation``). ``library``: the
    :class:`aotriton_rt.Library` to launch from (default: :func:`aotriton_rt.default_library`).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    _LIBRARY["library"] = library
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, _mask_function())
    return name
