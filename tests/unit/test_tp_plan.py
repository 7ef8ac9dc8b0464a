"""`tensor_parallel.describe_plan` and `zerospeed tp-plan`: the sharding plan as text, without processes."""
import json

import pytest
import torch
import torch.distributed as dist

from zerospeed.cli import main as cli_main
from zerospeed.tensor_parallel import PRESETS, describe_plan
from zerospeed.tensor_parallel.describe import plan_layers
from zerospeed.tensor_parallel.plan_cli import model_from_hf_config
from zerospeed.testing.models import tiny_hf_gpt2, tiny_hf_llama

pytest.importorskip("transformers")


def _rows(text):
    """{layer name: (kind, full shape, local shape)} from the table's rows."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and ("." in parts[0] or parts[0] == "lm_head") and not line.startswith(" "):
            kind = " ".join(parts[1:-2])
            out[parts[0]] = (kind, parts[-2], parts[-1])
    return out


def _totals(text):
    return {line.split(":")[0].strip(): int(line.split(":")[1].split()[0].replace(",", ""))
            for line in text.splitlines() if line.startswith(("parameters:", "  sharded:", "  replicated:"))}


def test_describe_plan_llama_gqa():
    model = tiny_hf_llama(seed=0)  # hidden 64, 4 heads of 16, 2 kv heads (k/v 32 wide), MLP 128, 2 layers
    text = describe_plan(model, 2)
    assert not dist.is_initialized()
    assert text.startswith("Tensor-parallel plan for LlamaForCausalLM (preset llama), tp = 2")
    rows = _rows(text)
    layer0 = {k.split("layers.0.")[1]: v for k, v in rows.items() if "layers.0." in k}
    assert layer0 == {"self_attn.q_proj": ("column", "64x64", "32x64"), "self_attn.k_proj": ("column", "32x64", "16x64"),
                      "self_attn.v_proj": ("column", "32x64", "16x64"), "self_attn.o_proj": ("row", "64x64", "64x32"),
                      "mlp.gate_proj": ("column", "128x64", "64x64"), "mlp.up_proj": ("column", "128x64", "64x64"),
                      "mlp.down_proj": ("row", "64x128", "64x64")}
    assert rows["lm_head"] == ("replicated", "256x64", "256x64")
    sharded = 2 * (64 * 64 * 2 + 32 * 64 * 2 + 128 * 64 * 3)
    total = sum(p.numel() for p in model.parameters())
    assert _totals(text) == {"parameters": total, "sharded": sharded, "replicated": total - sharded}
    assert "problems" not in text
    # tp 4 does not divide the 2 key/value heads: reported, not raised
    bad = describe_plan(model, 4)
    assert "num_key_value_heads=2 is not divisible by the tensor-parallel size 4" in bad
    assert "does not split" not in bad  # every weight dimension splits 4 ways, the kv heads do not
    three = describe_plan(model, 3)
    assert "2 column-parallel weight(s) [64, 64] (e.g. model.layers.0.self_attn.q_proj): the sharded dimension does " \
           "not split into 1 block(s) x 3 ranks" in three
    assert [line.split()[-3:] for line in three.splitlines() if line.startswith("model.layers.1.mlp.down_proj")] \
        == [["does", "not", "split"]]


def test_describe_plan_gpt2_fused_qkv_tied_embeddings():
    model = tiny_hf_gpt2(seed=0)  # n_embd 64, 2 heads, Conv1D [in, out], lm_head tied to wte
    text = describe_plan(model, 2)
    rows = _rows(text)
    assert rows["transformer.h.0.attn.c_attn"] == ("column x3", "64x192", "64x96")
    assert rows["transformer.h.0.attn.c_proj"] == ("row", "64x64", "32x64")
    assert rows["transformer.h.0.mlp.c_fc"] == ("column", "64x256", "64x128")
    assert rows["transformer.h.1.mlp.c_proj"] == ("row", "256x64", "128x64")
    # column biases are split with their features, row biases replicated; the tied lm_head counts once
    per_layer = (64 * 192 + 192) + 64 * 64 + (64 * 256 + 256) + 256 * 64
    total = sum(p.numel() for p in model.parameters())
    assert _totals(text) == {"parameters": total, "sharded": 2 * per_layer, "replicated": total - 2 * per_layer}
    layers = plan_layers(model, PRESETS["gpt2"], 2)
    assert sum(lp.replicated_numel for lp in layers if lp.kind == "row") == 4 * 64  # two c_proj biases per layer
    # a custom partition_config without the preset: only what it names is sharded
    custom = describe_plan(model, 2, partition_config={"use_default_specs": False, "layer_specs": [
        {"patterns": [r".*\.mlp\.c_fc\.weight$"], "partition_type": "column"}]})
    assert _rows(custom)["transformer.h.0.attn.c_attn"] == ("replicated", "64x192", "64x192")


def test_describe_plan_errors():
    with pytest.raises(ValueError, match="no tensor-parallel sharding plan"):
        describe_plan(torch.nn.Sequential(torch.nn.Linear(4, 4)), 2)
    with pytest.raises(ValueError, match=">= 1"):
        describe_plan(tiny_hf_llama(seed=0), 0)


def test_cli_builds_on_meta(capsys):
    model = model_from_hf_config("llama", {"num_hidden_layers": 1})
    assert all(p.device.type == "meta" for p in model.parameters())
    assert cli_main(["tp-plan", "--model-type", "gpt2", "--hf-config", json.dumps({"n_layer": 1}), "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "Tensor-parallel plan for GPT2LMHeadModel (preset gpt2), tp = 2" in out
    assert _rows(out)["transformer.h.0.attn.c_attn"] == ("column x3", "768x2304", "768x1152")
    assert cli_main(["tp-plan", "--tp", "2"]) == 2
    assert "--model-type" in capsys.readouterr().err
    assert cli_main(["tp-plan", "--hf-config", "{not json", "--tp", "2"]) == 2
    assert "neither an existing file" in capsys.readouterr().err


def test_cli_reads_config_file(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2, "intermediate_size": 128,
                                                      "num_hidden_layers": 1, "vocab_size": 256}))
    assert cli_main(["tp-plan", "--hf-config", str(tmp_path), "--tp", "2"]) == 0
    assert _rows(capsys.readouterr().out)["model.layers.0.self_attn.k_proj"] == ("column", "32x64", "16x64")
