"""zerospeed.pipe: partition math (against DeepSpeed 0.19.8's functions and by hand), PipelineModule built
stage by stage in one process (no process group: `stage_id=`), tied layers, activation checkpointing, errors."""
from __future__ import annotations

import os
import random

import pytest
import torch
from torch import nn

from zerospeed.parallel.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from zerospeed.pipe import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec
from zerospeed.pipe.partition import (check_partition, partition_balanced, partition_from_bounds, partition_uniform,
                                      stage_sizes, type_weights)


# ---- partition math --------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, p, expected", [
    (10, 4, [0, 3, 6, 8, 10]), (8, 2, [0, 4, 8]), (8, 3, [0, 3, 6, 8]), (7, 7, list(range(8))),
    (3, 5, [0, 1, 2, 3, 3, 3]), (5, 1, [0, 5]), (0, 2, [0, 0, 0])])
def test_partition_uniform_by_hand(n, p, expected):
    assert partition_uniform(n, p) == expected


@pytest.mark.parametrize("weights, p, expected", [
    ([1, 1, 1, 1], 2, [0, 2, 4]),
    ([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2, [0, 1, 11]),   # one heavy layer alone: spread 0
    ([3, 3, 3, 9], 2, [0, 3, 4]),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, [0, 5, 7, 9]),        # sums 15, 13, 17: spread 4, the least
    ([5, 5], 2, [0, 1, 2]), ([5, 5, 5], 5, [0, 1, 2, 3, 3, 3]),
])
def test_partition_balanced_by_hand(weights, p, expected):
    assert partition_balanced(weights, p) == expected


def _cases():
    rng = random.Random(0)
    cases = []
    for t in range(150):
        n, p = rng.randint(1, 13), rng.randint(1, 6)
        if t % 3 == 0:
            w = [rng.random() * 5 for _ in range(n)]
        elif t % 3 == 1:
            w = [rng.choice([0, 1]) for _ in range(n)]
        else:
            w = [rng.choice([0, rng.randint(1, 10), rng.randint(1, 10 ** 6)]) for _ in range(n)]
        cases.append((w, p))
    cases += [([0] * 6, 3), ([4096 * 4096 + 4096] * 8, 2), ([1, 0, 0, 0, 0, 1], 2), ([7], 1)]
    return cases


def test_partition_functions_equal_deepspeeds():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ds = pytest.importorskip("deepspeed.runtime.utils")
    for weights, p in _cases():
        assert partition_balanced(weights, p) == [int(x) for x in ds.partition_balanced(weights, p)], (weights, p)
    for n in range(0, 20):
        for p in range(1, 9):
            assert partition_uniform(n, p) == [int(x) for x in ds.partition_uniform(n, p)], (n, p)


def test_partition_helpers_and_their_errors():
    assert partition_from_bounds([0, 3, 8], 8, 2) == [0, 3, 8]
    assert stage_sizes([0, 3, 8]) == [3, 5]
    assert type_weights(["Linear", "ReLU", None, "linear"], "lin") == [1, 0, 0, 1]
    with pytest.raises(PipelineError, match=r"stage 1 with 0 layers.*\[3, 0, 5\]"):
        check_partition([0, 3, 3, 8], 8, method="x")
    with pytest.raises(PipelineError, match="need 3 boundaries"):
        partition_from_bounds([0, 8], 8, 2)
    with pytest.raises(PipelineError, match="start at 0 and end at the number of layers"):
        partition_from_bounds([0, 3, 7], 8, 2)
    with pytest.raises(PipelineError, match="must be integers"):
        partition_from_bounds([0, 2.5, 8], 8, 2)
    with pytest.raises(PipelineError, match="finite and >= 0"):
        partition_balanced([1, -1, 2], 2)
    with pytest.raises(PipelineError, match="invalid regular expression"):
        type_weights(["Linear"], "(")


# ---- PipelineModule: stages, weights, forward -----------------------------------------------------------
def _linear_specs(n=8, width=6):
    return [LayerSpec(nn.Linear, width, width) for _ in range(n)]


