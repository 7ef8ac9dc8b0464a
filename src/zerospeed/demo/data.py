"""The demo's data: the source text of Python's own standard library, as bytes.

Every `*.py` under `sysconfig.get_paths()["stdlib"]`, sorted by path, `site-packages` excluded,
joined with newlines: real text (about 30 MB) present on every machine, no download. The last
`val_bytes` bytes are held out for validation.
"""
from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch


def stdlib_source_files(root: str | None = None) -> list[Path]:
    """The sorted `*.py` files under the standard library, without `site-packages`."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in base.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def load_corpus(root: str | None = None, max_bytes: int | None = None) -> torch.Tensor:
    """The corpus as a uint8 tensor [n_bytes]; `max_bytes` caps its size (from the start)."""
    chunks, total = [], 0
    for path in stdlib_source_files(root):
        data = path.read_bytes() + b"\n"
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    if not blob:
        raise FileNotFoundError(f"no *.py files under {root or sysconfig.get_paths()['stdlib']}")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()


@dataclass
class ByteSplits:
    """Train and validation byte tensors ([n] uint8) and the train set's unigram entropy (bits/byte)."""

    train: torch.Tensor
    val: torch.Tensor

    def unigram_bits_per_byte(self) -> float:
        """Entropy of the train set's byte histogram, evaluated on the validation set (cross-entropy,
        bits per byte, add-one smoothed): the loss of the best model that ignores context."""
        counts = torch.bincount(self.train.long(), minlength=256).double() + 1
        logp = torch.log2(counts / counts.sum())
        return float(-(logp[self.val.long()]).mean())


def split_corpus(data: torch.Tensor, val_bytes: int) -> ByteSplits:
    if val_bytes <= 0 or val_bytes >= data.numel() // 2:
        raise ValueError(f"val_bytes={val_bytes} must be in (0, {data.numel() // 2})")
    return ByteSplits(train=data[:-val_bytes], val=data[-val_bytes:])


def sample_batch(data: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: (inputs, targets), each LongTensor [batch, seq_len], targets shifted by one byte."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=generator)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    windows = data[idx].long()
    return windows[:, :-1], windows[:, 1:]


def val_windows(data: torch.Tensor, seq_len: int, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`num` evenly spaced, fixed validation windows: (inputs, targets), LongTensor [num, seq_len]."""
    stride = max(1, (data.numel() - seq_len - 1) // num)
    starts = torch.arange(num) * stride
    idx = starts[:, None] + torch.arange(seq_len + 1)
    windows = data[idx].long()
    return windows[:, :-1], windows[:, 1:]


def nats_to_bits(x: float) -> float:
    return x / math.log(2)
