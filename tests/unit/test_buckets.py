"""Bucket plans (zero/buckets.py): pure functions, no processes."""
import pytest

from zerospeed.zero.buckets import DEFAULT_BUCKET_SIZE, plan_buckets, bucket_elements


def test_reverse_order_and_size_limit():
    plan = plan_buckets([5, 3, 4, 2], 6)  # backward order: 2, 4 | 3 | 5
    assert plan.sizes == (6, 3, 5)
    assert [(s.index, s.bucket, s.offset) for s in plan.slots] == [(3, 0, 0), (2, 0, 2), (1, 1, 0), (0, 2, 0)]


def test_parameter_larger_than_bucket_gets_its_own():
    assert plan_buckets([10, 1, 1], 4).sizes == (2, 10)
    with pytest.raises(ValueError, match="bucket_size"):
        plan_buckets([1, 2], 0)


def test_bucket_elements_honours_a_set_key_and_picks_the_default_otherwise():
    assert DEFAULT_BUCKET_SIZE == 6_553_600  # 25 MiB of fp32, DDP's bucket_cap_mb
    assert bucket_elements(500_000_000, user_set=True) == 500_000_000  # DeepSpeed's value, given explicitly
    assert bucket_elements(500_000_000, user_set=False) == DEFAULT_BUCKET_SIZE
    assert bucket_elements(20_000, user_set=True) == 20_000
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        bucket_elements(0, user_set=True)
