"""Kernel injection's decode loop (`inference/decode.py`): the calls it takes give HF's own tokens, the rest
run HF's loop.

An injected tiny GPT-2 (fp32; and a Llama for greedy and sampling) against the plain model, same weights: greedy over left-padded prompts, sampling
under the same seed (the loop draws as `_sample` does), an end-of-sequence token that finishes rows early
(padded after it, the call ends when every row has); beam search, `return_dict_in_generate` and a streamer
take HF's loop, with HF's results.
"""
import pytest
import torch

import zerospeed
from zerospeed.inference.decode import decode_loop_calls
from zerospeed.testing.models import tiny_hf_gpt2, tiny_hf_llama

pytest.importorskip("transformers")


def _injected(build, aot: bool = True):
    """(the plain model, the injected model's module), same weights; aot=False: the `torch.compile` decode step
    (`ZEROSPEED_AOT_DECODE=0`) instead of the AOTInductor package."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZEROSPEED_AOT_DECODE", "1" if aot else "0")
        engine = zerospeed.init_inference(build().eval(), dtype=torch.float32, replace_with_kernel_inject=True)
    return build().eval(), engine.module


@pytest.fixture(scope="module")
def models():
    return _injected(tiny_hf_gpt2)


@pytest.fixture(scope="module")
def compiled_models():
    """`models` with the `torch.compile` decode step: what the tests of its guards and graphs read."""
    return _injected(tiny_hf_gpt2, aot=False)


def _prompt(seed=3):
    ids = torch.randint(1, 256, (3, 10), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :2] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _both(models, seed=None, **kw):
    """(plain model's output, injected model's output, how many calls the fast loop took)."""
    ref, module = models
    out = []
    before = decode_loop_calls["fast"]
    for model in (ref, module):
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            out.append(model.generate(**kw))
    return out[0], out[1], decode_loop_calls["fast"] - before


def test_greedy_and_sampling_take_the_decode_loop_with_hfs_tokens(models):
    ids, mask = _prompt()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
    want, got, fast = _both(models, do_sample=False, **kw)
    assert fast == 1 and torch.equal(got, want), (got, want)
    want, got, fast = _both(models, seed=11, do_sample=True, top_k=40, temperature=0.8, **kw)
    assert fast == 1 and torch.equal(got, want), (got, want)
    assert not torch.equal(got, _both(models, do_sample=False, **kw)[0])  # the sampling call did sample


@pytest.mark.slow  # ~15-40 s of compilation: CI's slow pass (python -m pytest -q -m slow)
def test_llama_takes_the_decode_loop_with_hfs_tokens():
    """Grouped-query attention and rotary positions (tiny HF Llama): the same greedy and sampled tokens as HF."""
    pair = _injected(tiny_hf_llama)
    ids, mask = _prompt(seed=7)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
    for seed, sampling in ((None, {"do_sample": False}), (5, {"do_sample": True, "top_p": 0.9})):
        want, got, fast = _both(pair, seed=seed, **sampling, **kw)
        assert fast == 1 and torch.equal(got, want), (sampling, got, want)


def test_end_of_sequence_pads_finished_rows_and_stops(models):
    """eos = the token the plain model emits third in row 1: that row is padded after it; the call ends when every
    row has ended or at max_new_tokens, as HF's."""
    ids, mask = _prompt(seed=4)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, do_sample=False)
    plain, _, _ = _both(models, eos_token_id=None, **kw)
    eos = int(plain[1, 10 + 2])
    want, got, fast = _both(models, eos_token_id=eos, **kw)
    assert fast == 1 and torch.equal(got, want), (got, want)
    assert (got[1, 13:] == 0).all() and got.shape[1] <= plain.shape[1]


@pytest.mark.slow  # ~15-40 s of compilation: CI's slow pass (python -m pytest -q -m slow)
def test_other_modes_keep_hfs_loop(models):
    from transformers import TextStreamer

    ids, mask = _prompt(seed=5)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, do_sample=False)
    want, got, fast = _both(models, num_beams=2, **kw)
    assert fast == 0 and torch.equal(got, want)
    want, got, fast = _both(models, return_dict_in_generate=True, output_scores=True, **kw)
    assert fast == 0 and torch.equal(got.sequences, want.sequences)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got.scores, want.scores))

    class Tokens(TextStreamer):
        def __init__(self):
            self.seen = []

        def put(self, value):
            self.seen.append(value)

        def end(self):
            pass

    streamer = Tokens()
    want, got, fast = _both(models, streamer=streamer, **{**kw, "input_ids": ids[:1], "attention_mask": mask[:1]})
    assert fast == 0 and torch.equal(got, want) and len(streamer.seen) == 2 * 7  # prompt + 6 tokens, each model


def test_inputs_that_advance_otherwise_are_caught_at_the_second_step(models):
    """A model whose prepared inputs do not advance as the loop assumes (here every step at position 0): the loop
    sees it at the second decode step and keeps HF's bookkeeping from there, so the tokens are HF's loop's on
    the same model."""
    _, module = models
    prepare = module.prepare_inputs_for_generation

    def pinned(*args, **kwargs):
        out = prepare(*args, **kwargs)
        if out.get("position_ids") is not None:
            out["position_ids"] = torch.zeros_like(out["position_ids"])
        return out

    ids, mask = _prompt(seed=6)
    kw = dict(attention_mask=mask, max_new_tokens=8, pad_token_id=0, do_sample=False)
    module.prepare_inputs_for_generation = pinned
    try:
        before = dict(decode_loop_calls)
        with torch.no_grad():
            want = type(module).generate(module, ids, **kw)  # HF's loop
            got = module.generate(ids, **kw)
    finally:
        del module.prepare_inputs_for_generation
    assert decode_loop_calls["checked_out"] == before["checked_out"] + 1
    assert decode_loop_calls["fast"] == before["fast"] and torch.equal(got, want)