def _params(module):
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def test_stages_hold_their_layers_and_chain_to_the_one_stage_forward():
    full = PipelineModule(_linear_specs(), num_stages=1, seed_layers=True)
    s0 = PipelineModule(_linear_specs(), num_stages=2, stage_id=0, seed_layers=True)
    s1 = PipelineModule(_linear_specs(), num_stages=2, stage_id=1, seed_layers=True)
    assert s0.parts == s1.parts == [0, 4, 8] and full.parts == [0, 8]
    assert (s0._local_start, s0._local_stop, s1._local_start, s1._local_stop) == (0, 4, 4, 8)
    assert len(s0.forward_funcs) == len(s1.forward_funcs) == 4
    assert sorted(s0.fwd_map) == ["0", "1", "2", "3"] and s1.fwd_map == {"4": 0, "5": 1, "6": 2, "7": 3}
    assert s0.is_first_stage() and not s0.is_last_stage() and s1.is_last_stage()
    ref = _params(full)
    for stage in (s0, s1):
        got = _params(stage)
        assert set(got) == {f"{i}.{w}" for i in range(stage._local_start, stage._local_stop) for w in ("weight", "bias")}
        for name, value in got.items():
            assert torch.equal(value, ref[name]), name
    x = torch.randn(5, 6)
    assert torch.equal(s1(s0(x)), full(x))
    assert [s0.stage_owner(i) for i in range(8)] == [0] * 4 + [1] * 4


@pytest.mark.parametrize("layout,held", [("interleaved", {0: [0, 2], 1: [1, 3]}), ("v", {0: [0, 3], 1: [1, 2]})])
def test_chunks_hold_their_model_stages_and_chain_to_the_one_stage_forward(layout, held):
    """chunks=2: 8 layers in 4 model stages of 2; rank r holds the layout's stages, under global layer names."""
    full = PipelineModule(_linear_specs(), num_stages=1, seed_layers=True)
    ranks = {r: PipelineModule(_linear_specs(), num_stages=2, stage_id=r, seed_layers=True, chunks=2,
                               chunk_layout=layout) for r in (0, 1)}
    ref = _params(full)
    for r, module in ranks.items():
        assert module.parts == [0, 2, 4, 6, 8] and module.model_stages == held[r]
        assert [module.stage_rank(s) for s in range(4)] == [s % 2 for s in range(4)] if layout == "interleaved" \
            else [0, 1, 1, 0]
        names = {f"{i}.{w}" for s in held[r] for i in range(2 * s, 2 * s + 2) for w in ("weight", "bias")}
        assert set(_params(module)) == names
        assert all(torch.equal(v, ref[k]) for k, v in _params(module).items())
        with pytest.raises(PipelineError, match="holds 2 model stages"):
            module(torch.randn(5, 6))
    assert ranks[0].is_first_stage() and ranks[0].is_last_stage() == (layout == "v")
    x = torch.randn(5, 6)
    y = x
    for s in range(4):
        y = ranks[s % 2 if layout == "interleaved" else [0, 1, 1, 0][s]].forward_chunk(s, y)
    assert torch.equal(y, full(x))
    with pytest.raises(PipelineError, match="model stage 1 is not on this rank"):
        ranks[0].forward_chunk(1, x)


def test_chunk_layouts_are_checked():
    with pytest.raises(PipelineError, match="exactly 2 chunks"):
        PipelineModule(_linear_specs(), num_stages=2, stage_id=0, chunks=3, chunk_layout="v")
    with pytest.raises(PipelineError, match="unknown chunk layout"):
        PipelineModule(_linear_specs(), num_stages=2, stage_id=0, chunks=2, chunk_layout="zigzag")
    with pytest.raises(PipelineError, match="num_stages=3 x chunks=3 is more than the 8 layers"):
        PipelineModule(_linear_specs(), num_stages=3, stage_id=0, chunks=3)


