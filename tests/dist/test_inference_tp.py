"""Tensor-parallel `init_inference` of unmodified HF models, at world 2 (tp 2) and world 4 (tp 2 x 2 replicas).

Tiny HF Llama (grouped-query attention: 4 query, 2 key/value heads) and GPT-2 (Conv1D, fused q|k|v split
per head block, tied lm_head), built from the same seed on every rank. Against the plain model in the same
process: fp32 logits to 1e-4 absolute (the row-parallel all-reduce sums partial products in another order),
greedy `engine.module.generate` of 16 new tokens identical, also for left-padded prompts of different
lengths with an attention mask; bf16 logits within 0.03 of fp32 (bf16 rounding of each rank's partial sum
before the all-reduce, on top of bf16's own ~0.02); int8 shards with cosine >= 0.999. Each rank holds half
of every sharded weight, and its KV cache holds its own heads. Bad input fails before any weight changes.
"""
import pytest
import torch

import zerospeed
from zerospeed.inference.quant import weight_bytes
from zerospeed.tensor_parallel import tensor_parallel_layers
from zerospeed.testing.models import tiny_hf_gpt2, tiny_hf_llama
from zerospeed.testing.parity import injected_generates_like
from zerospeed.testing.spawn import run_distributed

pytest.importorskip("transformers")

BUILD = {"llama": tiny_hf_llama, "gpt2": tiny_hf_gpt2}
NEW = 16


def _prompts():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 256, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding: three prompts of 7, 12 and 9 tokens
    mask[2, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def _generate(model, ids, mask):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)


def served(rank, world, arch):
    ids, mask = _prompts()
    ref = BUILD[arch](seed=0).eval()
    out = {}
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        want_tokens = _generate(ref, ids, mask)
        model = BUILD[arch](seed=0).eval()
        engine = zerospeed.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.float32)
        assert engine.tp.size == 2 and engine.sharded
        for name, layer in tensor_parallel_layers(model):  # half of every sharded weight
            full = ref.get_submodule(name).weight
            assert layer.weight.numel() * 2 == full.numel(), name
        out["bytes"] = weight_bytes(model) / weight_bytes(ref)  # the vocabulary table split too
        out["vocab_sharded"] = sorted(n for n in engine.sharded if "lm_head" in n or "embed" in n or "wte" in n)
        out["fp32"] = (engine(ids, attention_mask=mask).logits - want).abs().max().item()
        tokens = _generate(engine.module, ids, mask)
        out["tokens"] = torch.equal(tokens, want_tokens)
        # the KV cache holds this rank's key/value heads only
        cache = engine.module(ids, attention_mask=mask, use_cache=True).past_key_values
        full_kv = ref(ids, attention_mask=mask, use_cache=True).past_key_values
        out["kv_heads"] = (cache.layers[0].keys.shape[1], full_kv.layers[0].keys.shape[1])
        bf16 = zerospeed.init_inference(BUILD[arch](seed=0).eval(), tp={"tp_size": 2}, dtype=torch.bfloat16)
        out["bf16"] = (bf16(ids, attention_mask=mask).logits.float() - want).abs().max().item()
        q = zerospeed.init_inference(BUILD[arch](seed=0).eval(), tensor_parallel={"tp_size": 2}, dtype=torch.int8)
        got = q(ids, attention_mask=mask).logits
        out["int8_cos"] = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
        out["int8_agree"] = (_generate(q.module, ids, mask)[:, 12:] == want_tokens[:, 12:]).float().mean().item()
    return out


@pytest.mark.parametrize("arch", sorted(BUILD))
@pytest.mark.parametrize("world", [2, 4])
def test_tp_inference_matches_plain_model(arch, world):
    for out in run_distributed(served, world, arch, timeout=240):
        assert out["fp32"] < 1e-4, out
        assert out["tokens"], out
        local, full = out["kv_heads"]
        assert local * 2 == full, out
        assert out["bf16"] < 0.03, out
        assert out["bytes"] <= 0.55 and len(out["vocab_sharded"]) == 2, out
        assert out["int8_cos"] >= 0.999, out
        assert out["int8_agree"] >= 0.5, out  # measured 0.67-0.69: tiny random models have flat logits


def uneven_vocab(rank, world):
    """A vocabulary that tp does not divide (GPT-2's 50,257 at tp 2): the last rank holds fewer rows."""
    import transformers

    cfg = transformers.GPT2Config(vocab_size=255, n_positions=64, n_embd=64, n_layer=1, n_head=2)
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg).eval()
    torch.manual_seed(0)
    engine = zerospeed.init_inference(transformers.GPT2LMHeadModel(cfg).eval(), tp={"tp_size": 2}, dtype=torch.float32)
    ids = torch.tensor([[0, 127, 128, 254, 3]])
    with torch.no_grad():
        got, want = engine(ids).logits, ref(ids).logits
    rows = engine.module.transformer.wte.weight.shape[0]
    return got.shape == want.shape and (got - want).abs().max().item() < 1e-5, rows


def test_uneven_vocabulary():
    assert run_distributed(uneven_vocab, 2) == [(True, 128), (True, 127)]


