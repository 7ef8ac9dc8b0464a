"""`zerospeed.get_accelerator()` on this CPU-only host behaves as DeepSpeed's CPU_Accelerator."""
from __future__ import annotations

import contextlib

import psutil
import pytest
import torch

import zerospeed
from zerospeed.accelerator import Accelerator, get_accelerator, set_accelerator

pytestmark = pytest.mark.skipif(torch.accelerator.is_available(), reason="these numbers are the CPU host's")


@pytest.fixture
def acc(monkeypatch):
    for var in ("ZEROSPEED_ACCELERATOR", "DS_ACCELERATOR", "LOCAL_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    return Accelerator("cpu")


def test_both_import_paths_give_the_same_object():
    assert zerospeed.get_accelerator() is get_accelerator() is zerospeed.accelerator.get_accelerator()
    assert get_accelerator().name == "cpu"


def test_device_identity_on_the_host(acc, monkeypatch):
    assert acc.name == "cpu" and acc.device_name() == "cpu" and acc.device_name(0) == "cpu"
    assert acc.current_device_name() == "cpu" and acc.current_device() == 0
    assert acc.communication_backend_name() == "gloo" and acc.is_available()
    assert torch.zeros(1, device=acc.device_name()).device.type == "cpu"
    numa = sum(1 for _ in __import__("glob").glob("/sys/devices/system/node/node[0-9]*")) or 1
    assert acc.device_count() == numa
    monkeypatch.setenv("LOCAL_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert acc.device_count() == 3 and acc.current_device() == 2
    acc.set_device(1)  # no-op
    acc.synchronize()
    with acc.device(0):
        pass
    assert acc.is_synchronized_device() and acc.Stream is None and acc.Event is None
    assert isinstance(acc.stream(None), contextlib.nullcontext) and acc.current_stream() is None


def test_manual_seed_reproduces_the_same_numbers(acc):
    acc.manual_seed(1234)
    a = torch.randn(5)
    acc.manual_seed_all(1234)
    b = torch.randn(5)
    assert torch.equal(a, b) and acc.initial_seed() == 1234
    state = acc.get_rng_state()
    c = torch.randn(3)
    acc.set_rng_state(state)
    assert torch.equal(torch.randn(3), c)
    assert acc.default_generator(0) is torch.default_generator


def test_memory_is_the_process_rss(acc):
    rss = psutil.Process().memory_info().rss
    assert abs(acc.memory_allocated() - rss) < 64 << 20
    acc.reset_peak_memory_stats()
    base = acc.max_memory_allocated()
    big = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    grown = acc.memory_allocated()
    assert grown - base > 48 << 20
    del big
    assert acc.max_memory_allocated() >= grown  # the peak stays after the memory is freed
    stats = acc.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= grown and stats["allocated_bytes.all.current"] > 0
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() <= grown
    assert acc.total_memory() == psutil.virtual_memory().total > acc.available_memory() > 0
    acc.empty_cache()


def test_dtypes_tensors_and_placement(acc):
    assert acc.is_bf16_supported()
    assert acc.is_fp16_supported() == bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    assert torch.float32 in acc.supported_dtypes() and torch.bfloat16 in acc.supported_dtypes()
    t = torch.ones(3)
    assert acc.pin_memory(t) is t and not acc.is_pinned(t)
    assert acc.on_accelerator(t) and not acc.on_accelerator(torch.ones(1, device="meta"))
    assert acc.lazy_call(lambda: 7) == 7
    acc.range_push("x")
    acc.range_pop()
    acc.range_pop()  # nothing open: a no-op
    with torch.profiler.profile() as prof:  # the range is a profiler range on every device
        acc.range_push("zerospeed_test_range")
        torch.ones(4).add_(1)
        acc.range_pop()
    assert "zerospeed_test_range" in {e.name for e in prof.events()}


def test_env_choice_and_errors(monkeypatch):
    from zerospeed import accelerator as mod

    monkeypatch.setattr(mod, "_current", None)
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(ValueError, match="unset the variable or set it to 'cpu'"):
        get_accelerator()
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert get_accelerator().name == "cpu"
    with pytest.raises(TypeError, match="Accelerator"):
        set_accelerator("cpu")
    mine = Accelerator("cpu")
    set_accelerator(mine)
    assert get_accelerator() is mine