def test_seed_layers_gives_the_weights_of_seeded_plain_modules_and_seed_fn_is_called():
    torch.manual_seed(0)
    module = PipelineModule(_linear_specs(4), num_stages=2, stage_id=1, seed_layers=True, base_seed=77)
    torch.manual_seed(77 + 3)
    assert torch.equal(module.get_submodule("3").weight, nn.Linear(6, 6).weight)
    seeds = []
    PipelineModule(_linear_specs(4), num_stages=2, stage_id=1, seed_layers=True, base_seed=10, seed_fn=seeds.append)
    assert seeds == [12, 13]


def test_parameters_method_balances_trainable_counts_without_drawing_random_numbers():
    frozen = nn.Linear(50, 50)
    frozen.requires_grad_(False)
    layers = [LayerSpec(nn.Linear, 4, 50), LayerSpec(nn.Linear, 50, 50), lambda x: x, frozen,
              LayerSpec(nn.Linear, 50, 4), nn.ReLU()]
    module = PipelineModule(layers, num_stages=2, stage_id=1)
    state = torch.get_rng_state()
    counts = module._count_layer_params()       # builds each spec on the meta device
    assert torch.equal(torch.get_rng_state(), state)
    assert counts == [250, 2550, 0, 0, 204, 0]  # frozen parameters, callables and ReLU count 0
    assert module.parts == partition_balanced(counts, 2) == [0, 1, 6]
    assert module.forward_funcs[1] is layers[2] and module.forward_funcs[2] is frozen
    # plain modules keep their identity and names; callables are run, not registered
    assert [n for n, _ in module.named_children()] == ["tied_modules", "1", "3", "4", "5"]
    assert module(torch.randn(3, 50)).shape == (3, 4)


def test_uniform_type_and_explicit_partitions():
    layers = [LayerSpec(nn.Embedding, 10, 6)] + [LayerSpec(nn.Linear, 6, 6), LayerSpec(nn.GELU)] * 3 + [nn.LayerNorm(6)]
    assert PipelineModule(layers, num_stages=3, stage_id=0, partition_method="uniform").parts == [0, 3, 6, 8]
    by_type = PipelineModule(layers, num_stages=3, stage_id=2, partition_method="type:linear")
    assert by_type.parts == partition_balanced([0, 1, 0, 1, 0, 1, 0, 0], 3)
    assert by_type.parts == [0, 3, 5, 8]   # one Linear per stage; DeepSpeed's tie-break
    assert PipelineModule(layers, num_stages=2, stage_id=1, partition_method="TYPE:gelu|embed").parts == \
        partition_balanced([1, 0, 1, 0, 1, 0, 1, 0], 2)
    explicit = PipelineModule(layers, num_stages=3, stage_id=1, partition_method=[0, 1, 7, 8])
    assert explicit.partitions() == [0, 1, 7, 8] and len(explicit.forward_funcs) == 6
    seq = PipelineModule(nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6)), num_stages=1)
    assert seq.parts == [0, 3] and isinstance(seq.forward_funcs[1], nn.ReLU)


def test_topology_gives_the_stages_and_the_tied_rank_groups():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2)
    layers = [TiedLayerSpec("emb", nn.Linear, 4, 4)] + _linear_specs(2, 4) + [TiedLayerSpec("emb", nn.Linear, 4, 4)]
    module = PipelineModule(layers, topology=topo, stage_id=1, partition_method="uniform")
    assert module.num_stages == module.num_pipeline_stages() == 2 and module.topology() is topo
    assert module.tied_stages("emb") == [0, 1] and module.tied_layers("emb") == [0, 3]
    assert module.tied_rank_lists("emb") == [[0, 2], [1, 3]]   # pipe outermost: rank = pipe * 2 + data
    with pytest.raises(PipelineError, match="num_stages=3 but the topology's pipe axis has 2"):
        PipelineModule(layers, num_stages=3, topology=topo, stage_id=0)


# ---- tied layers ----------------------------------------------------------------------------------------
def _tied_layers():
    """Embedding [V=16, 8] at the start, the same matrix as output head ([B, T, 8] @ [8, 16]) at the end."""
    return [TiedLayerSpec("embed", nn.Embedding, 16, 8),
            LayerSpec(nn.Linear, 8, 8),
            LayerSpec(nn.Linear, 8, 8),
            TiedLayerSpec("embed", nn.Embedding, 16, 8, forward_fn=lambda m, x: x @ m.weight.t())]


