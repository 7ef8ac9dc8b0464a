"""DeepSpeedExamples' AutoTP training example (`training/tensor_parallel/basic_example/autotp_example.py`), its
own code with the import line changed (`tests/e2e/scripts/autotp_example.py`), launched with `zerospeed launch`
on a tiny HF Llama: a hand-built mpu (tensor- and data-parallel `new_group`s) passed to `initialize` together with
`"tensor_parallel": {"autotp_size": N}` and `"data_parallel_size"` - which zerospeed refused before (two ways of
defining the model-parallel groups; an unsupported key). AutoTP now shards over the mpu's model-parallel group.

Every rank's per-step loss equals plain PyTorch's on the same inputs (each data-parallel group's, as its first
tensor-parallel rank drew them; AdamW with the script's hyperparameters on the mean over data-parallel ranks,
clipped at the config's default gradient_clipping 1.0: the global norm over the tensor-parallel shards), to
1e-5 relative, at tp 2 (world 2) and tp 2 x dp 2 (world 4, slow), ZeRO 1, fp32.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed "
                                   "(pip install -e '.[test]' installs it)")

SCRIPT = Path(__file__).parent / "scripts" / "autotp_example.py"
LR, STEPS, SEQ = 1e-2, 3, 16


def _save_model(path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


def _run(tmp_path, tp: int, dp: int) -> list[dict]:
    path = tmp_path / "tiny-llama"
    _save_model(path)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "zerospeed.cli", "launch", "--nproc-per-node", str(tp * dp), str(SCRIPT),
           "--model_name", str(path), "--tp_size", str(tp), "--dp_size", str(dp), "--zero_stage", "1",
           "--seq_length", str(SEQ), "--num_steps", str(STEPS), "--learning_rate", str(LR), "--precision", "fp32",
           "--out", str(out)]
    res = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "AutoTP example completed." in res.stdout
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(tp * dp)], path


def _check(ranks: list[dict], path: Path, dp: int) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)  # the script's: torch's defaults but lr
    first = {r["dp_rank"]: r for r in ranks if r["tp_rank"] == 0}
    for r in ranks:  # the tensor-parallel ranks of a group trained on their first rank's inputs
        assert r["inputs"] == first[r["dp_rank"]]["inputs"]
    want = [[] for _ in range(dp)]
    for s in range(STEPS):
        total = 0.0
        for d in range(dp):
            ids = torch.tensor(first[d]["inputs"][s])
            loss = model(input_ids=ids, labels=ids).loss
            want[d].append(loss.item())
            total = total + loss / dp
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # gradient_clipping's default (DeepSpeed 0.19.8's)
        opt.step()
        opt.zero_grad()
    for r in ranks:
        got, ref = r["losses"], want[r["dp_rank"]]
        assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) < 1e-5, (r["dp_rank"], r["tp_rank"], got, ref)
    assert want[0][-1] != want[0][0]  # the weights moved


def test_autotp_example_tp2_trains_as_plain_pytorch(tmp_path):
    ranks, path = _run(tmp_path, tp=2, dp=1)
    _check(ranks, path, dp=1)


@pytest.mark.slow
def test_autotp_example_tp2_dp2_trains_as_plain_pytorch(tmp_path):
    ranks, path = _run(tmp_path, tp=2, dp=2)
    _check(ranks, path, dp=2)


def _mismatched(rank, world):
    import torch.distributed as dist

    import zerospeed
    from zerospeed.config import ConfigError
    from zerospeed.parallel import ParallelMesh

    mesh = ParallelMesh.build(tp=1)  # an mpu whose model-parallel groups have one rank: dp 2
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    errors = []
    for cfg in ({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2}},
                {"train_micro_batch_size_per_gpu": 1, "data_parallel_size": 4}):
        try:
            zerospeed.initialize(model=model, config=cfg, mpu=mesh)
            errors.append(None)
        except ConfigError as e:
            errors.append(str(e))
    dist.barrier()
    return errors


def test_autotp_size_and_data_parallel_size_disagreeing_with_the_mpu_are_errors():
    from zerospeed.testing.spawn import run_distributed

    autotp, dp = run_distributed(_mismatched, 2, timeout=120)[0]
    assert "autotp_size=2 but the mpu's model-parallel group has 1 ranks" in autotp
    assert "data_parallel_size=4 but this launch has 2 data-parallel ranks" in dp
