"""Pipeline checkpoints in the topology-independent format (issue 24): a run saved at pp 2 x dp 2 (world 4, ZeRO 1,
a weight tied between the first and last stage, AdamW + clipping) resumes at pp 1, pp 2 x dp 1 and pp 4 (other
ZeRO stages too) with the uninterrupted run's next losses (1e-6), and `get_fp32_state_dict_from_zero_checkpoint`
gives the full model: every layer once, the tied weight once.
"""
import torch
import torch.distributed as dist
from torch import nn

import zerospeed
from zerospeed.pipe import PipelineModule
from zerospeed.testing.parity import max_rel_diff
from zerospeed.testing.spawn import run_distributed
from zerospeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from test_pipe_engine import MICRO, OPTIMIZERS, _data, _layers

GLOBAL = 16  # rows per step: pp 2 x dp 2 reads 2 x 4 micro-batches of 2, one data rank reads 8
SAVED, MORE = 2, 2  # steps before the checkpoint, steps compared after it


def _batches(dp, dp_rank, steps):
    x, y = _data(2, "tied")
    gas = GLOBAL // (MICRO * dp)
    out = []
    for s in range(steps):
        xs, ys = x[s * GLOBAL:(s + 1) * GLOBAL], y[s * GLOBAL:(s + 1) * GLOBAL]
        mine = slice(dp_rank * gas * MICRO, (dp_rank + 1) * gas * MICRO)
        out += list(zip(xs[mine].split(MICRO), ys[mine].split(MICRO)))
    return out


def _engine(num_stages, stage, dp):
    module = PipelineModule(_layers("tied"), num_stages=num_stages, loss_fn=nn.MSELoss(), seed_layers=True,
                            partition_method="uniform")
    engine, *_ = zerospeed.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GLOBAL // (MICRO * dp),
        "optimizer": OPTIMIZERS["adamw-clip"][0], "gradient_clipping": 0.5, "zero_optimization": {"stage": stage}})
    return engine


def save_then_continue(rank, world, save_dir):
    engine = _engine(2, 1, 2)
    it = iter(_batches(2, dist.get_rank(engine.group), SAVED + MORE))
    for _ in range(SAVED):
        engine.train_batch(it)
    engine.save_checkpoint(save_dir, tag="t")
    return [float(engine.train_batch(it)) for _ in range(MORE)]


def resume(rank, world, save_dir, num_stages, stage):
    dp = world // num_stages
    engine = _engine(num_stages, stage, dp)
    engine.load_checkpoint(save_dir, tag="t")
    loaded = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    it = iter(_batches(dp, dist.get_rank(engine.group), SAVED + MORE)[SAVED * GLOBAL // (MICRO * dp):])
    losses = [float(engine.train_batch(it)) for _ in range(MORE)]
    return losses, engine.global_steps, loaded


def test_pipeline_checkpoint_resumes_at_other_pipeline_sizes(tmp_path):
    kept = run_distributed(save_then_continue, 4, str(tmp_path), timeout=300)[0]
    full = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="t")
    assert sorted(full) == sorted(["tied_modules.embed.weight", "2.weight", "2.bias", "4.weight", "4.bias"])
    for world, num_stages, stage in [(1, 1, 0), (2, 2, 2), (4, 4, 1)]:
        for losses, steps, _ in (results := run_distributed(resume, world, str(tmp_path), num_stages, stage,
                                                            timeout=300)):
            assert max_rel_diff(losses, kept) < 1e-6, (world, num_stages, stage, losses, kept)
            assert steps == SAVED + MORE
        if world == 1:  # the whole model in one stage loaded exactly the consolidated weights
            loaded = results[0][2]
            assert sorted(loaded) == sorted(full) and all(torch.equal(loaded[n], full[n]) for n in full)
