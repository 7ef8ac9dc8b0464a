"""Checkpoint file format pieces in one process: the streaming safetensors writer / reader (compatible with
the safetensors library both ways), damaged files, the JSON codec, sizes, shard planning, the sampler."""
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from zerospeed.runtime.checkpoint_format import CheckpointReader, fragment_key, resolve_tag_dir
from zerospeed.runtime.checkpoint_io import (CheckpointFileError, SafetensorsFile, decode_json, encode_json,
                                             parse_size, write_safetensors)
from zerospeed.runtime.consolidate import _shards
from zerospeed.runtime.dataloader import ResumableDistributedSampler

TENSORS = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4).to(torch.bfloat16),
           "d": torch.tensor([True, False]), "e": torch.tensor(3.5), "f": torch.zeros(0, 2)}


def _entries(tensors):
    return [(k, v.dtype, tuple(v.shape), lambda v=v: v) for k, v in tensors.items()]


def test_streaming_writer_output_reads_with_safetensors(tmp_path):
    path = tmp_path / "x.safetensors"
    info = write_safetensors(path, _entries(TENSORS), metadata={"k": "v"})
    assert info["bytes"] == os.path.getsize(path) and set(info["crc32"]) == set(TENSORS)
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"k": "v"}
        for k, v in TENSORS.items():
            assert torch.equal(f.get_tensor(k), v)


def test_reader_reads_safetensors_files_and_ranges(tmp_path):
    path = tmp_path / "y.safetensors"
    save_file(TENSORS, path)
    with SafetensorsFile(path) as f:
        for k, v in TENSORS.items():
            assert torch.equal(f.read(k), v)
        assert torch.equal(f.read("a", 4, 11), TENSORS["a"].reshape(-1)[4:11])
        with pytest.raises(CheckpointFileError, match="outside"):
            f.read("b", 3, 9)
        with pytest.raises(CheckpointFileError, match="no tensor 'zz'"):
            f.read("zz")


def test_damaged_files_are_named(tmp_path):
    path = tmp_path / "z.safetensors"
    info = write_safetensors(path, _entries(TENSORS))
    with pytest.raises(CheckpointFileError, match="missing") as e:
        SafetensorsFile(tmp_path / "nope.safetensors")
    assert "nope.safetensors" in str(e.value)
    raw = path.read_bytes()
    path.write_bytes(raw[:-3])
    with pytest.raises(CheckpointFileError, match="truncated") as e:
        SafetensorsFile(path)
    assert "z.safetensors" in str(e.value)
    with pytest.raises(CheckpointFileError, match="index recorded"):
        SafetensorsFile(path, expected_bytes=len(raw))
    path.write_bytes(raw[:8] + b"{not json" + raw[17:])
    with pytest.raises(CheckpointFileError, match="corrupt"):
        SafetensorsFile(path)
    path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))  # last byte of the last tensor ("f" is empty, "e" last)
    with SafetensorsFile(path) as f, pytest.raises(CheckpointFileError, match="CRC"):
        f.read("e", crc32=info["crc32"]["e"])


def test_writer_refuses_a_tensor_other_than_declared(tmp_path):
    with pytest.raises(ValueError, match="declared"):
        write_safetensors(tmp_path / "w.safetensors", [("a", torch.float32, (2,), lambda: torch.zeros(3))])


def test_json_codec_keeps_tensors_tuples_and_int_keys_and_refuses_objects():
    value = {"step": 3, "betas": (0.9, 0.999), "nested": [{"t": torch.arange(3)}, None, "s"], "by_id": {0: 1.5},
             "lr": float("inf"), "tricky": {"__tensor__": 1}}
    store: dict = {}
    encoded = encode_json(value, store, prefix="state")
    back = decode_json(json.loads(json.dumps(encoded)), store.__getitem__)
    assert back["betas"] == (0.9, 0.999) and back["by_id"] == {0: 1.5} and back["tricky"] == {"__tensor__": 1}
    assert torch.equal(back["nested"][0]["t"], torch.arange(3)) and back["lr"] == float("inf")
    with pytest.raises(TypeError, match=r"client_state\['fn'\].*nothing is pickled"):
        encode_json({"fn": object()}, {}, prefix="state", path="client_state")


