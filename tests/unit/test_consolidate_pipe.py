"""The entry plan of a pipeline's `save_16bit_model` (`runtime.consolidate_pipe.plan_entries`), in one process from
PipelineModule stages built with `stage_id=`: every tensor once, a name several stages hold (a tied module's weight
and bias) owned by the first, in the order of the same model built at one stage (parameters, then persistent
buffers), for one chunk per rank and for two chunks (interleaved and V layouts, where a rank's layers are not
contiguous)."""
import pytest
import torch
from torch import nn

from zerospeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from zerospeed.runtime.consolidate_pipe import local_items, offer, plan_entries


def _specs():
    return [TiedLayerSpec("embed", nn.Linear, 8, 8), LayerSpec(nn.BatchNorm1d, 8), LayerSpec(nn.Linear, 8, 8),
            LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.BatchNorm1d, 8), LayerSpec(nn.Linear, 8, 8),
            TiedLayerSpec("embed", nn.Linear, 8, 8)]


@pytest.mark.parametrize("layout", [{}, {"chunks": 2}, {"chunks": 2, "chunk_layout": "v"}])
def test_plan_is_the_one_stage_order_with_each_tensor_once(layout):
    one = PipelineModule(_specs(), num_stages=1, stage_id=0)
    want = [(n, t.dtype, tuple(t.shape)) for n, t, _ in local_items(one)]
    assert [n for n, *_ in want] == [n for n, _ in one.named_parameters()] + \
        [n for n, _ in one.named_buffers()]  # parameters, then buffers
    stages = [PipelineModule(_specs(), num_stages=2, stage_id=r, **layout) for r in range(2)]
    holders = [r for r, m in enumerate(stages) if "embed" in m.tied_modules]
    offers = [offer(local_items(m, frozenset({"tied_modules.embed.weight"}) if r != holders[0] else frozenset()))
              for r, m in enumerate(stages)]
    plan = plan_entries(stages[1], offers)
    assert [(n, d, s) for n, d, s, _ in plan] == want
    owner = {n: o for n, _, _, o in plan}
    assert owner["tied_modules.embed.weight"] == owner["tied_modules.embed.bias"] == holders[0]
    for n, o in owner.items():  # every other tensor from the stage holding its layer
        if not n.startswith("tied_modules."):
            assert n in dict(stages[o].state_dict())


def test_exclude_frozen_and_dtypes():
    m = PipelineModule(_specs(), num_stages=1, stage_id=0).to(torch.bfloat16)
    m.get_submodule("2").bias.requires_grad_(False)
    names = [n for n, *_ in local_items(m, exclude_frozen=True)]
    assert "2.bias" not in names and "2.weight" in names and "1.running_mean" in names
    plan = plan_entries(m, [offer(local_items(m))])
    assert {d for n, d, _, _ in plan if "num_batches_tracked" not in n} == {torch.bfloat16}
    assert {d for n, d, _, _ in plan if "num_batches_tracked" in n} == {torch.int64}