def test_tied_layers_build_once_per_stage_and_share_the_module():
    layers = _tied_layers()
    full = PipelineModule(layers, num_stages=1, seed_layers=True, partition_method="uniform")
    emb = full.tied_modules["embed"]
    assert full.forward_funcs[0] is emb and full.forward_funcs[3].args == (emb,)
    assert [n for n, _ in full.named_parameters()] == ["tied_modules.embed.weight", "1.weight", "1.bias",
                                                       "2.weight", "2.bias"]
    assert full.tied_stages("embed") == [0] and full.tied_rank_lists("embed") == [[0]]
    assert full.tied_weights("embed")[0] is emb.weight
    tokens = torch.tensor([[1, 5, 7]])
    h = full.forward_funcs[2](full.forward_funcs[1](emb(tokens)))
    assert torch.equal(full(tokens), h @ emb.weight.t())
    s0 = PipelineModule(layers, num_stages=2, stage_id=0, seed_layers=True, partition_method="uniform")
    s1 = PipelineModule(layers, num_stages=2, stage_id=1, seed_layers=True, partition_method="uniform")
    assert s0.tied_stages("embed") == s1.tied_stages("embed") == [0, 1]
    # each stage built the tie from the seed of its first layer there: stage 1's copy must be synchronised
    # from stage 0 (the engine's broadcast); the structure is right, and after a copy the chain matches
    assert list(s1.tied_modules) == ["embed"] and s1.tied_weight_attrs == {"embed": ["weight"]}
    with torch.no_grad():
        s1.tied_modules["embed"].weight.copy_(s0.tied_modules["embed"].weight)
    assert torch.equal(s1(s0(tokens)), full(tokens))
    with pytest.raises(KeyError, match="no TiedLayerSpec with key 'head'"):
        s0.tied_stages("head")


def test_tied_weight_attr_must_exist():
    with pytest.raises(PipelineError, match=r"no attribute 'proj.weight'.*tied_weight_attr"):
        PipelineModule([TiedLayerSpec("k", nn.Linear, 2, 2, tied_weight_attr="proj.weight")], num_stages=1)
    spec = TiedLayerSpec("k", nn.Linear, 2, 2, tied_weight_attr="weight")
    assert spec.tied_weight_attr == ["weight"] and repr(spec) == "Linear(2, 2)"


# ---- activation checkpointing --------------------------------------------------------------------------
def _grads_and_output(interval, func=None, checkpointable_layers=None, requires_grad=True):
    layers = [LayerSpec(nn.Linear, 6, 6), LayerSpec(nn.Tanh), LayerSpec(nn.Dropout, 0.3)] * 3
    kwargs = {} if func is None else {"activation_checkpoint_func": func}
    module = PipelineModule(layers, num_stages=1, seed_layers=True, activation_checkpoint_interval=interval,
                            checkpointable_layers=checkpointable_layers, **kwargs)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3)).requires_grad_(requires_grad)
    out = module(x)
    out.square().sum().backward()
    return out.detach(), {n: p.grad for n, p in module.named_parameters()}, (x.grad if requires_grad else None)


@pytest.mark.parametrize("interval", [1, 2, 4, 9])
def test_activation_checkpointing_gives_the_same_outputs_and_gradients(interval):
    out0, grads0, xg0 = _grads_and_output(0)
    calls = []

    def counting(fn, *args, **kwargs):
        calls.append(kwargs)
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)
    out, grads, xg = _grads_and_output(interval, counting)
    assert torch.equal(out, out0) and torch.equal(xg, xg0)
    assert all(torch.equal(grads[n], grads0[n]) for n in grads0)
    blocks_with_params = sum(any(i % 3 == 0 for i in range(s, min(s + interval, 9))) for s in range(0, 9, interval))
    assert len(calls) == blocks_with_params and calls[0] == {}      # **kwargs only: no use_reentrant passed
    out, grads, _ = _grads_and_output(interval)                      # the default: torch's, non-reentrant
    assert torch.equal(out, out0) and all(torch.equal(grads[n], grads0[n]) for n in grads0)


