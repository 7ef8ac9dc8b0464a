"""Kernel injection's decode loop: HF's greedy / sampling loop, less its per-token bookkeeping.

HF's `generate` prepares everything (generation config, logits processors, stopping criteria, the static KV cache)
and then runs `GenerationMixin._sample`, whose loop rebuilds every step's model inputs in Python: it grows the 2-D
attention mask and position ids by `torch.cat`, slices and clones the last token, and turns the mask into the
static cache's 4-D one (`prepare_inputs_for_generation`, `_update_model_kwargs_for_generation`,
`create_masks_for_generate`) - about half of the 0.85 ms between two compiled steps of a 124M GPT-2 here.
`decode_loop`, given to HF's `generate` as its `custom_generate` callable (HF's own hook for replacing the
decoding loop; `with_decode_loop` adds it to greedy and sampling calls), takes HF's inputs for the first decode
step and then advances them itself: the new token as input_ids, position ids + 1, and in the 4-D mask [batch, 1,
1, cache length] the new token's column set to the previous token's (in place). At the second step it checks its
inputs against HF's own (`prepare_inputs_for_generation`); where they differ (a model whose inputs advance
otherwise) it keeps HF's bookkeeping for the rest of the call (`decode_loop_calls["checked_out"]`). The compiled
step sees the same tensors HF's loop would pass it. Token selection, logits processors, stopping criteria and the
padding of finished sequences are `_sample`'s, line for line, so the tokens (and, sampling, the random draws) are
HF's. Measured on a 124M GPT-2 (prompt 128, 128 new tokens, one process, HF's loop and this one interleaved):
between two compiled steps 0.85 -> 0.42 ms at batch 1 (0.967x per token), 1.20 -> 0.71 ms at batch 8 (0.970x)
(bench/README.md, session 32). Under kernel injection two more cuts (session 33): the step's mask is cut to the
cache's filled positions (`prefix_attention`: its attention reads no unwritten keys and values), and from the third
step the step is called as `again` (`FrozenCompiledCall`: dynamo's guards skipped while the arguments keep the
guarded call's shapes).

Anything else keeps HF's own loop (`_sample`, or the mode's method): beam search, assisted decoding, a
streamer, `return_dict_in_generate`, `synced_gpus`, an encoder-decoder model, model inputs other than the
mask, position ids and cache (e.g. `token_type_ids`, pixel values), a cache that is not entirely full-attention
static layers (sliding windows), or a transformers without `_prefill`.
"""
from __future__ import annotations

import functools
import inspect

import torch

from . import prefix_attention

__all__ = ["decode_loop", "with_decode_loop", "decode_loop_calls"]

