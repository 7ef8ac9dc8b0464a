"""Activation checkpointing: parity with plain PyTorch, memory saved, RNG replay, configure()."""
import copy
import json
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerospeed.checkpointing as ckpt
from zerospeed.testing.models import Block, tiny_gpt

RTOL, ATOL = 1e-6, 1e-7  # fp32; recomputation replays the same kernels, so results agree to rounding


@pytest.fixture(autouse=True)
def _clean_state():
    ckpt.reset(unconfigure=True)
    ckpt.get_rng_tracker().reset()
    yield
    ckpt.reset(unconfigure=True)
    ckpt.get_rng_tracker().reset()


def run(model, idx, forward=None, seed=1234):
    """Loss and {param name: grad} of one training step from a fixed RNG seed."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = (forward or model)(idx[:, :-1], idx[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=RTOL, atol=ATOL)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=RTOL, atol=ATOL, msg=name)


def manual_forward(model, idx, targets):
    """GPT.forward with each block run through zerospeed.checkpointing.checkpoint(fn, *args)."""
    pos = torch.arange(idx.shape[1], device=idx.device)
    x = model.drop(model.wte(idx) + model.wpe(pos))
    for block in model.blocks:
        x = ckpt.checkpoint(block, x)
    logits = model.lm_head(model.ln_f(x))
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


@pytest.fixture
def gpt_and_batch():
    model = tiny_gpt(0, n_layer=2, dropout=0.1).train()
    idx = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    return model, idx


def test_checkpoint_modules_matches_plain_with_dropout(gpt_and_batch):
    model, idx = gpt_and_batch
    reference = run(model, idx)
    other_seed = run(model, idx, seed=99)
    assert not torch.equal(reference[0], other_seed[0])  # dropout is active, so the seed matters
    wrapped = copy.deepcopy(model)
    assert ckpt.checkpoint_modules(wrapped, Block) == ["blocks.0", "blocks.1"]
    assert_same(run(wrapped, idx), reference)


def test_checkpoint_function_matches_plain_with_dropout(gpt_and_batch):
    model, idx = gpt_and_batch
    reference = run(model, idx)
    assert_same(run(model, idx, forward=lambda i, t: manual_forward(model, i, t)), reference)
    # Negative control: without RNG replay the recomputed dropout masks differ, so the gradients do.
    def no_replay(i, t):
        pos = torch.arange(i.shape[1])
        x = model.drop(model.wte(i) + model.wpe(pos))
        for block in model.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)
        logits = model.lm_head(model.ln_f(x))
        return F.cross_entropy(logits.view(-1, 256), t.reshape(-1))
    loss, grads = run(model, idx, forward=no_replay)
    torch.testing.assert_close(loss, reference[0], rtol=RTOL, atol=ATOL)  # forward is the same
    assert not torch.allclose(grads["blocks.0.fc.weight"], reference[1]["blocks.0.fc.weight"])


def test_non_tensor_arguments_and_outputs():
    x = torch.randn(3, 4, requires_grad=True)

    def fn(t, scale, mode, bias=None):
        y = t.sin() * scale + (bias if bias is not None else 0)
        return (y, mode) if mode == "pair" else y

    out, tag = ckpt.checkpoint(fn, x, 2.0, "pair")
    assert tag == "pair"
    out.sum().backward()
    torch.testing.assert_close(x.grad, 2.0 * x.detach().cos())
    x.grad = None
    b = torch.ones(4, requires_grad=True)
    ckpt.checkpoint(fn, x, 3.0, "single", bias=b).sum().backward()
    torch.testing.assert_close(x.grad, 3.0 * x.detach().cos())
    torch.testing.assert_close(b.grad, torch.full((4,), 3.0))


def saved_activation_bytes(model, idx) -> int:
    """Bytes of distinct tensor storages autograd keeps for backward, parameters excluded."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_ptrs:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(idx)
    del logits
    return sum(seen.values())


def test_checkpointing_each_block_saves_3x_activation_memory():
    model = tiny_gpt(0, n_layer=8, seq_len=64, d_model=64, n_head=2).train()
    idx = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    plain = saved_activation_bytes(model, idx)
    ckpt.checkpoint_modules(model, Block)
    checkpointed = saved_activation_bytes(model, idx)
    # plain: every block keeps its norms, qkv, attention, MLP activations (~30 x d per token);
    # checkpointed: each block keeps only its input (d per token) plus the LM head's tensors.
    assert plain >= 3 * checkpointed, (plain, checkpointed)
    ckpt.remove_checkpointing(model)
    assert saved_activation_bytes(model, idx) == plain


def test_cpu_checkpointing_offloads_inputs_and_matches(gpt_and_batch, monkeypatch):
    model, idx = gpt_and_batch
    reference = run(model, idx)
    packed = []
    real = torch.autograd.graph.save_on_cpu

    class Spy(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pack, unpack = self.pack_hook, self.unpack_hook
            self.pack_hook = lambda t: (packed.append(t.shape), pack(t))[1]
            self.unpack_hook = unpack

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Spy)
    settings = ckpt.configure(None, checkpoint_in_cpu=True)
    assert settings.cpu_checkpointing and ckpt.is_configured()
    wrapped = copy.deepcopy(model)
    ckpt.checkpoint_modules(wrapped, Block)
    assert_same(run(wrapped, idx), reference)
    assert (2, 32, 64) in packed and len(packed) >= 2  # each block's input went through save_on_cpu


