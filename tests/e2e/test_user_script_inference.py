"""DeepSpeedExamples' text-generation script (`inference/huggingface/text-generation/inference-test.py` with its
`DSPipeline`), written as its users write it (`tests/e2e/scripts/text_generation.py`: the same calls; only the
imports name zerospeed), run on a local tiny GPT-2 "repo" (config, tokenizer, `model.safetensors` and the
`pytorch_model.bin` older hub repos ship). Greedy generation of 12 tokens for 4 left-padded prompts of
different lengths must give exactly the token ids of the script's own `--hf_baseline` (plain HF `generate`):

- through `init_inference(mp_size=2)` (tp 2 under torchrun), the model built under
  `OnDevice(dtype=torch.float16, device="meta")` and loaded from the script's checkpoint json listing the `.bin`
  file (`{"type": "BLOOM", "checkpoints": [...]}` + `base_dir`), each rank reading its shard;
- [slow] the same at tp 1 with kernel injection (`--use_kernel`).
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

SCRIPT = Path(__file__).parent / "scripts" / "text_generation.py"
WORDS = ("DeepSpeed is a machine learning framework He working on has got all Everyone happy and I can The new "
         "movie that Oscar this year In the far distance from our galaxy, Peace only way").split()
ARGS = ["--batch_size", "4", "--greedy", "--max_new_tokens", "12"]


def _repo(path: Path) -> Path:
    """A tiny GPT-2 saved as a hub repo would hold it: config, a word-level tokenizer, safetensors and .bin."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(dict.fromkeys(WORDS))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>",
                            bos_token="<|endoftext|>").save_pretrained(path)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                                       bos_token_id=1, eos_token_id=1, initializer_range=0.3)).eval()
    model.save_pretrained(path)
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    return path


def _run(tmp_path, repo: Path, name: str, *extra: str, world: int = 1) -> list[list[int]]:
    out = tmp_path / f"{name}.json"
    launch = [sys.executable] if world == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    res = subprocess.run([*launch, str(SCRIPT), "--model", str(repo), *ARGS, *extra, "--out", str(out)],
                         cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def repo_and_baseline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inference_script")
    repo = _repo(tmp / "tiny-gpt2")
    baseline = _run(tmp, repo, "hf", "--hf_baseline")
    assert len(baseline) == 4 and len({tuple(row[-12:]) for row in baseline}) == 4  # 4 different continuations
    return repo, baseline


def test_script_meta_model_from_bin_checkpoint_at_tp2_generates_hf_tokens(tmp_path, repo_and_baseline):
    repo, baseline = repo_and_baseline
    assert _run(tmp_path, repo, "tp2", "--use_meta_tensor", world=2) == baseline


@pytest.mark.slow
def test_script_with_kernel_injection_generates_hf_tokens(tmp_path, repo_and_baseline):
    repo, baseline = repo_and_baseline
    assert _run(tmp_path, repo, "kernel", "--use_meta_tensor", "--use_kernel") == baseline