def test_default_checkpointing_is_non_reentrant_so_inputs_without_grad_still_train():
    _, grads0, _ = _grads_and_output(0, requires_grad=False)
    _, grads, _ = _grads_and_output(3, requires_grad=False)
    assert all(g is not None and torch.equal(g, grads0[n]) for n, g in grads.items())


def test_checkpointable_layers_select_the_blocks():
    calls = []

    def counting(fn, *args):
        calls.append(len(args))
        return fn(*args)
    _grads_and_output(1, counting, checkpointable_layers=["Tanh"])
    assert len(calls) == 3
    with pytest.raises(PipelineError, match="activation_checkpoint_interval must be >= 0"):
        PipelineModule(_linear_specs(2), num_stages=1).set_checkpoint_interval(-1)


# ---- errors --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({"num_stages": 2, "stage_id": 0, "partition_method": [0, 4, 4, 8]}, "need 3 boundaries"),
    ({"num_stages": 3, "stage_id": 0, "partition_method": [0, 4, 4, 8]},
     r"leaves pipeline stage 1 with 0 layers \(layers per stage \[4, 0, 4\]"),
    ({"num_stages": 0}, "num_stages must be an integer >= 1, got 0"),
    ({"num_stages": 9, "stage_id": 0}, "num_stages=9 is more than the 8 layers"),
    ({"num_stages": 2, "stage_id": 0, "partition_method": "profile"},
     r"unknown partition_method 'profile'; valid: parameters, uniform, type:<regex>"),
    ({"num_stages": 2, "stage_id": 0, "partition_method": "type:conv"},
     r"'type:conv' matches no layer; the layer class names are \['Linear'\]"),
    ({}, "needs num_stages or topology"),
    ({"num_stages": 2}, "pass stage_id= "),
    ({"num_stages": 2, "stage_id": 2}, r"stage_id=2 is outside the 2 stages"),
    ({"topology": ProcessTopology(["data"], [2])}, "no 'pipe' axis"),
    ({"num_stages": 1, "checkpointable_layers": "Linear"}, "checkpointable_layers must be a list"),
])
def test_bad_input_is_explained(kwargs, match):
    with pytest.raises(PipelineError, match=match):
        PipelineModule(_linear_specs(), **kwargs)


def test_bad_layers_are_explained():
    with pytest.raises(PipelineError, match="only supports torch.nn.Module types"):
        LayerSpec(torch.relu)
    with pytest.raises(PipelineError, match="layer 1 is a int, not an nn.Module"):
        PipelineModule([nn.ReLU(), 3], num_stages=1)
    inner = PipelineModule(_linear_specs(2), num_stages=1)
    with pytest.raises(PipelineError, match="layer 0 is a PipelineModule"):
        PipelineModule([inner], num_stages=1)
    with pytest.raises(RuntimeError):      # DeepSpeed raises RuntimeError / NotImplementedError here
        PipelineModule(_linear_specs(), num_stages=2, stage_id=0, partition_method="bogus")
    assert PipelineModule(_linear_specs(), topology=PipeDataParallelTopology(2, 1), stage_id=1).stage_id == 1


def test_set_random_seed_seeds_as_torch_manual_seed_does():
    """The layer seeding (`seed_layers=True`, DeepSpeed's `set_random_seed`) leaves Python's, numpy's and torch's
    generators where `random.seed` / `numpy.random.seed` / `torch.manual_seed` would (without the lazy seeds
    torch.manual_seed queues, with a stack trace each, for device types not available)."""
    import numpy

    from zerospeed.pipe.spec import set_random_seed

    def draw():
        return random.random(), float(numpy.random.rand()), torch.rand(3).tolist(), torch.randn(2).tolist()

    for seed in (0, 1234, 2 ** 40 + 7):
        random.seed(seed)
        numpy.random.seed(seed % 2 ** 32)
        torch.manual_seed(seed)
        want = draw()
        torch.manual_seed(seed + 1)  # move every generator away
        random.seed(seed + 1)
        numpy.random.seed((seed + 1) % 2 ** 32)
        set_random_seed(seed)
        assert draw() == want, seed