def bad_input(rank, world):
    import transformers

    errors = {}

    def catch(key, fn):
        try:
            fn()
            errors[key] = None
        except (ValueError, TypeError) as exc:
            errors[key] = str(exc)

    catch("world", lambda: zerospeed.init_inference(tiny_hf_llama(), tp={"tp_size": 4}, dtype=torch.float32))
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=48, n_layer=1, n_head=3)
    catch("heads", lambda: zerospeed.init_inference(transformers.GPT2LMHeadModel(cfg), tp={"tp_size": 2},
                                                    dtype=torch.float32))
    catch("seed", lambda: zerospeed.init_inference(tiny_hf_llama(seed=rank), tp={"tp_size": 2}, dtype=torch.float32))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    catch("plan", lambda: zerospeed.init_inference(torch.nn.Sequential(Block(), Block()), tp={"tp_size": 2},
                                                   dtype=torch.float32))
    # the same custom model with DeepSpeed's injection_policy: served, and equal to the plain model
    torch.manual_seed(0)
    ref = torch.nn.Sequential(Block(), Block())
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block())
    x = torch.randn(4, 8)
    engine = zerospeed.init_inference(model, tp={"tp_size": 2}, dtype=torch.float32, injection_policy={Block: ("down",)})
    errors["policy_diff"] = (engine(x) - ref(x)).abs().max().item()
    errors["policy_sharded"] = sorted(engine.sharded)
    return errors


def test_bad_input_and_injection_policy():
    for errors in run_distributed(bad_input, 2, timeout=120):
        assert "does not divide the world size 2" in errors["world"]
        assert "n_head" in errors["heads"] or "num_attention_heads" in errors["heads"], errors["heads"]
        assert "hold different weights" in errors["seed"]
        assert "injection_policy" in errors["plan"] and "Block" in errors["plan"]
        assert errors["policy_diff"] < 1e-6
        assert errors["policy_sharded"] == ["0.down", "0.up", "1.down", "1.up"]


def from_checkpoint(rank, world, arch, path):
    """A model built on the meta device, sharded, and filled from a safetensors checkpoint (`save_pretrained`):
    no rank ever allocates the full weights; the logits equal the plain model's."""
    ids, mask = _prompts()
    ref = BUILD[arch](seed=0).eval()
    with torch.device("meta"):
        model = type(ref)(ref.config).eval()
    engine = zerospeed.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.float32, checkpoint=path)
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    local = sum(p.numel() for _, layer in tensor_parallel_layers(model) for p in layer.parameters())
    full = sum(ref.get_submodule(n).weight.numel() + (ref.get_submodule(n).bias.numel()
               if getattr(ref.get_submodule(n), "bias", None) is not None else 0)
               for n, _ in tensor_parallel_layers(model))
    with torch.no_grad():
        diff = (engine(ids, attention_mask=mask).logits - ref(ids, attention_mask=mask).logits).abs().max().item()
        same = torch.equal(_generate(engine.module, ids, mask), _generate(ref, ids, mask))
    return diff, same, local, full


@pytest.mark.parametrize("arch", sorted(BUILD))
def test_meta_model_loads_its_shards_from_safetensors(arch, tmp_path):
    BUILD[arch](seed=0).save_pretrained(tmp_path, safe_serialization=True)
    for diff, same, local, full in run_distributed(from_checkpoint, 2, arch, str(tmp_path), timeout=180):
        assert diff < 1e-4 and same, (diff, same)
        assert local < full  # sharded layers hold only their part (biases of row layers are whole)


def mp_saved_then_served(rank, world, arch, path):
    """save_mp_checkpoint_path at tp 2, then a meta model served from the saved json: every rank reads its own
    shard file whole. Returns (logits of the reloaded engine == the saving one's, their max diff from the plain
    model, the files, the error of a reload at another tp size)."""
    from pathlib import Path

    ids, mask = _prompts()
    ref = BUILD[arch](seed=0).eval()
    saving = zerospeed.init_inference(BUILD[arch](seed=0).eval(), tensor_parallel={"tp_size": 2},
                                      dtype=torch.float32, save_mp_checkpoint_path=path)
    with torch.device("meta"):
        model = type(ref)(ref.config).eval()
    loaded = zerospeed.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.float32,
                                      checkpoint=f"{path}/ds_inference_config.json")
    with torch.no_grad():
        a, b = (e(ids, attention_mask=mask).logits for e in (saving, loaded))
        diff = (b - ref(ids, attention_mask=mask).logits).abs().max().item()
    with torch.device("meta"):
        other = type(ref)(ref.config).eval()
    with pytest.raises(ValueError, match="saved at tensor-parallel size 2.*tp_size=1") as info:
        zerospeed.init_inference(other, dtype=torch.float32, checkpoint=path)  # the directory works too
    # tp 1 in a world of 2 (each rank serves alone): rank 0 writes, every rank reloads the same file
    alone = f"{path}-tp1"
    zerospeed.init_inference(BUILD[arch](seed=0).eval(), dtype=torch.float32, save_mp_checkpoint_path=alone)
    with torch.device("meta"):
        other = type(ref)(ref.config).eval()
    reloaded = zerospeed.init_inference(other, dtype=torch.float32, checkpoint=alone)
    with torch.no_grad():
        alone_diff = (reloaded(ids, attention_mask=mask).logits - ref(ids, attention_mask=mask).logits).abs().max()
    assert alone_diff.item() == 0.0 and sorted(p.name for p in Path(alone).iterdir()) == [
        "ds_inference_config.json", "non-tp.safetensors", "tp_00_00.safetensors"]
    blocker = Path(path).parent / f"{Path(path).name}-file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError):  # every rank raises (its own error), none hangs; nothing else is written
        zerospeed.init_inference(BUILD[arch](seed=0).eval(), tensor_parallel={"tp_size": 2}, dtype=torch.float32,
                                 save_mp_checkpoint_path=str(blocker / "sub"))
    return torch.equal(a, b), diff, sorted(p.name for p in Path(path).iterdir()), str(info.value)