@pytest.mark.parametrize("text,expected", [("5GB", 5 * 10**9), ("2GiB", 2 * 2**30), ("500 mb", 500 * 10**6),
                                           ("1234", 1234), (7, 7), ("1.5KB", 1500)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["5XB", "GB", "0", "-1MB"])
def test_parse_size_errors(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_shards_are_greedy_and_an_oversized_tensor_gets_its_own():
    plan = [(f"t{i}", f"t{i}", torch.float32, (n,)) for i, n in enumerate([10, 10, 30, 5, 5])]
    shards = _shards(plan, 80)  # bytes: 40, 40, 120, 20, 20
    assert [[k for k, *_ in s] for s in shards] == [["t0", "t1"], ["t2"], ["t3", "t4"]]


def test_reader_assembles_any_range_from_fragments(tmp_path):
    """A logical tensor split over two rank files in uneven fragments; any range comes back whole."""
    full = torch.arange(20, dtype=torch.float32)
    cuts = [(0, 0, 7), (1, 7, 12), (0, 12, 20)]
    files = {}
    for rank in (0, 1):
        entries = [(fragment_key("w", "master", a), torch.float32, (b - a,), lambda a=a, b=b: full[a:b])
                   for r, a, b in cuts if r == rank]
        info = write_safetensors(tmp_path / f"r{rank}.safetensors", entries)
        files[f"r{rank}.safetensors"] = {"rank": rank, "bytes": info["bytes"], "crc32": info["crc32"]}
    index = {"tensors": {"w": {"kind": "param", "shape": [4, 5], "dtype": "F32", "fragments": [list(c) for c in cuts]}},
             "files": files}
    with CheckpointReader(tmp_path, index) as reader:
        assert torch.equal(reader.read_full("w"), full.view(4, 5))
        for a, b in [(3, 15), (7, 12), (0, 1), (19, 20), (5, 5)]:
            assert torch.equal(reader.read("w", "master", a, b), full[a:b])


def test_resolve_tag_dir(tmp_path):
    assert resolve_tag_dir(tmp_path) is None
    (tmp_path / "latest").write_text("global_step5\n")
    assert resolve_tag_dir(tmp_path) == tmp_path / "global_step5"
    assert resolve_tag_dir(tmp_path, "x") == tmp_path / "x"
    (tmp_path / "index.json").write_text("{}")
    assert resolve_tag_dir(tmp_path) == tmp_path


def test_sampler_resumes_mid_epoch_and_at_another_world_size():
    data = list(range(40))
    full = [list(ResumableDistributedSampler(data, num_replicas=2, rank=r, seed=3)) for r in (0, 1)]
    s = ResumableDistributedSampler(data, num_replicas=2, rank=0, seed=3)
    it = iter(s)
    first = [next(it) for _ in range(6)]
    state = s.state_dict()
    assert first == full[0][:6] and state == {"epoch": 0, "consumed": 6, "num_replicas": 2}
    again = ResumableDistributedSampler(data, num_replicas=2, rank=0, seed=3)
    again.load_state_dict(state)
    assert list(again) == full[0][6:] and list(again) == full[0]  # the skip applies once
    # 2 ranks consumed 12 samples of the shuffled order; at 4 ranks each skips 3 and the rest is the same set
    quads = []
    for r in range(4):
        q = ResumableDistributedSampler(data, num_replicas=4, rank=r, seed=3)
        q.load_state_dict(state)
        quads += list(q)
    assert sorted(quads) == sorted(full[0][6:] + full[1][6:])
