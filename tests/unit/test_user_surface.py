"""DeepSpeed's helpers that user scripts import, at their DeepSpeed paths with `zerospeed` for `deepspeed`
(DeepSpeedExamples' training and inference scripts): `zerospeed.utils.RepeatingLoader`, `zerospeed.OnDevice`,
`zerospeed.runtime.utils.set_random_seed` / `see_memory_usage`, `zerospeed.utils.logger`, the ZeRO-3 leaf-module
flags, and the subpackages reachable as attributes after a bare `import zerospeed`."""
import logging
import random

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.zero.stage3_units import find_unit_modules


def test_subpackages_are_attributes_after_import_zerospeed():
    # DeepSpeedExamples: `deepspeed.moe.layer.MoE(...)`, `deepspeed.runtime.utils.set_random_seed(...)`
    assert zerospeed.moe.layer.MoE.__name__ == "MoE"
    assert zerospeed.pipe.PipelineModule.__name__ == "PipelineModule"
    assert callable(zerospeed.runtime.utils.set_random_seed)
    assert zerospeed.utils.RepeatingLoader is zerospeed.runtime.dataloader.RepeatingLoader
    assert isinstance(zerospeed.utils.logger, logging.Logger)
    from zerospeed.runtime.engine import DeepSpeedEngine  # `isinstance(engine, DeepSpeedEngine)` in user code
    assert DeepSpeedEngine is zerospeed.ZeroSpeedEngine
    from zerospeed.utils.logging import logger
    assert logger is zerospeed.utils.logger


def test_repeating_loader_starts_again_at_the_end():
    loader = torch.utils.data.DataLoader(torch.arange(5), batch_size=2)
    it = iter(zerospeed.utils.RepeatingLoader(loader))
    got = [next(it).tolist() for _ in range(5)]
    assert got == [[0, 1], [2, 3], [4], [0, 1], [2, 3]]
    with pytest.raises(StopIteration):  # nothing to repeat
        next(zerospeed.utils.RepeatingLoader([]))


def test_on_device_builds_on_meta_in_the_dtype():
    with zerospeed.OnDevice(dtype=torch.bfloat16, device="meta"):
        lin, emb = nn.Linear(4, 3), nn.Embedding(5, 2)
        ids, on_host = torch.zeros(3, dtype=torch.long), torch.ones(2, device="cpu")
    assert (lin.weight.device.type, lin.weight.dtype, lin.bias.dtype, emb.weight.dtype) == \
        ("meta", torch.bfloat16, torch.bfloat16, torch.bfloat16)
    assert (ids.device.type, ids.dtype) == ("meta", torch.long)  # integers keep their dtype
    assert (on_host.device.type, on_host.dtype) == ("cpu", torch.bfloat16)  # an explicit device stays
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # gone after the block
    with zerospeed.OnDevice(dtype=torch.float16, device="meta", enabled=False):
        assert nn.Linear(2, 2).weight.dtype == torch.float32
    with pytest.raises(ValueError, match="floating-point dtype"):
        zerospeed.OnDevice(dtype=torch.int8)


def test_set_random_seed_seeds_python_numpy_and_torch():
    import numpy as np

    draws = []
    for _ in range(2):
        zerospeed.runtime.utils.set_random_seed(7)
        draws.append((random.random(), float(np.random.rand()), float(torch.rand(1))))
    assert draws[0] == draws[1]


def test_see_memory_usage_prints_only_when_forced(capsys):
    zerospeed.runtime.utils.see_memory_usage("quiet")
    assert capsys.readouterr().out == ""
    zerospeed.runtime.utils.see_memory_usage("after init", force=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "after init" and lines[1].startswith("MA ") and "CPU Virtual Memory:  used = " in lines[2]


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)


class SparseBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 2)
        self.experts = nn.ModuleList([Expert(), Expert()])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.moe = SparseBlock()


def test_z3_leaf_modules_become_one_gather_unit():
    from zerospeed.utils import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module

    net = Net()
    assert find_unit_modules(net) == ["moe.experts.0", "moe.experts.1"]  # each expert alone
    assert set_z3_leaf_modules(net, [SparseBlock]) == [net.moe]
    assert z3_leaf_module(net.moe) and get_z3_leaf_modules(net) == [net.moe]
    assert find_unit_modules(net) == ["moe"]  # gate and experts: one all-gather
    assert unset_z3_leaf_modules(net, ["SparseBlock"]) == [net.moe]  # by class name
    assert find_unit_modules(net) == ["moe.experts.0", "moe.experts.1"]
    assert set_z3_leaf_modules(net, [f"{__name__}.Expert"]) == [net.moe.experts[0], net.moe.experts[1]]
    with pytest.raises(ValueError, match=r"no module of the classes \['Conv2d'\].*'Expert'"):
        set_z3_leaf_modules(net, [nn.Conv2d])
    assert set_z3_leaf_modules(net, [nn.Conv2d], raise_if_not_found=False) == []
    with pytest.raises(TypeError, match="classes or class names"):
        set_z3_leaf_modules(net, [3])