def test_rng_tracker_streams_replayed_in_recompute():
    ckpt.model_parallel_seed(7)
    lin = nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)

    def region(t):
        with ckpt.get_rng_tracker().fork():
            return F.dropout(lin(t), p=0.5, training=True)

    def grads(fn):
        ckpt.get_rng_tracker().set_states(start)
        torch.manual_seed(0)
        x.grad = None
        out = fn(x)
        out.pow(2).sum().backward()
        return out.detach(), x.grad.clone()

    start = ckpt.get_rng_tracker().get_states()
    ref_out, ref_grad = grads(region)
    out, grad = grads(lambda t: ckpt.checkpoint(region, t))
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=ATOL)
    # torch's checkpoint alone restores the default generators but not the tracker's stream
    _, plain_grad = grads(lambda t: torch.utils.checkpoint.checkpoint(region, t, use_reentrant=False))
    assert not torch.allclose(plain_grad, ref_grad)


def test_model_parallel_seed_and_tracker():
    dp_seed, mp_seed = ckpt.model_parallel_seed(5, tp_rank=1)
    assert (dp_seed, mp_seed) == (5, 5 + 2718 + 1)
    before = torch.get_rng_state()
    with ckpt.get_rng_tracker().fork("model-parallel-rng"):
        drawn = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    assert torch.equal(drawn, torch.rand(3, generator=torch.Generator().manual_seed(mp_seed)))
    with pytest.raises(ValueError, match="not added"):
        with ckpt.get_rng_tracker().fork("nope"):
            pass
    with pytest.raises(ValueError, match="already used"):
        ckpt.get_rng_tracker().add("other", mp_seed)
    assert ckpt.get_cuda_rng_tracker() is ckpt.get_rng_tracker()


def test_checkpoint_modules_idempotent_reversible_and_named():
    model = tiny_gpt(0, n_layer=3)
    keys = list(model.state_dict())
    assert ckpt.checkpoint_modules(model, names="blocks.*") == ["blocks.0", "blocks.1", "blocks.2"]
    inner = model.blocks[0].forward
    assert ckpt.checkpoint_modules(model, Block) == ["blocks.0", "blocks.1", "blocks.2"]
    assert model.blocks[0].forward is inner  # not wrapped twice
    assert list(model.state_dict()) == keys and type(model.blocks[0]) is Block
    assert ckpt.checkpoint_modules(model, predicate=lambda n, m: n == "lm_head") == ["lm_head"]
    assert sorted(ckpt.remove_checkpointing(model)) == ["blocks.0", "blocks.1", "blocks.2", "lm_head"]
    assert "forward" not in model.blocks[0].__dict__ and not ckpt.is_checkpointed(model.blocks[0])
    assert ckpt.remove_checkpointing(model) == []
    with pytest.raises(ValueError, match="no submodule matched"):
        ckpt.checkpoint_modules(model, names=["blocks.9"])
    with pytest.raises(ValueError, match="module_classes, names or predicate"):
        ckpt.checkpoint_modules(model)


def test_profile_counts_regions_and_recomputes(gpt_and_batch):
    model, idx = gpt_and_batch
    ckpt.configure(None, profile=True, synchronize=True)
    ckpt.checkpoint_modules(model, Block)
    run(model, idx)
    stats = ckpt.get_profile_stats()
    assert stats["calls"] == 2 and stats["recomputes"] == 2
    assert stats["forward_seconds"] > 0 and stats["recompute_seconds"] > 0
    ckpt.reset()
    assert ckpt.get_profile_stats()["calls"] == 0 and ckpt.is_configured()


def test_configure_from_config_and_errors(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, "activation_checkpointing": {
        "cpu_checkpointing": True, "number_checkpoints": 4, "profile": False}}))
    s = ckpt.configure(None, deepspeed_config=str(path), profile=True)  # explicit arguments win
    assert (s.cpu_checkpointing, s.number_checkpoints, s.profile, s.partition_activations) == (True, 4, True, False)
    cfg_obj = types.SimpleNamespace(activation_checkpointing={"synchronize_checkpoint_boundary": True})
    assert ckpt.configure(None, deepspeed_config=cfg_obj).synchronize_checkpoint_boundary
    with pytest.raises(ValueError, match="'cpu_checkpointing'"):
        ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointin": True}})
    with pytest.raises(ValueError, match="true or false"):
        ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"profile": "yes"}})
    with pytest.raises(ValueError, match="positive int"):
        ckpt.configure(None, num_checkpoints=0)
    with pytest.raises(ValueError, match="needs partition_activations"):
        ckpt.configure(None, contiguous_checkpointing=True, num_checkpoints=4)
    with pytest.raises(ValueError, match="needs number_checkpoints"):
        ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True)

    class MPU:
        def __init__(self, n):
            self.n = n

        def get_model_parallel_world_size(self):
            return self.n

        def get_model_parallel_rank(self):
            return self.n - 1

    with pytest.raises(NotImplementedError, match="2-rank model-parallel group"):
        ckpt.configure(MPU(2), partition_activations=True)
    assert ckpt.configure(None, partition_activations=True).partition_activations  # harmless: one rank
    assert ckpt.configure(MPU(1), partition_activations=True, contiguous_checkpointing=True,
                          num_checkpoints=2).contiguous_memory_optimization
    ckpt.configure(MPU(3))
    assert ckpt.model_parallel_cuda_manual_seed(10) == (10, 10 + 2718 + 2)
    ckpt.reset(unconfigure=True)
    assert not ckpt.is_configured() and ckpt.get_settings() == ckpt.CheckpointingSettings()