# model inputs the loop knows how to advance by one token (anything else: HF's loop)
_STEP_INPUTS = frozenset({"attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "logits_to_keep"})
# generate()'s own arguments that need HF's loop whatever their value (anything but None / False): HF hands a
# callable `custom_generate` none of streamer / synced_gpus / assistant_model (only the callable's extra keywords),
# so such calls must not get the hook at all; decode_loop's own streamer / synced_gpus checks are for direct calls
_HF_LOOP_ARGS = ("streamer", "assistant_model", "synced_gpus", "custom_generate", "prefix_allowed_tokens_fn",
                 "negative_prompt_ids")
decode_loop_calls = {"fast": 0, "hf": 0, "checked_out": 0}  # how often each loop ran (tests read it)


def _plain_sampling(model, kwargs: dict) -> bool:
    """Whether a `generate(**kwargs)` call decodes greedily or by plain sampling (HF's `_sample`), so the loop
    may take it. HF's own `_prepare_generation_config` decides (it copies the config, nothing changes); any
    error is left for HF's `generate` to raise."""
    if any(kwargs.get(k) not in (None, False) for k in _HF_LOOP_ARGS):
        return False
    try:
        from transformers.generation.configuration_utils import GenerationMode

        named = _generate_parameters(type(model))
        rest = {k: v for k, v in kwargs.items() if k not in named}
        config, _ = model._prepare_generation_config(kwargs.get("generation_config"), **rest)
        mode = config.get_generation_mode(None)
    except Exception:  # noqa: BLE001 - HF's generate raises its own error for the same input
        return False
    return mode in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


@functools.cache
def _generate_parameters(cls) -> frozenset:
    return frozenset(inspect.signature(cls.generate).parameters) | {"trust_remote_code"}


def with_decode_loop(module) -> None:
    """Make `module.generate` (this instance's) run `decode_loop` for greedy and sampling calls given by keyword
    (`generate(input_ids, max_new_tokens=..., ...)`); every other call is HF's unchanged."""
    generate = module.generate

    @functools.wraps(generate)
    def wrapped(*args, **kwargs):
        if len(args) <= 1 and _plain_sampling(module, kwargs):
            kwargs["custom_generate"] = decode_loop
        return generate(*args, **kwargs)

    module.generate = wrapped


def _static_full_attention(cache) -> bool:
    from transformers.cache_utils import StaticLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is StaticLayer for layer in layers)


def decode_loop(model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config,
                synced_gpus: bool = False, streamer=None, **model_kwargs) -> torch.LongTensor:
    """HF's `_sample` (greedy or multinomial sampling) over a static cache, its step inputs advanced in place, as a
    `custom_generate` callable. input_ids: [batch, prompt] token ids; returns [batch, prompt + new] (what
    `_sample` returns without `return_dict_in_generate`). Falls back to `_sample` itself where it cannot apply
    (see the module docstring)."""
    cache_key = "cache" if "cache" in model_kwargs else "past_key_values"
    cache = model_kwargs.get(cache_key)
    mask = model_kwargs.get("attention_mask")
    fast = (not synced_gpus and streamer is None and not generation_config.return_dict_in_generate
            and not model.config.is_encoder_decoder and not generation_config.is_assistant
            and hasattr(model, "_prefill") and hasattr(model, "_optimize_model_for_decode")
            and set(model_kwargs) <= _STEP_INPUTS
            and model_kwargs.get("use_cache", True) and _static_full_attention(cache)
            and (mask is None or mask.ndim == 2))
    if not fast:
        decode_loop_calls["hf"] += 1
        from transformers.generation.utils import GenerationMixin

        return GenerationMixin._sample(model, input_ids, logits_processor=logits_processor,
                                       stopping_criteria=stopping_criteria, generation_config=generation_config,
                                       synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
    decode_loop_calls["fast"] += 1
    pad = generation_config._pad_token_tensor
    has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    batch, device = input_ids.shape[0], input_ids.device
    forward = (model.get_compiled_call(generation_config.compile_config)
               if model._valid_auto_compile_criteria(model_kwargs, generation_config) else model.__call__)
    outputs = model._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=True)
    unfinished = torch.ones(batch, dtype=torch.long, device=device)
    if pad is not None:
        pad = pad.to(device)
    inputs, step, hf_steps = None, 0, False  # this step's model inputs; decode steps run; HF's bookkeeping on
    prefix = getattr(model.config, "_attn_implementation", None) == prefix_attention.NAME  # attend the filled part
    again = getattr(forward, "again", None)  # kernel injection's compiled step: guards skipped when unchanged
    aot = forward.aot_step if getattr(forward, "aot", False) else None  # ... or as an AOTInductor package
    with model._optimize_model_for_decode():
        while True:
            if step < 2 or hf_steps:  # HF's own bookkeeping (until the second step's check)
                model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs,
                                                                         is_encoder_decoder=False)
            logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=device)
            del outputs
            scores = logits_processor(input_ids, logits)
            if generation_config.do_sample:
                nxt = torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                nxt = torch.argmax(scores, dim=-1)
            if has_eos:
                nxt = nxt * unfinished + pad * (1 - unfinished)
            input_ids = torch.cat([input_ids, nxt[:, None]], dim=-1)
            unfinished = unfinished & ~stopping_criteria(input_ids, scores)
            if unfinished.max() == 0:
                return input_ids
            if step == 0 or hf_steps:
                inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=1, **model_kwargs)
            else:
                inputs = _advance(inputs, nxt, input_ids.shape[1] - 1)
                if step == 1:  # the second step: ours against HF's own
                    hf = model.prepare_inputs_for_generation(input_ids, next_sequence_length=1, **model_kwargs)
                    if not _same(inputs, hf):  # this model's inputs do not advance so: HF's bookkeeping from here
                        inputs, hf_steps = hf, True
                        decode_loop_calls["fast"] -= 1
                        decode_loop_calls["checked_out"] += 1
            call = again if again is not None and step >= 2 and not hf_steps else forward
            step_inputs = _filled(inputs, input_ids.shape[1] - 1) if prefix and not hf_steps else inputs
            outputs = (aot(step_inputs, input_ids.shape[1] - 1, full=step < 2)
                       if aot is not None and prefix and not hf_steps else None)
            if outputs is None:
                outputs = call(**step_inputs, return_dict=True)
            step += 1


def _advance(inputs: dict, nxt: torch.Tensor, column: int) -> dict:
    """The next decode step's model inputs from this one's (HF's `prepare_inputs_for_generation` output): the new
    tokens nxt [batch] as input_ids [batch, 1], position ids + 1, and in the static cache's 4-D mask [batch, 1, 1,
    cache length] the new token's column (`column`, its index in the cache) set to the previous token's, which
    every row attends (bool or additive masks alike; written in place)."""
    out = dict(inputs)
    out["input_ids"] = nxt[:, None]
    if out.get("position_ids") is not None:
        out["position_ids"] = out["position_ids"] + 1
    mask = out.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.ndim == 4:
        mask[..., column] = mask[..., column - 1]
    return out


def _filled(inputs: dict, position: int) -> dict:
    """The step's inputs with the 4-D mask [batch, 1, 1, cache length] cut to the positions written so far,
    rounded up (`prefix_attention.filled_length`; the new token's at `position`), its length marked dynamic."""
    mask = inputs.get("attention_mask")
    if not (isinstance(mask, torch.Tensor) and mask.ndim == 4):
        return inputs
    length = prefix_attention.filled_length(position, mask.shape[-1])
    return {**inputs, "attention_mask": prefix_attention.mark_length_dynamic(mask[..., :length])}


def _same(ours: dict, hf: dict) -> bool:
    """Whether two model-input dicts hold the same keys and values (tensors: shape, dtype and elements)."""
    if ours.keys() != hf.keys():
        return False
    for key, a in ours.items():
        b = hf[key]
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                    and a.dtype == b.dtype and torch.equal(a, b)):
                return False
        elif a is not b and a != b:
            return False
    return True