@pytest.mark.parametrize("arch", sorted(BUILD))
def test_save_mp_checkpoint_path_reloads_each_ranks_shards(arch, tmp_path):
    import json

    for equal, diff, files, _ in run_distributed(mp_saved_then_served, 2, arch, str(tmp_path), timeout=180):
        assert equal and diff < 1e-4, (equal, diff)
        assert files == ["ds_inference_config.json", "non-tp.safetensors", "tp_00_00.safetensors",
                         "tp_01_00.safetensors"]
    data = json.loads((tmp_path / "ds_inference_config.json").read_text())  # DeepSpeed's keys
    assert data["parallelization"] == "tp" and data["tp_size"] == 2 and data["dtype"] == "float32"
    assert data["checkpoints"] == {"non_tp": ["non-tp.safetensors"], "tp": ["tp_00_00.safetensors",
                                                                              "tp_01_00.safetensors"]}
    from safetensors import safe_open

    with safe_open(str(tmp_path / "tp_00_00.safetensors"), "pt") as f0, \
            safe_open(str(tmp_path / "tp_01_00.safetensors"), "pt") as f1:
        assert set(f0.keys()) == set(f1.keys()) and f0.keys()
        full = BUILD[arch](seed=0).state_dict()
        for k in f0.keys():  # each rank's half of a sharded tensor, not the full one
            assert f0.get_tensor(k).numel() + f1.get_tensor(k).numel() == full[k].numel(), k


def trained_then_served(rank, world, path):
    """Train 2 ZeRO-2 steps at dp 2, save a zerospeed checkpoint, then serve it at tp 2 from a meta model."""
    from zerospeed.testing.models import random_tokens

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2}}
    engine, *_ = zerospeed.initialize(model=tiny_hf_llama(seed=0), config=config)
    tokens = random_tokens(4, 16, seed=rank)
    for i in range(2):
        batch = tokens[2 * i:2 * i + 2]
        loss = engine(batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(path)
    ids, mask = _prompts()
    with torch.no_grad():
        want = engine.module.eval()(ids, attention_mask=mask).logits
    with torch.device("meta"):
        model = tiny_hf_llama(seed=0).__class__(engine.module.config).eval()
    served = zerospeed.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.float32, checkpoint=path)
    with torch.no_grad():
        return (served(ids, attention_mask=mask).logits - want).abs().max().item()


def test_serves_a_zerospeed_training_checkpoint(tmp_path):
    for diff in run_distributed(trained_then_served, 2, str(tmp_path / "ckpt"), timeout=180):
        assert diff < 1e-4, diff


def with_mpu(rank, world):
    """tensor_parallel.mpu: a Megatron-style mpu (here zerospeed's own ParallelMesh) gives the group."""
    from zerospeed.parallel import ParallelMesh

    mesh = ParallelMesh.build(tp=2)
    ids, mask = _prompts()
    ref = tiny_hf_llama(seed=0).eval()
    engine = zerospeed.init_inference(tiny_hf_llama(seed=0).eval(), tensor_parallel={"mpu": mesh}, dtype=torch.float32)
    with torch.no_grad():
        diff = (engine(ids, attention_mask=mask).logits - ref(ids, attention_mask=mask).logits).abs().max().item()
    return engine.tp.size, diff


def test_mpu_gives_the_tensor_parallel_group():
    for size, diff in run_distributed(with_mpu, 2):
        assert size == 2 and diff < 1e-4


def injected(rank, world):
    """Kernel injection at tp 2: the compiled decode step holds the row-parallel all-reduces and the logits'
    all-gather (on gloo `comm.traced`'s point-to-point ops, called from inductor's C++ wrapper); two generates
    of the same shape (the second reuses the compiled step) give the plain model's tokens."""
    ids, mask = _prompts()
    return injected_generates_like(lambda: tiny_hf_gpt2(seed=0).eval(), _generate, ids, mask,
                                   tensor_parallel={"tp_size": 2}, dtype=torch.float32)


@pytest.mark.slow
def test_tensor_parallel_with_kernel_injection():
    for same in run_distributed(injected, 2, timeout=300):
        assert same == [True, True], same
