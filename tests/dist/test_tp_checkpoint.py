"""Tensor-parallel checkpoints are topology-independent: saved at tp 2 x dp 2 (world 4), they resume at
tp 1 x dp 4, tp 2 x dp 1 and tp 1 x dp 1 with the same next-step loss as the run that kept going; the
index holds full tensors (HF names and shapes), `zerospeed to-fp32` writes the full model, and
`save_16bit_model` writes full tensors that `from_pretrained` loads (never one rank's shard).
"""
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerospeed
from zerospeed.testing.models import random_tokens, tiny_hf_llama
from zerospeed.testing.parity import max_rel_diff
from zerospeed.testing.spawn import run_distributed

transformers = pytest.importorskip("transformers")

GLOBAL, SEQ = 4, 32
TOL = 1e-5


def _batches():
    tokens = random_tokens(GLOBAL * 4, SEQ, seed=1)[:, :SEQ]
    return [tokens[i:i + GLOBAL] for i in range(0, GLOBAL * 4, GLOBAL)]


def _engine(world, tp, stage):
    dp = world // tp
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL // dp, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}}, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return zerospeed.initialize(model=tiny_hf_llama(seed=0), config=cfg)[0]


def _step(engine, x):
    dp, r = engine.dp_world_size, dist.get_rank(engine.group)
    per = x.shape[0] // dp
    mine = x[r * per:(r + 1) * per]
    loss = engine(input_ids=mine, labels=mine).loss
    engine.backward(loss)
    engine.step()
    t = loss.detach().double()
    dist.all_reduce(t, group=engine.group)
    return float(t) / dp


def save_run(rank, world, save_dir, stage):
    engine = _engine(world, 2, stage)
    batches = _batches()
    for x in batches[:2]:
        _step(engine, x)
    engine.save_checkpoint(save_dir, tag="t")
    engine.save_16bit_model(save_dir, "model.safetensors")
    return [_step(engine, x) for x in batches[2:]]


def resume_run(rank, world, save_dir, tp, stage):
    engine = _engine(world, tp, stage)
    engine.load_checkpoint(save_dir, tag="t")
    return [_step(engine, x) for x in _batches()[2:]]


# stages 2 and 3 (~20 s each) in the slow pass
@pytest.mark.parametrize("stage", [0, 1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_tp_checkpoint_reshards_across_tp_and_dp(tmp_path, stage):
    save_dir = str(tmp_path / "ckpt")
    kept_going = run_distributed(save_run, 4, save_dir, stage, timeout=300)[0]
    for world, tp in ((4, 1), (2, 2), (1, 1)):
        resumed = run_distributed(resume_run, world, save_dir, tp, stage, timeout=300)
        for r in resumed:
            assert max_rel_diff(r, kept_going) < TOL, (world, tp, r, kept_going)
    # the index holds full tensors under the HF names
    index = json.loads((Path(save_dir) / "t" / "index.json").read_text())
    ref = dict(tiny_hf_llama(seed=0).named_parameters())
    for name, p in ref.items():
        if name in index["tensors"]:
            assert index["tensors"][name]["shape"] == list(p.shape), name
    assert index["tensors"]["model.layers.0.self_attn.q_proj.weight"]["shape"] == [64, 64]
    # save_16bit_model: full tensors that from_pretrained-style loading accepts
    from safetensors.torch import load_file

    sd = load_file(str(Path(save_dir) / "model.safetensors"))
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (64, 128)
    tiny_hf_llama(seed=0).config.save_pretrained(save_dir)  # save_16bit_model writes weights only, as DeepSpeed
    loaded = transformers.LlamaForCausalLM.from_pretrained(save_dir)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, sd[name]), name


def test_to_fp32_of_tp_checkpoint(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    run_distributed(save_run, 4, save_dir, 2, timeout=300)
    from zerospeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="t")
    ref = dict(tiny_hf_llama(seed=0).named_parameters())
    assert {k: tuple(v.shape) for k, v in sd.items() if k in ref} == {k: tuple(v.shape) for k, v in ref.items()}
    # the fp32 masters equal the 16-bit export here (fp32 training): the same full tensors
    from safetensors.torch import load_file

    exported = load_file(str(Path(save_dir) / "model.safetensors"))
    for k in ref:
        assert torch.equal(sd[k], exported[k]), k
