"""Small deterministic models shared by tests, benchmarks, the demo and users.

`GPT` is a GPT-2 style decoder-only transformer (Radford et al. 2019): learned position
embeddings, pre-LayerNorm blocks of causal self-attention and a 4x MLP, and an LM head whose
weight is tied to the token embedding (the tied-parameter case ZeRO-3 must handle).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a `GPT`.

    vocab_size: tokens (256 for byte-level text). seq_len: maximum context in tokens.
    n_layer blocks of width d_model split over n_head heads. dropout: probability (0 = off).
    bias=False removes every bias; parity tests use it because the attention key bias has an
    exactly zero true gradient (softmax is shift-invariant), so Adam turns rounding noise in it
    into lr-sized updates that differ between any two summation orders.
    """

    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    dropout: float = 0.0
    tie_weights: bool = True
    bias: bool = True  # biases in Linear and LayerNorm (False: nanoGPT / LLaMA style)

    def num_params(self) -> int:
        """Parameter count (elements), counting a tied weight once."""
        d, v, b = self.d_model, self.vocab_size, int(self.bias)
        block = 2 * (d + b * d) + (3 * d * d + b * 3 * d) + (d * d + b * d) + (4 * d * d + b * 4 * d) \
            + (4 * d * d + b * d)
        head = 0 if self.tie_weights else v * d
        return v * d + self.seq_len * d + self.n_layer * block + d + b * d + head


# Named sizes used by the demo and the benchmarks.
GPT_SIZES = {
    "tiny": GPTConfig(seq_len=64, n_layer=2, n_head=2, d_model=64),
    "demo": GPTConfig(seq_len=128, n_layer=4, n_head=4, d_model=192),
    "small": GPTConfig(seq_len=256, n_layer=6, n_head=6, d_model=384),
    "base": GPTConfig(seq_len=256, n_layer=12, n_head=12, d_model=768),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model={cfg.d_model} must be divisible by n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """One transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.fc_out = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """Decoder-only transformer.

    forward(idx, targets=None): idx is a LongTensor [batch, seq] of token ids (< vocab_size,
    seq <= cfg.seq_len). With targets ([batch, seq]) it returns the mean cross-entropy loss
    (a scalar, nats per token); without, the logits [batch, seq, vocab_size].
    init_weights=False keeps every layer's own constructor init (PyTorch defaults) instead of GPT-2's
    post-hoc normal init, so the model can be built under `zerospeed.zero.Init` (which partitions each
    layer as it is created). Raises ValueError if seq exceeds cfg.seq_len.
    """

    def __init__(self, cfg: GPTConfig = GPTConfig(), *, init_weights: bool = True):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        if not init_weights:  # each layer keeps its constructor's (PyTorch default) init: zero.Init-friendly
            return
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("fc_out.weight") or name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample max_new_tokens tokens after idx ([batch, seq]); returns [batch, seq + max_new_tokens]."""
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.cfg.seq_len:]
            logits = self(ctx)[:, -1, :].float() / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    """A deterministic tiny GPT (same weights for the same seed on every rank)."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(**overrides))


def random_tokens(num_samples: int, seq_len: int, vocab_size: int = 256, seed: int = 0) -> torch.Tensor:
    """Deterministic LongTensor [num_samples, seq_len + 1] of token ids; input = [:, :-1], target = [:, 1:]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_samples, seq_len + 1), generator=g)


def tiny_hf_gpt2(seed: int = 0, n_layer: int = 2):
    """An unmodified Hugging Face `GPT2LMHeadModel` built from a config (no download): vocab 256, 64 positions,
    n_embd 64, 2 heads, no dropout; the same weights for the same seed on every rank. Needs transformers."""
    import os

    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=n_layer, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


def tiny_hf_llama(seed: int = 0, n_layer: int = 2, tie: bool = False):
    """An unmodified Hugging Face `LlamaForCausalLM` from a config (no download): vocab 256, hidden 64,
    4 query heads and 2 key/value heads (grouped-query attention), MLP width 128; the same weights for the
    same seed on every rank. tie: share the embedding with the lm_head. Needs transformers."""
    import os

    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=n_layer,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


class WithMask(nn.Module):
    """x -> (x, (x > 0) as int64): a pipeline layer whose output is a tuple of a tensor with gradient and an
    integer tensor without (a mask or token ids passing between stages)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, (x > 0).long()


class ApplyMask(nn.Module):
    """(x, mask) -> Linear(x) * (1 + mask): consumes WithMask's tuple; width = x's last dimension."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, mask = pair
        return self.lin(x) * (1 + mask)
