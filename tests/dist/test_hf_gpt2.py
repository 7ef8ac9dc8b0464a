"""An unmodified Hugging Face GPT2LMHeadModel (built from a config, no download) under ZeRO-3.

Per-step losses at 2 ranks equal plain single-process PyTorch on the same global batch.
"""
import pytest
import torch

from zerospeed.testing.models import tiny_hf_gpt2
from zerospeed.testing.parity import global_batches, max_rel_diff, train_lm_engine
from zerospeed.testing.spawn import run_distributed

transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed "
                                   "(pip install -e '.[test]' installs it)")

STEPS, MICRO, WORLD, LR = 12, 2, 2, 3e-3
LOSS_TOL = 1e-5  # relative; HF's attention and loss kernels accumulate in another order than ours


def make_model():
    return tiny_hf_gpt2()


def tokens():
    g = torch.Generator().manual_seed(3)
    # a 16-symbol alphabet: the model can visibly learn its unigram distribution in 12 steps
    return torch.randint(0, 16, (MICRO * WORLD * STEPS, 33), generator=g)


def zero3_run(rank, world):
    import zerospeed

    model = make_model()
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
           "gradient_clipping": 0.0,  # the reference does not clip (DeepSpeed's default would be 1.0)
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = zerospeed.initialize(model=model, config=cfg)
    units = len(engine.strategy.units)
    losses = train_lm_engine(engine, global_batches(tokens(), MICRO * WORLD, STEPS))
    tied = engine.module.lm_head.weight is engine.module.transformer.wte.weight
    engine.destroy()
    return losses, units, tied


def test_hf_gpt2_trains_under_zero3_like_plain_pytorch():
    losses, units, tied = run_distributed(zero3_run, WORLD)[0]
    assert tied and units == 3  # the 2 GPT2Blocks are gather units, plus the root
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    ref = []
    for x, _ in global_batches(tokens(), MICRO * WORLD, STEPS):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    assert max_rel_diff(losses, ref) < LOSS_TOL, (losses, ref)
    assert ref[-1] < 0.8 * ref[0]  # it trains
