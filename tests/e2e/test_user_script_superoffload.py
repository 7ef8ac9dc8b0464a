"""DeepSpeedExamples' SuperOffload fine-tuning script (`training/DeepSpeed-SuperOffload/finetune_zero3.py`), written
as its users write it (`tests/e2e/scripts/superoffload_finetune.py`: the same calls; only the imports name
zerospeed), launched with `zerospeed launch` on 2 gloo ranks with the example's Qwen3-30B-A3B config (ZeRO-3,
`offload_optimizer` cpu with `super_offload` and `ratio` 0.9; fp32 here, the example's bf16 off) on a tiny
Qwen3-MoE saved with `save_pretrained`, its `Qwen3MoeSparseMoeBlock`s flagged with `set_z3_leaf_modules` by class
name, gradient checkpointing on and a client `DeepSpeedCPUAdam`.

Every rank's per-step losses equal plain PyTorch's (the same model, AdamW with the same hyperparameters, each
rank's micro-batches in the loader's order: `DistributedSampler`, seed 0), to 1e-5 relative; its parameter count
`p.ds_numel if hasattr(p, "ds_tensor") else p.numel()` is the full model's (it was 0 before the ZeRO-3
parameters carried DeepSpeed's markers); both MoE blocks are flagged.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed "
                                   "(pip install -e '.[test]' installs it)")

SCRIPT = Path(__file__).parent / "scripts" / "superoffload_finetune.py"
LR, ROWS, LENGTH, WORLD, MICRO = 1e-3, 12, 16, 2, 2
CONFIG = {"train_batch_size": MICRO * WORLD, "gradient_accumulation_steps": 1, "bf16": {"enabled": False},
          "zero_optimization": {"stage": 3, "overlap_comm": False, "reduce_bucket_size": 4e8, "sub_group_size": 4e8,
                                "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.90,
                                                      "super_offload": True, "cpuadam_cores_perc": 0.90}},
          "wall_clock_breakdown": True}


def _model():
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                      max_position_embeddings=32, intermediate_size=32, moe_intermediate_size=16,
                                      num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, head_dim=8,
                                      norm_topk_prob=True)
    return transformers.Qwen3MoeForCausalLM(cfg)


def _reference(path: Path) -> list[list[float]]:
    spec = importlib.util.spec_from_file_location("superoffload_finetune", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    data = script.load_dataset(ROWS, LENGTH, model.config.vocab_size)
    perm = torch.randperm(ROWS, generator=torch.Generator().manual_seed(0))  # DistributedSampler, seed 0, epoch 0
    shares = [perm[r::WORLD].tolist() for r in range(WORLD)]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = [[] for _ in range(WORLD)]
    for s in range(ROWS // (MICRO * WORLD)):
        total = 0.0
        for r in range(WORLD):
            rows = [data[i] for i in shares[r][s * MICRO:(s + 1) * MICRO]]
            batch = transformers.default_data_collator(rows)
            loss = model(**batch).loss
            losses[r].append(loss.item())
            total = total + loss / WORLD
        total.backward()
        opt.step()
        opt.zero_grad()
    return losses


def test_superoffload_script_trains_a_qwen3_moe_as_plain_pytorch(tmp_path):
    path = tmp_path / "tiny-qwen3-moe"
    model = _model()
    model.save_pretrained(path)
    full = sum(p.numel() for p in model.parameters())
    (tmp_path / "ds_config.json").write_text(json.dumps(CONFIG))
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "zerospeed.cli", "launch", "--nproc-per-node", str(WORLD), str(SCRIPT),
           "--model_name", str(path), "--lr", str(LR), "--leaf_module", "Qwen3MoeSparseMoeBlock",
           "--activation_checkpointing", "--max_length", str(LENGTH), "--rows", str(ROWS),
           f"--deepspeed_config={tmp_path / 'ds_config.json'}", "--out", str(out)]
    res = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "super_offload with device \"cpu\"" in res.stderr  # the warning: the step at engine.step()
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    ref = _reference(path)
    for r, got in enumerate(ranks):
        assert got["model_size"] == full and got["leaf_modules"] == 2
        assert len(got["losses"]) == len(ref[r]) == ROWS // (MICRO * WORLD)
        rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref[r]))
        assert rel < 1e-5, (r, got["losses"], ref[r])
