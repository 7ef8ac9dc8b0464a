"""`zerospeed to-fp32` run as a user runs it (a subprocess, no model code), and `engine.save_16bit_model`:
the output loads strictly into a fresh plain module and reproduces the engine's forward exactly."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zerospeed
from zerospeed.runtime import consolidate
from zerospeed.testing.models import GPT, GPTConfig, random_tokens, tiny_gpt
from zerospeed.testing.parity import global_batches, train_engine
from zerospeed.testing.spawn import run_distributed

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
IDX = random_tokens(2, 16, seed=9)[:, :16]


def train_and_save(rank, world, root):
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zerospeed.initialize(model=tiny_gpt(seed=0), config=cfg)
    train_engine(engine, global_batches(random_tokens(12, 64, seed=1), 4, 3))
    engine.save_checkpoint(Path(root) / "ckpt")
    engine.save_16bit_model(Path(root) / "export")
    engine.eval()
    with torch.no_grad():
        logits = engine(IDX)
    state = engine.strategy.consolidated_state_dict()
    engine.destroy()
    return logits, state


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("to_fp32")
    logits, state = run_distributed(train_and_save, 2, str(root))[0]
    return root, logits, state


def to_fp32(*args):
    return subprocess.run([sys.executable, "-m", "zerospeed.cli", "to-fp32", *map(str, args)], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=120)


def _forward(weights):
    model = GPT(GPTConfig())
    model.load_state_dict(weights, strict=True)  # tied lm_head.weight is in the file too
    model.eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks
    try:
        with torch.no_grad():
            return model(IDX)
    finally:
        torch.set_num_threads(threads)


def test_to_fp32_output_reproduces_the_engine_forward(saved):
    root, logits, state = saved
    proc = to_fp32(root / "ckpt", root / "out")
    assert proc.returncode == 0, proc.stderr
    assert "peak RSS growth" in proc.stdout
    weights = load_file(root / "out" / "model.safetensors")
    assert weights.keys() == state.keys() and all(torch.equal(weights[k], state[k]) for k in state)
    assert torch.equal(_forward(weights), logits)


def test_sharded_output_in_the_hugging_face_layout(saved, capsys):
    root, _, state = saved
    assert consolidate.main([str(root / "ckpt"), str(root / "sharded"), "--max-shard-size", "100KB",
                             "--tag", "global_step3"]) == 0  # in-process: a subprocess costs ~10 s of imports
    index = json.loads((root / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    merged = {}
    for f in files:
        part = load_file(root / "sharded" / f)
        assert all(index["weight_map"][k] == f for k in part)
        merged.update(part)
    assert merged.keys() == state.keys() and all(torch.equal(merged[k], state[k]) for k in state)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in merged.values())


def test_save_16bit_model_writes_the_module_dtype(saved):
    """fp32 training: the module's fp32 weights, as DeepSpeed's save_16bit_model does (module.state_dict())."""
    root, logits, state = saved
    weights = load_file(root / "export" / "model.safetensors")
    assert all(v.dtype == torch.float32 for v in weights.values())
    assert weights.keys() == state.keys() and all(torch.equal(weights[k], state[k]) for k in state)
    assert torch.equal(_forward(weights), logits)


def test_to_fp32_errors_name_the_problem(tmp_path, capsys):
    assert consolidate.main([str(tmp_path), str(tmp_path / "out")]) == 1
    assert "no 'latest' file" in capsys.readouterr().err
