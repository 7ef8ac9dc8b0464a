"""The gradient bucket size (zero/buckets.py); the bucket plans are tested in test_partition.py."""
import pytest

from zerospeed.zero.buckets import DEFAULT_BUCKET_SIZE, bucket_elements


def test_bucket_elements_honours_a_set_key_and_picks_the_default_otherwise():
    assert DEFAULT_BUCKET_SIZE == 6_553_600  # 25 MiB of fp32, DDP's bucket_cap_mb
    assert bucket_elements(500_000_000, user_set=True) == 500_000_000  # DeepSpeed's value, given explicitly
    assert bucket_elements(500_000_000, user_set=False) == DEFAULT_BUCKET_SIZE
    assert bucket_elements(20_000, user_set=True) == 20_000
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        bucket_elements(0, user_set=True)
