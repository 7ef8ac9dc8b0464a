"""zero.reduce.gradient_divide_factors: the (pre, post) divisors every ZeRO stage's reduction uses."""
import pytest
import torch

from zerospeed.zero.reduce import gradient_divide_factors


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("predivide", [1.0, 2.0, 4.0, 0.5])
def test_average_gives_the_mean(world, predivide):
    pre, post = gradient_divide_factors(world, average=True, predivide_factor=predivide)
    assert pre == predivide and post == world / predivide
    grads = [torch.full((3,), float(r + 1)) for r in range(world)]
    reduced = sum(g / pre for g in grads) / post
    torch.testing.assert_close(reduced, sum(grads) / world)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("predivide", [1.0, 2.0, 8.0])
def test_sum_undoes_the_predivide(world, predivide):
    pre, post = gradient_divide_factors(world, average=False, predivide_factor=predivide)
    assert pre == predivide and post == 1.0 / predivide
    grads = [torch.full((3,), float(r + 1)) for r in range(world)]
    torch.testing.assert_close(sum(g / pre for g in grads) / post, sum(grads))


def test_defaults_are_no_predivide_and_average():
    assert gradient_divide_factors(4) == (1.0, 4.0)
    assert gradient_divide_factors(1) == (1.0, 1.0)  # 1.0 = no division: callers skip the div_
    pre, post = gradient_divide_factors(2, predivide_factor=2)
    assert type(pre) is float and type(post) is float


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match="world_size must be >= 1.*got 0"):
        gradient_divide_factors(0)
    with pytest.raises(ValueError, match="predivide_factor must be > 0.*got 0.0"):
        gradient_divide_factors(2, predivide_factor=0.0)
