"""ZeRO-3 plans without processes: gather-unit selection, flat layout / padding math, unit lifecycle."""
import pytest
import torch
from torch import nn

from zerospeed.testing.models import tiny_gpt
from zerospeed.zero.stage3_params import ParamStatus, ShardedUnit
from zerospeed.zero.stage3_units import ROOT, find_unit_modules, plan_units


def test_gpt_blocks_are_units_and_tied_weight_is_in_root():
    model = tiny_gpt(seed=0, bias=False, n_layer=3)
    plans = plan_units(model)
    assert [p.name for p in plans] == [ROOT, "blocks.0", "blocks.1", "blocks.2"]
    root = plans[0]
    assert root.params == ("wte.weight", "wpe.weight", "ln_f.weight")
    assert ("wte.weight", "lm_head.weight") in root.aliases  # tied: one parameter, two names
    assert plans[1].params == ("blocks.0.ln1.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight",
                               "blocks.0.ln2.weight", "blocks.0.fc.weight", "blocks.0.fc_out.weight")
    assert sum(p.numel for p in plans) == model.cfg.num_params() == sum(p.numel() for p in model.parameters())
    d = model.cfg.d_model
    assert [p.numel for p in plans[1:]] == [2 * d + 12 * d * d] * 3


def test_small_parameters_join_the_root_unit():
    model = tiny_gpt(seed=0, bias=True)
    plans = plan_units(model, persistence_threshold=100)  # LayerNorms (64) and the 64-element biases
    small = ["ln1.weight", "ln1.bias", "attn.proj.bias", "ln2.weight", "ln2.bias", "fc_out.bias"]
    assert set(plans[0].params) == {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias",
                                    *(f"blocks.{i}.{n}" for i in range(2) for n in small)}
    assert all(n >= 100 for p in plans[1:] for n in p.numels)  # e.g. fc.bias (256) stays in its block
    assert "blocks.0.fc.bias" in plans[1].params
    assert sum(p.numel for p in plans) == model.cfg.num_params()
    # everything below the default threshold (1e5): one unit
    assert [p.name for p in plan_units(model, persistence_threshold=100_000)] == [ROOT]


class Shared(nn.Module):
    def __init__(self, shared: nn.Linear):
        super().__init__()
        self.own = nn.Linear(4, 4)
        self.shared = shared
        self.inner = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])  # stays inside the block


class SharedModel(nn.Module):
    def __init__(self):
        super().__init__()
        common = nn.Linear(4, 4, bias=False)
        self.layers = nn.ModuleList([Shared(common), Shared(common)])
        self.head = nn.Sequential(nn.Linear(4, 4), nn.ReLU())  # mixed classes: not blocks


def test_parameter_shared_between_blocks_goes_to_root_and_inner_lists_stay_inside():
    model = SharedModel()
    assert find_unit_modules(model) == ["layers.0", "layers.1"]
    plans = plan_units(model)
    assert plans[0].params == ("layers.0.shared.weight", "head.0.weight", "head.0.bias")
    assert plans[0].aliases[0] == ("layers.0.shared.weight", "layers.1.shared.weight")
    assert "layers.0.inner.1.weight" in plans[1].params and len(plans[1].params) == 6


def test_leaf_modules_by_class_name_and_suffix_and_frozen_parameters_are_not_managed():
    model = SharedModel()
    model.head[0].bias.requires_grad_(False)
    assert find_unit_modules(model, leaf_classes=["Sequential"]) == ["layers.0", "layers.1", "head"]
    # outermost match wins: "layers.0.own" is inside the block "layers.0"
    assert find_unit_modules(model, leaf_name_suffixes=[".own", "head.0"]) == ["layers.0", "layers.1", "head.0"]
    plans = plan_units(model, leaf_names=["head"])
    assert [p.name for p in plans] == [ROOT, "layers.0", "layers.1", "head"]
    assert plans[3].params == ("head.0.weight",)  # the frozen bias stays whole, unmanaged
    with pytest.raises(ValueError, match="persistence_threshold"):
        plan_units(model, persistence_threshold=-1)


def test_sharded_unit_keeps_its_slice_and_checks_transitions():
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)  # 6 + 2 = 8 elements -> padded to 9 over 3 ranks
    full = torch.cat([lin.weight.detach().reshape(-1), lin.bias.detach()])
    unit = ShardedUnit(1, "lin", [(lin.weight, "weight", ("weight",)), (lin.bias, "bias", ("bias",))],
                       rank=2, world=3)
    assert unit.status is ParamStatus.SHARDED and unit.layout.padded_numel == 9
    assert lin.weight.numel() == 0 and lin.weight.shape == (0,)  # placeholder, never the stale data
    assert unit.gathered_bytes() == 0
    assert torch.equal(unit.shard.detach(), torch.cat([full[6:], torch.zeros(1)]))  # rank 2: 2 values + padding
    assert torch.equal(unit.params[1].local_shard(), lin_bias := full[6:8]) and lin_bias.numel() == 2
    assert unit.params[0].local_shard().numel() == 0
    assert unit.params[0].status is ParamStatus.SHARDED
    with pytest.raises(RuntimeError, match="illegal transition sharded -> gathered"):
        unit.finish_gather()
    with pytest.raises(RuntimeError, match="illegal transition sharded -> sharded"):
        unit.release()
