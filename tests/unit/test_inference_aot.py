"""Kernel injection's decode step as an AOTInductor package (`inference/aot_step.py`, `ZEROSPEED_AOT_DECODE=1`):
HF's tokens from a tiny GPT-2 and Llama (left-padded prompts, greedy and sampled), the package built once per
shape and serving every decode step, and the `torch.compile` step taking over, with a warning, where the package
does not build. Each engine exports and compiles one package (~15-35 s here)."""
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


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("ZEROSPEED_AOT_DECODE", raising=False)
    engine = zerospeed.init_inference(tiny_hf_gpt2().eval(), dtype=torch.float32, replace_with_kernel_inject=True)
    assert engine.module.get_compiled_call().aot is False
