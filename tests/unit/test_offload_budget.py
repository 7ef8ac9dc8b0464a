"""offload.budget: the per-rank host and disk budget of ZeRO-3 with offload, and the largest model it allows.

Numbers are worked out by hand from the formulas in the module docstring (bytes per rank)."""
import pytest

from zerospeed.offload import OffloadPolicy
from zerospeed.offload.budget import largest_model, rank_budget

BOTH = OffloadPolicy(optimizer="nvme", param="nvme", sub_group_size=10_000_000, param_buffer_count=8,
                     max_in_cpu=0, pipeline=True)
UNIT = 12 * 2560 ** 2  # one transformer block of width 2560: 78.6M elements


def test_infinity_host_budget_does_not_grow_with_the_model():
    """Both tiers on NVMe: the host bytes depend on the largest unit and the buffers, not on Ψ."""
    small = rank_budget(BOTH, numel=26 * UNIT, largest_unit=UNIT, world=2, param_bytes=2, mixed=True)
    big = rank_budget(BOTH, numel=52 * UNIT, largest_unit=UNIT, world=2, param_bytes=2, mixed=True)
    assert small.host == big.host
    ushard = UNIT // 2
    assert big.host["param_pool"] == 8 * ushard * 2
    assert big.host["optimizer"] == 2 * 4 * 10_000_000 * 4  # 2 sets x (master, 2 states, gradient) x tile
    assert big.host["gradients"] == 2 * ushard * 2  # bf16 gradients being written
    assert big.host["gathered"] == 2 * UNIT * 2 and big.host["param_resident"] == 0
    # free storages kept for the next unit: a [2, ushard] bf16 bucket with its [1, ushard] receive workspace
    # (one block) and an fp32 shard
    assert big.host["recycled"] == 3 * ushard * 2 + 4 * ushard
    # disk: 12 B optimizer + 2 B gradient + 2 B parameter per element of the rank's Ψ/N
    assert big.disk == {"optimizer": 12 * 26 * UNIT, "gradients": 2 * 26 * UNIT, "param": 2 * 26 * UNIT}


def test_super_offload_adds_its_buffers_and_gradients():
    """super_offload: 6 buffer sets x (master, 2 states, gradient) x tile + 4 unit shards of fp32 gradients;
    flat in Ψ."""
    import dataclasses
    sup = dataclasses.replace(BOTH, super_offload=True)
    small = rank_budget(sup, numel=26 * UNIT, largest_unit=UNIT, world=2, param_bytes=2, mixed=True)
    big = rank_budget(sup, numel=52 * UNIT, largest_unit=UNIT, world=2, param_bytes=2, mixed=True)
    assert small.host == big.host
    assert big.host["backward_steps"] == (6 * 4 * 10_000_000 + 4 * UNIT // 2) * 4
    base = rank_budget(BOTH, numel=52 * UNIT, largest_unit=UNIT, world=2, param_bytes=2, mixed=True)
    assert big.disk == base.disk and big.host_total - base.host_total == big.host["backward_steps"]


@pytest.mark.parametrize("mixed, accum, param_bytes, per_element", [
    (False, 1, 4, 20),  # fp32: 12 + 4 + 4
    (True, 1, 2, 16),   # bf16, one micro-step: 12 + 2 + 2
    (True, 2, 2, 18),   # bf16, gradients accumulated in fp32: 12 + 4 + 2
])
def test_disk_bytes_per_element(mixed, accum, param_bytes, per_element):
    b = rank_budget(BOTH, numel=4_000_000, largest_unit=1_000_000, world=2, param_bytes=param_bytes, mixed=mixed,
                    grad_accum=accum)
    assert b.disk_total == per_element * 2_000_000


def test_without_nvme_the_partition_is_in_memory():
    cpu = OffloadPolicy(optimizer="cpu", param="cpu")
    b = rank_budget(cpu, numel=4_000_000, largest_unit=1_000_000, world=2, param_bytes=4)
    assert b.disk == {} and b.host["optimizer"] == 12 * 2_000_000 and b.host["gradients"] == 4 * 2_000_000
    assert b.host["param_resident"] == 4 * 2_000_000
    # max_in_cpu keeps that many elements of the shards resident and off the disk
    kept = rank_budget(OffloadPolicy(optimizer="nvme", param="nvme", max_in_cpu=500_000), numel=4_000_000,
                       largest_unit=1_000_000, world=2, param_bytes=4)
    assert kept.host["param_resident"] == 4 * 500_000 and kept.disk["param"] == 4 * 1_500_000


def test_largest_model_is_set_by_the_disk_when_the_host_budget_is_flat():
    def budget_of(n):
        return rank_budget(BOTH, numel=n, largest_unit=UNIT, world=2, param_bytes=2, mixed=True)
    psi, limit = largest_model(ram_bytes=24 << 30, disk_bytes=77 * 10**9, ranks=2, process_bytes=300 << 20,
                               budget_of=budget_of)
    assert limit == "disk" and abs(psi - 77e9 / 16) / (77e9 / 16) < 2e-3
    psi, limit = largest_model(ram_bytes=2 << 30, disk_bytes=77 * 10**9, ranks=2, process_bytes=300 << 20,
                               budget_of=budget_of)
    assert limit == "host memory" and psi < UNIT  # 1 GiB per rank does not hold one block's buffers


def test_bad_sizes():
    with pytest.raises(ValueError, match="positive sizes"):
        rank_budget(BOTH, numel=0, largest_unit=1, world=2, param_bytes=2)
