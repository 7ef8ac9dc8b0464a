"""The zero-bubble backward split (pipe.backward_split) against one fused backward, in one process: the input-
gradient pass computes no weight gradient, and the two passes give the fused gradients bit for bit (plain
layers, activation-checkpointed blocks, tuple activations with an integer mask, a loss as the last output);
the engine's reduction window for each schedule."""
import pytest
import torch
from torch import nn

from zerospeed.pipe import LayerSpec, PipelineModule
from zerospeed.pipe.backward_split import LinearWeights, backward_fused, backward_input, backward_weight
from zerospeed.pipe.schedule import Backward, BackwardWeight, gpipe, one_f_one_b, zb_h1
from zerospeed.runtime.pipe_engine import reduction_window
from zerospeed.testing.models import ApplyMask, Block, GPTConfig, WithMask


def _layers(kind):
    if kind == "blocks":  # transformer blocks (residuals, LayerNorm, attention): one segment each
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
    linear = [item for item in pending.items if isinstance(item, LinearWeights)]
    starts = [type(s).__name__ for item in pending.items if not isinstance(item, LinearWeights) for s in item[0]]
    # every nn.Linear outside activation checkpointing is W as one GEMM (the input needs a gradient, so B runs
    # through all); under checkpointing W goes through autograd (its saved tensors are recomputed)
    weights = {id(m.weight) for m in module.modules() if isinstance(m, nn.Linear)}
    assert len(linear) == sum(id(p) in weights for seg in segments if not seg.recompute for p in seg.params)
    assert len(linear) > 0 or interval > 0
    if kind == "blocks":  # the blocks' other weight passes start at their intermediate nodes, not their outputs
        assert starts.count("GradientEdge") >= 2 * (2 if interval == 0 else 6), starts  # LayerNorms (+ Linears)
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


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_weight_pass_accumulates_over_microbatches_and_fires_hooks(dtype, tol):
    """Three micro-batches accumulated: the split's gradients equal the fused backward's to rounding (a linear
    layer's W is one GEMM into `.grad`: in bf16 one rounding instead of two), every post-accumulate-grad hook
    fires once per parameter and micro-batch with the gradient accumulated so far, and a tensor hook
    (`register_hook`, here doubling one weight's gradient) still sees the gradient (that layer's W goes
    through autograd)."""
    module = PipelineModule(_layers("plain"), num_stages=1, seed_layers=True, stage_id=0).to(dtype)
    [m for m in module.modules() if isinstance(m, nn.Linear)][1].weight.register_hook(lambda g: 2 * g)
    seen: list = []
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: seen.append((name, p.grad.float().norm().item())))
    xs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i), dtype=dtype, requires_grad=True)
          for i in range(3)]
    gs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(10 + i), dtype=dtype) for i in range(3)]

    for x, g in zip(xs, gs):
        backward_fused(module(x), (g,))
    fused, fused_seen = _grads(module), sorted(seen)
    module.zero_grad(set_to_none=True)
    seen.clear()
    for x, g in zip(xs, gs):
        _, segments = module.forward_segments(x.detach().requires_grad_())
        pending, _ = backward_input(segments, (g,))
        assert sum(isinstance(item, LinearWeights) for item in pending.items) == 2  # the hooked one: autograd
        backward_weight(pending)
    assert [n for n, _ in sorted(seen)] == [n for n, _ in fused_seen] and len(seen) == 3 * 6
    for (name, a), (_, b) in zip(sorted(seen), fused_seen):
        assert abs(a - b) <= tol * b, (name, a, b)
    for name, grad in _grads(module).items():
        err = ((grad.float() - fused[name].float()).abs().max() / fused[name].float().abs().max()).item()
        assert err <= tol, (name, err)


def _tied_head(module, x):
    return x @ module.weight  # (rows, 32) @ (32, 8): the embedding's weight used as the head


@pytest.mark.parametrize("input_grad", [False, True])
def test_weight_tied_within_a_stage_is_accumulated_once_per_backward(input_grad):
    """An embedding and a head sharing one weight on one stage: W sums the two contributions before accumulating,
    so the weight's post-accumulate-grad hook fires once per micro-batch (as with autograd's fused backward, which
    sums them; a reducing ZeRO hook refuses a second gradient in one backward) and the gradient equals the fused
    one to rounding. With input_grad=False the embedding's W starts from its output (autograd), the head's is a
    one-GEMM linear pass."""
    from zerospeed.pipe import TiedLayerSpec
    layers = [TiedLayerSpec("embed", nn.Linear, 8, 32, bias=False), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 32, 32),
              TiedLayerSpec("embed", nn.Linear, 8, 32, bias=False, forward_fn=_tied_head)]
    module = PipelineModule(layers, num_stages=1, seed_layers=True, stage_id=0)
    calls: list = []
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: calls.append(name))
    xs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    gs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(10 + i)) for i in range(2)]
    for x, g in zip(xs, gs):
        backward_fused(module(x.requires_grad_(input_grad)), (g,))
    fused, fused_calls = _grads(module), sorted(calls)
    module.zero_grad(set_to_none=True)
    calls.clear()
    for x, g in zip(xs, gs):
        _, segments = module.forward_segments(x.detach().requires_grad_(input_grad))
        backward_weight(backward_input(segments, (g,))[0])
    assert sorted(calls) == fused_calls and fused_calls.count("tied_modules.embed.weight") == 2, calls
    for name, grad in _grads(module).items():
        assert torch.allclose(grad, fused[name], rtol=1e-6, atol=1e-7), name
