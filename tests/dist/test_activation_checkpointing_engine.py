"""Activation checkpointing inside the engine: identical gradients with and without, at ZeRO 0 and 3.

Dropout is on (p=0.1), so the recomputation must replay the same masks; at stage 3 the block's
parameters are released after forward and must be gathered again for the recomputation.
"""
import torch

import zerospeed
from zerospeed.checkpointing import checkpoint_modules
from zerospeed.testing.models import Block, random_tokens, tiny_gpt
from zerospeed.testing.spawn import run_distributed

TOL = 1e-6  # relative, fp32: the same kernels run on the same data; only the schedule differs


def local_grads(engine, stage):
    """This rank's gradients after backward: full .grad (stage 0) or its flat shard grads (stage 3)."""
    if stage == 0:
        return [p.grad.detach().clone() for p in engine.module.parameters()]
    return [p.grad.detach().clone() for g in engine.optimizer.param_groups for p in g["params"]]


def run(rank, world):
    out = {}
    data = random_tokens(8, 64, seed=rank)
    for stage in (0, 3):
        for ckpt in (False, True):
            model = tiny_gpt(seed=0, bias=False, dropout=0.1, n_layer=3)
            if ckpt:
                assert len(checkpoint_modules(model, Block)) == 3
            cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                   "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                         "stage3_max_reuse_distance": 0}}
            engine, _, _, _ = zerospeed.initialize(model=model, config=cfg)
            grads, losses = [], []
            for step in range(3):
                torch.manual_seed(100 + step)  # same dropout masks in both runs
                x, y = data[4 * (step % 2):4 * (step % 2) + 4, :-1], data[4 * (step % 2):4 * (step % 2) + 4, 1:]
                loss = engine(x, y)
                engine.backward(loss)
                grads.append(local_grads(engine, stage))
                losses.append(loss.item())
                engine.step()
            out[(stage, ckpt)] = (losses, grads)
            engine.destroy()
    return out


def test_checkpointed_gradients_equal_plain_at_stage_0_and_3():
    for rank_out in run_distributed(run, 2):
        for stage in (0, 3):
            (l0, g0), (l1, g1) = rank_out[(stage, False)], rank_out[(stage, True)]
            assert l0 == l1 or max(abs(a - b) / abs(b) for a, b in zip(l0, l1)) < TOL, (stage, l0, l1)
            for step_a, step_b in zip(g0, g1):
                for a, b in zip(step_a, step_b):
                    assert a.shape == b.shape and a.numel() > 0
                    scale = b.abs().max().clamp_min(1e-12)
                    assert float((a - b).abs().max() / scale) < TOL, stage
