"""Kernel injection's decode step as an AOTInductor package (`inference/aot_step.py`, the default on CPU;
`ZEROSPEED_AOT_DECODE=0` turns it off): HF's tokens from a tiny GPT-2 and Llama (left-padded prompts, greedy and
sampled), the package built once per shape and serving every decode step, its memory (constants on huge pages,
the library's copy of them out of the RSS), and the `torch.compile` step taking over, with a warning, where the
package does not build. Each engine exports and compiles one package (~10-35 s here)."""
import pytest
import torch

import zerospeed
from zerospeed.inference import aot_step
from zerospeed.testing.models import tiny_hf_gpt2, tiny_hf_llama

pytest.importorskip("transformers")


def _prompt():
    ids = torch.randint(1, 256, (3, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :2] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _engine(build, monkeypatch):
    monkeypatch.setenv("ZEROSPEED_AOT_DECODE", "1")
    engine = zerospeed.init_inference(build().eval(), dtype=torch.float32, replace_with_kernel_inject=True)
    return build().eval(), engine.module, engine.module.get_compiled_call()


@pytest.mark.parametrize("build", [tiny_hf_gpt2, pytest.param(tiny_hf_llama, marks=pytest.mark.slow)])
def test_the_package_serves_every_decode_step_with_hfs_tokens(build, monkeypatch):
    ref, module, call = _engine(build, monkeypatch)
    ids, mask = _prompt()
    new = 12
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, pad_token_id=0)
    with torch.no_grad():
        want = ref.generate(do_sample=False, **kw)
    got = module.generate(do_sample=False, **kw)
    assert torch.equal(got, want), (got, want)
    assert len(call._aot_steps) == 1 and not call._aot_failed
    assert call.aot_calls == new - 1  # every decode step after the prefill
    assert call.unguarded_calls == 0  # the torch.compile step never ran
    for seed in (11, 12):  # sampling under a seed: the same draws as HF's loop; the same package
        torch.manual_seed(seed)
        with torch.no_grad():
            want = ref.generate(do_sample=True, top_k=40, temperature=0.8, **kw)
        torch.manual_seed(seed)
        got = module.generate(do_sample=True, top_k=40, temperature=0.8, **kw)
        assert torch.equal(got, want), (seed, got, want)
    assert len(call._aot_steps) == 1 and call.aot_calls == 3 * (new - 1)


@pytest.mark.slow  # ~15-40 s of compilation: CI's slow pass (python -m pytest -q -m slow)
def test_a_package_that_does_not_build_leaves_the_compiled_step_with_a_warning(monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("export failed here\nsecond line")

    monkeypatch.setattr(aot_step.AOTDecodeStep, "build", classmethod(lambda cls, *a, **k: fail()))
    ref, module, call = _engine(tiny_hf_gpt2, monkeypatch)
    ids, mask = _prompt()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0, do_sample=False)
    with torch.no_grad():
        want = ref.generate(**kw)
    with pytest.warns(UserWarning, match="AOTInductor decode step did not build .RuntimeError: export failed here."):
        got = module.generate(**kw)
    assert torch.equal(got, want)
    assert call.aot_calls == 0 and len(call._aot_failed) == 1 and call.unguarded_calls > 0
    got = module.generate(**kw)  # tried once per shape: no second build, no second warning
    assert torch.equal(got, want) and len(call._aot_failed) == 1


