"""The zero-bubble backward split (pipe.backward_split) against one fused backward, in one process: the input-
gradient pass computes no weight gradient, and the two passes give the fused gradients bit for bit (plain
layers, activation-checkpointed blocks, tuple activations with an integer mask, a loss as the last output);
the engine's reduction window for each schedule."""
import pytest
import torch
from torch import nn

from zerospeed.pipe import LayerSpec, PipelineModule
from zerospeed.pipe.backward_split import backward_fused, backward_input, backward_weight
from zerospeed.pipe.schedule import Backward, BackwardWeight, gpipe, one_f_one_b, zb_h1
from zerospeed.runtime.pipe_engine import reduction_window
from zerospeed.testing.models import ApplyMask, Block, GPTConfig, WithMask


def _layers(kind):
    if kind == "blocks":  # transformer blocks (residuals, LayerNorm, attention): one segment each, with capture
        cfg = GPTConfig(d_model=8, n_head=2)
        return [LayerSpec(Block, cfg), LayerSpec(Block, cfg), LayerSpec(nn.Linear, 8, 4)]
    if kind == "tuple":
        return [LayerSpec(nn.Linear, 8, 16), LayerSpec(WithMask), LayerSpec(ApplyMask, 16), LayerSpec(nn.Linear, 16, 4)]
    return [LayerSpec(nn.Linear, 8, 16), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 16, 16), LayerSpec(nn.Tanh),
            LayerSpec(nn.Linear, 16, 4)]


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("kind,interval", [("plain", 0), ("plain", 2), ("tuple", 0), ("tuple", 3), ("blocks", 0),
                                           ("blocks", 2)])
@pytest.mark.parametrize("as_loss", [False, True])
def test_split_equals_fused(kind, interval, as_loss):
    module = PipelineModule(_layers(kind), num_stages=1, seed_layers=True, stage_id=0,
                            activation_checkpoint_interval=interval)
    shape = (5, 3) if kind == "blocks" else (5,)  # (batch, sequence) for the transformer blocks
    x = torch.randn(*shape, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    g = torch.randn(*shape, 4, generator=torch.Generator().manual_seed(1))

    out = module(x)
    backward_fused(out.pow(2).mean() if as_loss else out, None if as_loss else (g,))
    fused, fused_x = _grads(module), x.grad.clone()
    module.zero_grad(set_to_none=True)
    x.grad = None

    out, segments = module.forward_segments(x)
    if kind == "plain" and interval == 0:  # Linear + Tanh, Linear + Tanh, Linear: a segment per weighted layer
        assert [len(seg.params) for seg in segments] == [2, 2, 2]
    if as_loss:
        segments[-1].output = out.pow(2).mean()
    pending, dx = backward_input(segments, None if as_loss else (g,))
    assert all(p.grad is None for p in module.parameters()), "the input-gradient pass touched a weight gradient"
    if kind == "blocks":  # the blocks' weight passes start at their intermediate nodes, not at their outputs
        starts = [type(s).__name__ for starts, _, _ in pending.items for s in starts]
        assert starts.count("GradientEdge") >= 2 * 6 and "Tensor" in starts, starts  # 6 weighted ops a block
    assert torch.equal(x.grad, fused_x) and torch.equal(dx[0], fused_x)
    backward_weight(pending)
    for name, grad in _grads(module).items():
        assert torch.equal(grad, fused[name]), name
    assert not pending.items


@pytest.mark.parametrize("build,kind", [(one_f_one_b, Backward), (gpipe, Backward), (zb_h1, BackwardWeight)])
def test_reduction_window_is_the_last_weight_pass(build, kind):
    for p, m in [(2, 4), (4, 8), (3, 2)]:
        for rank, actions in build(p, m).items():
            i = reduction_window(actions)
            assert actions[i] == kind(m - 1, rank), (build.__name__, p, m, rank)
            assert not any(isinstance(a, (Backward, BackwardWeight)) for a in actions[i + 1:])
