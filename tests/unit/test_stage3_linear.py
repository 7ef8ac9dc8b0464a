"""zero.stage3_linear: `RecycledGradLinear` gives autograd's linear gradients bit for bit, its weight
gradient in a recycled host buffer (the same memory once the previous one is dropped), and
`RecycledGradLinears` installs it on exact nn.Linear modules only and removes it again."""
import copy
import gc

import pytest
import torch
from torch import nn

from zerospeed.offload.hostmem import RecycledBuffers
from zerospeed.zero.stage3_linear import RecycledGradLinear, RecycledGradLinears


@pytest.mark.parametrize("shape,bias,dtype", [((6, 32), True, torch.float32), ((2, 5, 32), True, torch.float32),
                                              ((2, 5, 32), False, torch.float32), ((3, 4, 32), True, torch.bfloat16)])
def test_gradients_equal_autograd_linear_bitwise(shape, bias, dtype):
    torch.manual_seed(0)
    lin = nn.Linear(32, 48, bias=bias).to(dtype)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    dy = torch.randn(*shape[:-1], 48, dtype=dtype)
    ref = torch.autograd.grad(lin(x), [x, lin.weight] + ([lin.bias] if bias else []), dy)
    cache = RecycledBuffers(1 << 20, per_size=2)
    y = RecycledGradLinear.apply(x, lin.weight, lin.bias, cache)
    assert torch.equal(y, lin(x))
    got = torch.autograd.grad(y, [x, lin.weight] + ([lin.bias] if bias else []), dy)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype and torch.equal(g, r)
    assert got[1].is_contiguous() and cache.allocated == 1


def test_the_weight_gradient_memory_is_reused_once_the_gradient_is_dropped():
    lin = nn.Linear(64, 64)
    cache = RecycledBuffers(1 << 20, per_size=1)
    x = torch.randn(4, 64)
    RecycledGradLinear.apply(x, lin.weight, lin.bias, cache).sum().backward()
    first = lin.weight.grad.data_ptr()  # AccumulateGrad took the buffer itself as .grad
    lin.weight.grad = None
    gc.collect()
    RecycledGradLinear.apply(x, lin.weight, lin.bias, cache).sum().backward()
    assert lin.weight.grad.data_ptr() == first and (cache.allocated, cache.reused) == (1, 1)
    held = lin.weight.grad  # still referenced: the next backward gets new memory
    lin.weight.grad = None
    RecycledGradLinear.apply(x, lin.weight, lin.bias, cache).sum().backward()
    assert lin.weight.grad.data_ptr() != held.data_ptr() and cache.allocated == 2


def test_double_backward_raises():
    lin = nn.Linear(8, 8)
    x = torch.randn(2, 8, requires_grad=True)
    y = RecycledGradLinear.apply(x, lin.weight, lin.bias, RecycledBuffers(1 << 20))
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|twice"):
        gx.sum().backward()


class _Sub(nn.Linear):
    pass


class _Unit:  # the attributes RecycledGradLinears reads from a ShardedUnit
    def __init__(self, index, params):
        self.index = index
        self.params = [type("SP", (), {"param": p, "numel": p.numel()}) for p in params]


def test_installed_on_exact_linears_of_the_units_and_removed():
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), _Sub(32, 8), nn.Linear(8, 8))
    units = [_Unit(0, [model[0].weight, model[0].bias, model[2].weight]), _Unit(1, [model[3].weight])]
    linears = RecycledGradLinears(model, units)  # model[4] is in no unit; model[3] is a subclass
    assert linears.modules == [model[0], model[2]]
    assert linears.cache.max_idle_bytes == (8 * 32 + 32 * 32) * 4 and linears.cache.per_size == 1
    x = torch.randn(3, 8)
    ref = copy.deepcopy(model)  # a copy gets the class's forward back
    assert "forward" not in vars(ref[0]) or not hasattr(vars(ref[0])["forward"], "cache")
    model(x).sum().backward()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert linears.cache.allocated == 2
    linears.remove()
    assert all("forward" not in vars(m) for m in model)
