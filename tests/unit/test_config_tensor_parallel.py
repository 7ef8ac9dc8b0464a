"""The tensor_parallel block: DeepSpeed's keys, and a batch triple that counts data-parallel ranks only."""
import pytest

from zerospeed.config import ConfigError, load_config


def test_batch_triple_counts_data_parallel_ranks():
    c = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                     "tensor_parallel": {"autotp_size": 2}}, dp_world_size=4)
    assert c.tensor_parallel.size == 2 and c.train_batch_size == 2 * 3 * 2
    c = load_config({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                     "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True, "tp": {"tp_size": 1}}},
                    dp_world_size=4)
    assert c.train_batch_size == 12 and c.tensor_parallel.tp_overlap_comm
    assert load_config({"train_micro_batch_size_per_gpu": 2}).tensor_parallel.size == 1


def _error(config, world=4) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, dp_world_size=world)
    return str(info.value)


def test_deepspeed_autotp_batch_convention_is_an_error_with_the_value():
    msg = _error({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                  "tensor_parallel": {"autotp_size": 2}})
    assert "DeepSpeed's AutoTP convention" in msg and "set train_batch_size=12" in msg
    msg = _error({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"autotp_size": 2}})
    assert "would differ by 2x" in msg and "gradient_accumulation_steps" in msg


def test_tensor_parallel_errors():
    assert "does not divide the world size 4" in _error({"train_micro_batch_size_per_gpu": 2,
                                                         "tensor_parallel": {"autotp_size": 3}})
    assert "vocab_parallel_lm_head=true is not implemented" in _error(
        {"train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": True}})
    assert "autotp_sizee" in _error({"train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"autotp_sizee": 2}})