@pytest.mark.slow  # ~15-40 s of compilation: CI's slow pass (python -m pytest -q -m slow)
def test_decode_steps_after_the_second_skip_dynamos_guards_and_keep_hfs_tokens(compiled_models):
    """Within one call the compiled step runs without dynamo's guards from its third step (`again`: 12 new tokens
    = a prefill and 11 steps, 9 of them unguarded); a call at another batch size is guarded again at its first
    step (its own graph, HF's tokens)."""
    models = compiled_models
    ref, module = models
    call = module.get_compiled_call()
    ids, mask = _prompt(seed=5)
    kw = dict(max_new_tokens=12, pad_token_id=0, do_sample=False)
    for rows in (3, 1, 3):
        before = call.unguarded_calls
        want, got, fast = _both(models, input_ids=ids[:rows], attention_mask=mask[:rows], **kw)
        assert fast == 1 and torch.equal(got, want), (rows, got, want)
        assert call.whole_graph and call.unguarded_calls - before == 9, rows


def test_again_runs_the_guards_on_a_new_signature_or_a_step_with_graph_breaks():
    """`FrozenCompiledCall.again` skips the guards only for the last guarded call's signature and only for a step
    that compiles to one graph; a step with a graph break compiles with it and is always guarded."""
    from zerospeed.inference.inject import FrozenCompiledCall

    def one_graph(x, scale=2.0):
        return x * scale + 1

    def with_break(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    call = FrozenCompiledCall(one_graph)
    a, b = torch.randn(4, 3), torch.randn(5, 3)
    assert torch.equal(call(a), a * 2 + 1) and call.unguarded_calls == 0
    assert torch.equal(call.again(a + 1), (a + 1) * 2 + 1) and call.unguarded_calls == 1
    assert torch.equal(call.again(b), b * 2 + 1) and call.unguarded_calls == 1  # new shape: guarded (recompiled)
    assert torch.equal(call.again(b.t().contiguous().t()), b * 2 + 1) and call.unguarded_calls == 1  # new strides
    assert torch.equal(call.again(b, scale=3.0), b * 3 + 1) and call.unguarded_calls == 1  # a new argument
    assert torch.equal(call.again(b, scale=3.0), b * 3 + 1) and call.unguarded_calls == 2
    broken = FrozenCompiledCall(with_break)
    for _ in range(3):
        assert torch.equal(broken.again(a), a * 2 + 1)
    assert not broken.whole_graph and broken.unguarded_calls == 0


@pytest.mark.slow  # ~15-40 s of compilation: CI's slow pass (python -m pytest -q -m slow)
def test_the_decode_step_attends_the_filled_part_of_the_cache_with_one_graph():
    """Prompt 10 + 40 new tokens: a 50-position cache (49 + the spare one); the steps pass masks cut to the filled
    positions rounded up to 32 (32, then 49: never the whole cache), HF's tokens, one compiled graph for both
    lengths."""
    from torch._dynamo.utils import counters

    from zerospeed.inference import prefix_attention

    pair = _injected(tiny_hf_gpt2, aot=False)
    ref, module = pair
    assert module.config._attn_implementation == prefix_attention.NAME
    call = module.get_compiled_call()
    lengths, call_step = [], call._call

    def spy(stance, args, kwargs):
        lengths.append(kwargs["attention_mask"].shape[-1])
        return call_step(stance, args, kwargs)

    call._call = spy
    counters.clear()
    ids, mask = _prompt(seed=6)
    want, got, fast = _both(pair, input_ids=ids, attention_mask=mask, max_new_tokens=40, pad_token_id=0,
                            do_sample=False)
    assert fast == 1 and torch.equal(got, want), (got, want)
    assert sorted(set(lengths)) == [32, 49] and counters["stats"]["unique_graphs"] == 1, (lengths, counters["stats"])


def test_a_padded_prompts_forward_attends_only_the_positions_its_mask_allows():
    """The eager forward of a left-padded prompt over a longer static cache: the 4-D mask's columns no query may
    attend (the cache's unwritten tail) are cut before SDPA, with exactly the uncut result; bool and float masks
    (0 attends, the dtype's minimum does not); a mask that allows nothing keeps its length."""
    from zerospeed.inference import prefix_attention as pa

    torch.manual_seed(0)
    batch, heads, queries, positions, dim = 2, 3, 5, 16, 8
    allowed = torch.zeros(batch, 1, queries, positions, dtype=torch.bool)
    for q in range(queries):
        allowed[:, :, q, 2:6 + q] = True  # prompt positions 2..9, causal; 10..15 the unwritten tail
    allowed[0, :, :, 2:4] = False  # row 0 left-padded further
    floats = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    assert pa.attended_length(allowed) == 10 and pa.attended_length(floats) == 10
    assert pa.attended_length(torch.zeros_like(allowed)) == positions
    q, k, v = (torch.randn(batch, heads, n, dim) for n in (queries, positions, positions))
    module = torch.nn.Module()
    module.is_causal, module.training = True, False
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for mask in (allowed, floats):
        cut = pa._attention(module, q, k, v, mask, dropout=0.0, scaling=None)[0]
        whole = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=None)[0]
        torch.testing.assert_close(cut, whole, rtol=1e-6, atol=1e-6)
    # the cut is taken: keys past the attended length never reach SDPA
    k[:, :, 10:] = float("nan")
    assert not pa._attention(module, q, k, v, allowed, dropout=0.0, scaling=None)[0].isnan().any()