def test_on_by_default_for_fp32_and_int8_off_with_zero_and_a_clear_error_otherwise(monkeypatch):
    monkeypatch.delenv("ZEROSPEED_AOT_DECODE", raising=False)
    for dtype, want in ((torch.float32, True), (torch.int8, True), (torch.bfloat16, False)):
        engine = zerospeed.init_inference(tiny_hf_gpt2().eval(), dtype=dtype, replace_with_kernel_inject=True)
        assert engine.module.get_compiled_call().aot is want, dtype
    from zerospeed.inference import inject
    from zerospeed.inference.quant import weight_bytes

    model = tiny_hf_gpt2().eval()
    need = inject.AOT_BUILD_BYTES_PER_WEIGHT_BYTE * weight_bytes(model)
    for available, want in ((need - 1, False), (need, True)):  # the build must fit in the host's memory
        monkeypatch.setattr(inject, "_available_host_bytes", lambda: available)
        assert inject.aot_wanted(model) is want
    monkeypatch.setenv("ZEROSPEED_AOT_DECODE", "1")
    assert inject.aot_wanted(model) is True
    engine = zerospeed.init_inference(tiny_hf_gpt2().eval(), dtype=torch.bfloat16, replace_with_kernel_inject=True)
    assert engine.module.get_compiled_call().aot is True
    monkeypatch.setenv("ZEROSPEED_AOT_DECODE", "0")
    engine = zerospeed.init_inference(tiny_hf_gpt2().eval(), dtype=torch.float32, replace_with_kernel_inject=True)
    assert engine.module.get_compiled_call().aot is False
    monkeypatch.setenv("ZEROSPEED_AOT_DECODE", "yes")
    with pytest.raises(ValueError, match="ZEROSPEED_AOT_DECODE='yes': use 1 .*, 0 .*or leave it unset"):
        zerospeed.init_inference(tiny_hf_gpt2().eval(), dtype=torch.float32, replace_with_kernel_inject=True)


def test_the_packages_constants_sit_on_huge_pages_and_the_librarys_copy_leaves_the_rss(monkeypatch):
    """A GPT-2 whose tied 40 MiB embedding is two constants of the package (the gather table and the packed
    lm_head): after loading, the library's embedded copy of them is no longer resident (its file mappings hold
    under 1 MiB of their >= 80 MiB), and the constants' own block (one allocation past glibc's largest mmap
    threshold, 32 MiB: a mapping of its own) is on huge pages, >= 64 MiB of it; HF's tokens."""
    import transformers

    from zerospeed.testing.rss import smaps_field

    cfg = transformers.GPT2Config(vocab_size=40960, n_positions=64, n_embd=256, n_layer=1, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)

    def build():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(cfg).eval()

    ref, module, call = _engine(build, monkeypatch)
    before = aot_step._mappings()
    ids = torch.randint(1, 40960, (1, 8), generator=torch.Generator().manual_seed(5))
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = ref.generate(**kw)
    assert torch.equal(module.generate(**kw), want) and call.aot_calls == 5
    new = {lo: v for lo, v in aot_step._mappings().items() if lo not in before}
    files = {lo for lo, (_, path) in new.items() if path.startswith("/")}
    anonymous = {lo for lo, (_, path) in new.items() if not path}
    size = sum(hi - lo for lo, (hi, _) in new.items() if lo in files)
    rss, huge = smaps_field("Rss"), smaps_field("AnonHugePages")
    assert size >= 80 * 2**20, size  # the library embeds both constants
    assert sum(rss.get(lo, 0) for lo in files) < 2**20, {hex(lo): rss.get(lo) for lo in files}
    assert sum(huge.get(lo, 0) for lo in anonymous) >= 64 * 2**20, {hex(lo): huge.get(lo) for lo in anonymous}


@pytest.mark.slow  # ~30 s: an int8 engine builds its own package
def test_int8_weights_through_the_package_pick_the_eager_engines_best_token(monkeypatch):
    """int8 weights (the default: the package serves them): each greedy token, teacher-forced, is the eager int8
    engine's best one within 0.02 of its logits (the package's sums run in another order; an exact tie may flip)."""
    monkeypatch.delenv("ZEROSPEED_AOT_DECODE", raising=False)
    eager = zerospeed.init_inference(tiny_hf_gpt2().eval(), dtype=torch.int8)
    engine = zerospeed.init_inference(tiny_hf_gpt2().eval(), dtype=torch.int8, replace_with_kernel_inject=True)
    call = engine.module.get_compiled_call()
    ids = torch.randint(1, 256, (3, 10), generator=torch.Generator().manual_seed(3))
    out = engine.module.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                 do_sample=False, pad_token_id=0)
    assert call.aot_calls == 11 and not call._aot_failed
    with torch.no_grad():
        logits = eager.module(out).logits  # [3, 22, vocab]
    for i in range(12):  # token 10 + i from the logits at position 10 + i - 1
        step = logits[:, 10 + i - 1].float()
        gap = step.max(-1).values - step.gather(1, out[:, 10 + i, None]).squeeze(1)
        assert gap.max().item() <= 0.02, (i, gap)
