"""Decode-step attention over the filled part of a static KV cache only.

HF's static cache holds [batch, kv heads, max length, head dim] keys and values per layer, and its SDPA attention
reads all `max length` positions every token, the ones not yet written masked out. Under kernel injection the
decode loop passes the step a 4-D mask cut to the filled positions rounded up to `BUCKET` ([batch, 1, 1,
length]); the attention registered here as `NAME` (HF's `AttentionInterface`; the mask functions are SDPA's)
cuts the keys and values to the mask's length and calls HF's own SDPA attention. The positions cut are masked
in the full mask, so the result is the same attention (summed over fewer masked terms). The compiled decode step
takes the length as a dynamic dimension (`mark_length_dynamic`), so one graph serves every length.

Measured on the 124M GPT-2, prompt 128 + 256 new tokens (a 385-position cache), one process, the same compiled
step with the mask cut and with the whole cache, interleaved: batch 8 0.940x the time per token (6 pairs, faster
in 5: its keys and values are 45% of the weights' bytes at full length), batch 1 0.977x (10 pairs, faster in 6;
6%) (bench/README.md, session 33).

A prompt's eager forward (the prefill) is cut as well where HF passes a 4-D mask (padded prompts; an unpadded
prompt gets none and SDPA's causal kernel): to the last position any query may attend (`attended_length`).
Measured (124M GPT-2, 4 left-padded prompts of 128 tokens, a 385-position cache, 12 interleaved rounds of
`generate(max_new_tokens=1)`): 0.946x the time to first token, identical logits (session 38).
"""
from __future__ import annotations

import torch

__all__ = ["NAME", "BUCKET", "SPARE", "register", "filled_length", "mark_length_dynamic", "attended_length"]

NAME = "zerospeed_sdpa"
BUCKET = 32  # positions: the mask's length is a multiple of this (or the cache's length), so few distinct shapes
SPARE = 1  # positions kernel injection adds to each static cache, so that the cut never takes the whole cache


def attended_length(mask: torch.Tensor) -> int:
    """1 + the last position (mask's last dimension) any query may attend in a 4-D mask [batch, 1, queries,
    positions] (bool: True attends; float: 0 attends, the dtype's minimum or -inf does not); the mask's length
    when none may. One host sync (~50 us for a [4, 1, 128, 385] mask on the host: ~0.1% of that prefill's layers)."""
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
    cols = allowed.flatten(0, -2).any(0)
    return int(cols.nonzero().max()) + 1 if bool(cols.any()) else mask.shape[-1]


def _attention(module, query, key, value, attention_mask, **kwargs):
    """HF's SDPA attention over the first attention_mask.shape[-1] positions of key / value [batch, kv heads,
    positions, head dim] (all of them where the mask is not 4-D or not shorter). A prompt's forward outside
    compilation (several queries: the eager prefill over the whole static cache) is cut further, to the positions
    its mask lets any query attend (`attended_length`): the cache's unwritten tail is masked out anyway, and a
    128-token prompt in a 385-position cache otherwise scores 3x the positions it attends."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 4:
        n = attention_mask.shape[-1]
        if query.shape[-2] > 1 and not torch.compiler.is_compiling():
            n = attended_length(attention_mask)
            attention_mask = attention_mask[..., :n]
        key, value = key[:, :, :n], value[:, :, :n]
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> str:
    """Register the attention under `NAME` with HF (idempotent) and return the name for
    `set_attn_implementation`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def filled_length(position: int, cache_length: int) -> int:
    """The mask length for a step writing cache position `position` (0-based): position + 1 rounded up to
    `BUCKET`, below cache_length unless the position is the cache's last. Kept below the cache's length because
    a cut of every position is contiguous and the rest are not, and the compiled step guards on that (a second
    graph); kernel injection's caches have a spare last position for it (`SPARE`)."""
    length = -(-(position + 1) // BUCKET) * BUCKET
    if length < cache_length:
        return length
    return cache_length - 1 if position + 1 < cache_length else cache_length


def mark_length_dynamic(mask: torch.Tensor) -> torch.Tensor:
    """The mask with its last dimension (the positions) marked dynamic for torch.compile (where dynamo can keep it
    so; otherwise a recompile per length), returned for chaining."""
    torch._dynamo.maybe_mark_dynamic(mask, mask.ndim - 1)
    return mask
