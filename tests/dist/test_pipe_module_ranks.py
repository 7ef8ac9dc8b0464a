"""zerospeed.pipe.PipelineModule on real gloo ranks: with no stage_id the stage is the rank's pipe coordinate
(DeepSpeed's PipeDataParallelTopology, pipe outermost), the topology spans the world, and a num_stages that
does not divide the world is refused unless the stage is given explicitly. No communication by the module."""
import pytest
import torch
from torch import nn

from zerospeed.pipe import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec
from zerospeed.testing.spawn import run_distributed


def _layers():
    return ([TiedLayerSpec("emb", nn.Linear, 4, 4)] + [LayerSpec(nn.Linear, 4, 4) for _ in range(6)]
            + [TiedLayerSpec("emb", nn.Linear, 4, 4)])


def stages_from_ranks(rank, world):
    module = PipelineModule(_layers(), num_stages=2, seed_layers=True, partition_method="uniform")
    out = {"stage": module.stage_id, "bounds": (module._local_start, module._local_stop),
           "dims": (module.topology().get_dim("pipe"), module.topology().get_dim("data")),
           "ties": module.tied_rank_lists("emb"), "params": sorted(n for n, _ in module.named_parameters())}
    with pytest.raises(PipelineError, match=r"num_stages \(3\) must divide the world size \(4\)"):
        PipelineModule(_layers(), num_stages=3)
    out["explicit"] = PipelineModule(_layers(), num_stages=3, stage_id=2).stage_id
    x = torch.ones(1, 4)
    out["ref"] = PipelineModule(_layers(), num_stages=1, stage_id=0, seed_layers=True, partition_method="uniform")(x)
    return out


def test_stage_is_the_pipe_coordinate_of_the_rank():
    res = run_distributed(stages_from_ranks, 4, timeout=120)
    assert [r["stage"] for r in res] == [0, 0, 1, 1]
    assert [r["bounds"] for r in res] == [(0, 4), (0, 4), (4, 8), (4, 8)]
    assert all(r["dims"] == (2, 2) and r["ties"] == [[0, 2], [1, 3]] and r["explicit"] == 2 for r in res)
    assert res[0]["params"][:2] == ["1.bias", "1.weight"] and "tied_modules.emb.weight" in res[3]["params"]
    assert all(torch.equal(r["ref"], res[0]["ref"]) for r in res)
