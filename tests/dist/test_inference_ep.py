"""Expert-parallel serving: `init_inference(model, moe={"ep_size": 2})` on real gloo ranks.

Unmodified tiny HF Mixtral and Qwen3-MoE (4 experts, top-2, random init from the same seed on every rank)
at world 2 (ep 2) and world 4 (two expert groups of 2): each rank serves its own prompts (left-padded, of
different lengths: the ranks of a group send each other different token counts), and gets the plain
model's logits to 1e-5 absolute (dropless: every token reaches its k experts; the sum over routes runs in
another order) and its greedy tokens exactly, holding half of each fused expert weight. Built on the meta
device with `checkpoint`, each rank reads only its experts' rows. With dtype=torch.int8 each rank quantizes its
own experts (logits' cosine >= 0.999 with fp32). `save_mp_checkpoint_path` writes each expert rank's rows to
a file of their own, which a meta model reloads at ep 2 and at ep 1. A model of `zerospeed.moe.layer.MoE`
layers built with ep_size 2 equals the same layers at ep 1 holding every expert.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zerospeed.testing.spawn import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB, E, NEW = 64, 4, 12


def _model(kind: str, kv_heads: int = 1):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=kv_heads, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                  pad_token_id=0)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=32, num_local_experts=E, num_experts_per_tok=2, **common)
        return transformers.MixtralForCausalLM(cfg).eval()
    cfg = transformers.Qwen3MoeConfig(intermediate_size=32, moe_intermediate_size=16, num_experts=E,
                                      num_experts_per_tok=2, head_dim=8, norm_topk_prob=True, **common)
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


def _prompts(rank: int):
    g = torch.Generator().manual_seed(11 + rank)  # each rank its own prompts
    ids = torch.randint(1, VOCAB, (2, 6 + 3 * rank), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2 + rank] = 0  # left padding
    return ids.masked_fill(mask == 0, 0), mask


def _generate(model, ids, mask):
    # min_new_tokens: every rank of an expert group runs the same number of forwards (they are collective)
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                          pad_token_id=0)


def served(rank, world, kind, path):
    import torch.distributed as dist

    import zerospeed

    ids, mask = _prompts(rank)
    ref = _model(kind)
    out = {}
    with torch.no_grad():
        want, want_tokens = ref(ids, attention_mask=mask).logits, _generate(ref, ids, mask)
        engine = zerospeed.init_inference(_model(kind), moe={"ep_size": 2}, dtype=torch.float32)
        group_ranks = dist.get_process_group_ranks(engine.ep.group)
        out["group"] = (engine.ep.size, engine.ep.rank, group_ranks)
        out["experts"] = engine.experts
        out["fp32"] = (engine(ids, attention_mask=mask).logits - want).abs().max().item()
        out["tokens"] = torch.equal(_generate(engine.module, ids, mask), want_tokens)
        lo, hi = engine.ep.rank * E // 2, (engine.ep.rank + 1) * E // 2
        split = engine.module.get_submodule(engine.experts[0])
        full = ref.get_submodule(engine.experts[0])
        out["rows"] = torch.equal(split.gate_up_proj, full.gate_up_proj[lo:hi]) and \
            torch.equal(split.down_proj, full.down_proj[lo:hi]) and split.gate_up_proj.shape[0] == E // 2
        # built on the meta device: each rank reads its experts' rows from the checkpoint
        with torch.device("meta"):
            meta = type(ref)(ref.config).eval()
        loaded = zerospeed.init_inference(meta, moe={"ep_size": 2}, dtype=torch.float32, checkpoint=path)
        split = loaded.module.get_submodule(engine.experts[0])
        out["meta_rows"] = torch.equal(split.gate_up_proj, full.gate_up_proj[lo:hi])
        out["meta_fp32"] = (loaded(ids, attention_mask=mask).logits - want).abs().max().item()
        # int8: each rank quantizes its own experts, per expert and output row
        q = zerospeed.init_inference(_model(kind), moe={"ep_size": 2}, dtype=torch.int8)
        got = q(ids, attention_mask=mask).logits
        out["int8_cos"] = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
        out["int8_experts"] = q.module.get_submodule(engine.experts[0]).num_local_experts
        # save_mp_checkpoint_path: each expert rank's rows in a file of their own; reloaded at ep 2 and at ep 1
        saved = f"{path}-mp"
        zerospeed.init_inference(_model(kind), moe={"ep_size": 2}, dtype=torch.float32, save_mp_checkpoint_path=saved)
        reloaded = []
        for ep in (2, 1):
            with torch.device("meta"):
                meta = type(ref)(ref.config).eval()
            again = zerospeed.init_inference(meta, moe={"ep_size": ep}, dtype=torch.float32, checkpoint=saved)
            reloaded.append((again(ids, attention_mask=mask).logits - want).abs().max().item())
        out["mp_reloaded"] = reloaded
        out["mp_files"] = sorted(p.name for p in __import__("pathlib").Path(saved).iterdir())
    return out


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_serving_matches_the_plain_model(kind, world, tmp_path):
    _model(kind).save_pretrained(tmp_path, safe_serialization=True)
    outs = run_distributed(served, world, kind, str(tmp_path), timeout=240)
    for rank, out in enumerate(outs):
        assert out["group"] == (2, rank % 2, [rank - rank % 2, rank - rank % 2 + 1]), out  # consecutive ranks
        assert out["experts"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], out
        assert out["fp32"] < 1e-5 and out["tokens"] and out["rows"], out
        assert out["meta_rows"] and out["meta_fp32"] < 1e-5, out
        assert out["int8_cos"] >= 0.999 and out["int8_experts"] == E // 2, out
        assert max(out["mp_reloaded"]) < 1e-5, out
        assert out["mp_files"] == ["ds_inference_config.json", "ep_00.safetensors", "ep_01.safetensors",
                                   "non-tp.safetensors", "tp_00_00.safetensors"], out


def injected(rank, world):
    """Kernel injection at ep 2: the compiled decode step around the eager expert dispatch; two generates of
    the same shape (the second reuses the compiled step) give the plain model's tokens."""
    from zerospeed.testing.parity import injected_generates_like

    ids, mask = _prompts(rank)
    return injected_generates_like(lambda: _model("mixtral"), _generate, ids, mask, moe={"ep_size": 2},
                                   dtype=torch.float32)


