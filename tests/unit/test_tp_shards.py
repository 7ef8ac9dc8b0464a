"""Tensor-parallel shard math (pure): shard_tensor / unshard_tensors round trip, shard_pieces maps every
local flat range onto exactly the full-tensor elements it holds (fused blocks, any dim), plans."""
import pytest
import torch

from zerospeed.tensor_parallel import PRESETS, ShardSpec, plan_from_config, shard_tensor, unshard_tensors
from zerospeed.tensor_parallel.layers import shard_pieces

CASES = [((8, 6), 0, 1), ((8, 6), 1, 1), ((6, 12), 1, 3), ((12,), 0, 3), ((4, 6, 4), 1, 1), ((12, 4), 0, 3)]


@pytest.mark.parametrize("shape,dim,blocks", CASES)
@pytest.mark.parametrize("tp", [1, 2])
def test_shard_pieces_cover_the_shard(shape, dim, blocks, tp):
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    shards = []
    for rank in range(tp):
        spec = ShardSpec(dim, tp, rank, blocks)
        local = shard_tensor(full, spec)
        shards.append(local)
        flat = local.reshape(-1)
        n = flat.numel()
        for a, b in [(0, n), (1, n - 1), (3, 5), (n // 2, n)]:
            if b <= a:
                continue
            pieces = shard_pieces(spec, shape, a, b)
            assert [p[0] for p in pieces] == sorted(p[0] for p in pieces) and pieces[0][0] == a
            got = torch.cat([full.reshape(-1)[g:g + length] for _, g, length in pieces])
            assert torch.equal(got, flat[a:b])
    assert torch.equal(unshard_tensors(shards, ShardSpec(dim, tp, 0, blocks)), full)


def test_column_shard_of_dim0_is_one_run_row_shard_one_per_row():
    assert shard_pieces(ShardSpec(0, 2, 1), (8, 6), 0, 24) == [(0, 24, 24)]
    assert len(shard_pieces(ShardSpec(1, 2, 1), (8, 6), 0, 24)) == 8


def test_gpt2_fused_qkv_is_split_per_block():
    # q|k|v of 2 heads of width 2 each: rank 0 takes head 0 of q, k and v, not all of q
    full = torch.arange(12)
    assert shard_tensor(full, ShardSpec(0, 2, 0, blocks=3)).tolist() == [0, 1, 4, 5, 8, 9]


def test_plan_from_partition_config():
    plan = plan_from_config({"layer_specs": [{"patterns": [r".*\.o_proj\.weight$"], "partition_type": "row"},
                                             {"patterns": [r".*\.gate_up_proj\.weight$"], "partition_type": "column",
                                              "shape": [2, -1]}]})
    assert plan.rule_for("model.layers.3.self_attn.o_proj.weight").partition_type == "row"
    assert plan.rule_for("model.layers.3.mlp.gate_up_proj.weight").blocks == 2
    assert plan.rule_for("model.embed_tokens.weight") is None
    assert PRESETS["gpt2"].rule_for("transformer.h.0.attn.c_attn.weight").blocks == 3
    with pytest.raises(ValueError, match="unknown keys"):
        plan_from_config({"layer_specs": [{"patterns": ["x"], "partition": "row"}]})
    with pytest.raises(ValueError, match="partition_type"):
        plan_from_config({"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]})
