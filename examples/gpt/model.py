"""A small GPT: token and position embeddings, pre-LayerNorm transformer blocks (causal
self-attention, then an MLP, each on a residual branch), a final LayerNorm and an output head
whose weight is the token embedding's (tied), as in GPT-2 and nanoGPT.

The blocks are ``blocks.0``, ``blocks.1``, ... in ``model.named_modules()``: the names that
``recompute_configs['checkpoints']`` takes (see :func:`block_names`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    """Sizes of the model; the defaults give about 3.2 M parameters for a 100-character vocab."""

    vocab_size: int
    block_size: int = 128   # the longest context, in tokens
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions <= t only."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd {cfg.n_embd} is not a multiple of n_head {cfg.n_head}")
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        # (B, T, 3C) -> three (B, heads, T, C / heads)
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2)
                   for t in self.qkv(x).split(channels, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(batch, time, channels))


class Block(nn.Module):
    """``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``: normalising before each branch (pre-LN)
    keeps the residual stream unnormalised, which trains stably without warm-up tricks."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The language model: ``forward(idx)`` gives logits (B, T, vocab) for token ids (B, T)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one matrix reads and writes tokens
        self.apply(self._init)
        # GPT-2's scaling: each residual branch's last layer starts smaller, so the sum of
        # 2 * n_layer branches keeps the stream's variance near 1 at initialisation.
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """``idx`` (B, T) followed by ``new_tokens`` sampled tokens, each drawn from the softmax
        of the last position's logits divided by ``temperature``."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.cfg.block_size:])[:, -1, :].float()
            probs = F.softmax(logits / temperature, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


def block_names(model: GPT) -> list[str]:
    """The qualified names of the transformer blocks: ``['blocks.0', 'blocks.1', ...]``."""
    return [f"blocks.{i}" for i in range(len(model.blocks))]


def parameter_count(model: nn.Module) -> int:
    """Distinct parameters (the tied head's weight is counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