@pytest.mark.slow
def test_expert_parallel_with_kernel_injection():
    for same in run_distributed(injected, 2, timeout=300):
        assert same == [True, True], same


def tp_and_ep(rank, world):
    """tp 2 x ep 2 at world 4: the attention split over tensor groups [0, 1] and [2, 3], the experts over the
    ranks of one tensor coordinate, [0, 2] and [1, 3]."""
    import torch.distributed as dist

    import zerospeed

    ids, mask = _prompts(rank // 2)  # the two ranks of a tensor group serve the same prompts
    ref = _model("mixtral", kv_heads=2)
    with torch.no_grad():
        want, want_tokens = ref(ids, attention_mask=mask).logits, _generate(ref, ids, mask)
        engine = zerospeed.init_inference(_model("mixtral", kv_heads=2), tensor_parallel={"tp_size": 2},
                                          moe={"ep_size": 2}, dtype=torch.float32)
        groups = (dist.get_process_group_ranks(engine.tp.group), dist.get_process_group_ranks(engine.ep.group))
        diff = (engine(ids, attention_mask=mask).logits - want).abs().max().item()
        same = torch.equal(_generate(engine.module, ids, mask), want_tokens)
        heads = engine.module.model.layers[0].self_attn.q_proj.weight.shape[0] * 2 == ref.config.hidden_size
    return groups, diff, same, heads, engine.ep.rank


def test_expert_parallel_with_tensor_parallel():
    for rank, (groups, diff, same, heads, ep_rank) in enumerate(run_distributed(tp_and_ep, 4, timeout=240)):
        assert groups == ([rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2]), groups
        assert ep_rank == rank // 2 and heads, (ep_rank, heads)
        assert diff < 1e-5 and same, (diff, same)


M = 8


class _Net(nn.Module):
    """Linear -> MoE (4 experts, top-2, DeepSpeed's layer) -> Linear; global expert g shifted by 0.05 g."""

    def __init__(self, ep: int, rank: int):
        from zerospeed.moe.layer import MoE

        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(M, M)
        expert = nn.Sequential(nn.Linear(M, 2 * M), nn.ReLU(), nn.Linear(2 * M, M))
        self.moe = MoE(M, expert, num_experts=E, ep_size=ep, k=2, min_capacity=2, use_rts=False,
                       eval_capacity_factor=2.0)
        self.out = nn.Linear(M, M)
        with torch.no_grad():
            for i, ex in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                for p in ex.parameters():
                    p.add_(0.05 * (rank * (E // ep) + i))

    def forward(self, x):
        return self.out(self.moe(self.inp(x))[0])


def moe_layer_served(rank, world):
    import zerospeed

    x = torch.randn(10, M, generator=torch.Generator().manual_seed(rank))
    want = _Net(1, 0).eval()(x)
    model = _Net(2, rank % 2).eval()
    with pytest.raises(ValueError, match="built with ep_size=2"):
        zerospeed.init_inference(model, moe={"ep_size": 4}, dtype=torch.float32)
    engine = zerospeed.init_inference(model, dtype=torch.float32)  # the layers' own ep_size, no config needed
    with torch.no_grad():
        got = engine(x)
    with pytest.raises(ValueError, match="does not divide the world size 2"):
        zerospeed.init_inference(_model("mixtral"), moe={"ep_size": 4}, dtype=torch.float32)
    return engine.ep.size, (got - want).abs().max().item()


def test_moe_layers_get_their_expert_group():
    for ep, diff in run_distributed(moe_layer_served, 2, timeout=120):
        assert ep == 2 and diff < 1e-6, (ep, diff)
