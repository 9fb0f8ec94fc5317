"""A small GPT: token and position embeddings, pre-LayerNorm transformer blocks (causal
self-attention, then an MLP, each on a residual branch), a final LayerNorm and an output head
whose weight is the token embedding's (tied), as in GPT-2 and nanoGPT.

With ``GPTConfig(tensor_parallel=True)`` the blocks are split Megatron-style over the
model-parallel group of ``fleet.init``'s topology (``hybrid_configs["mp_degree"]``): each rank
holds its share of the attention heads (query, key and value as ``ColumnParallelLinear``, the
output projection a ``RowParallelLinear``) and of the MLP's hidden units; embeddings, layer
norms and the head stay whole on every rank. Two collectives per block (one per branch) put the
branches' outputs together.

The blocks are ``blocks.0``, ``blocks.1``, ... in ``model.named_modules()``: the names that
``recompute_configs['checkpoints']`` takes (see :func:`block_names`).

For pipeline parallelism, :func:`pipeline_layers` describes the same network as a flat list of
layers for ``fleet.meta_parallel.PipelineLayer`` (embeddings, the blocks, the final LayerNorm,
the head), the head tied to the token embedding across stages by a ``SharedLayerDesc``;
:func:`unpipelined_state` maps the stages' merged state dicts back onto ``GPT``'s keys.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fleetx.fleet import meta_parallel as mpu


@dataclass
class GPTConfig:
    """Sizes of the model; the defaults give about 3.2 M parameters for a 100-character vocab."""

    vocab_size: int
    block_size: int = 128   # the longest context, in tokens
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0
    tensor_parallel: bool = False  # split the blocks over the model-parallel group


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions <= t only."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd {cfg.n_embd} is not a multiple of n_head {cfg.n_head}")
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.tensor_parallel = cfg.tensor_parallel
        if cfg.tensor_parallel:
            # separate q, k, v so that a rank's output columns are whole heads of each
            self.q, self.k, self.v = (mpu.ColumnParallelLinear(cfg.n_embd, cfg.n_embd,
                                                               gather_output=False)
                                      for _ in range(3))
            self.proj = mpu.RowParallelLinear(cfg.n_embd, cfg.n_embd, input_is_parallel=True)
        else:
            self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
            self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        if self.tensor_parallel:  # this rank's heads: (B, T, C / mp) each
            q, k, v = self.q(x), self.k(x), self.v(x)
        else:
            q, k, v = self.qkv(x).chunk(3, dim=2)
        width = q.shape[-1]
        heads = self.n_head * width // x.shape[-1]
        # (B, T, width) -> (B, heads, T, width / heads)
        q, k, v = (t.view(batch, time, heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(batch, time, width))


class Block(nn.Module):
    """``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``: normalising before each branch (pre-LN)
    keeps the residual stream unnormalised, which trains stably without warm-up tricks."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        if cfg.tensor_parallel:  # this rank's share of the hidden units
            up = mpu.ColumnParallelLinear(cfg.n_embd, 4 * cfg.n_embd, gather_output=False)
            down = mpu.RowParallelLinear(4 * cfg.n_embd, cfg.n_embd, input_is_parallel=True)
        else:
            up, down = nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.mlp = nn.Sequential(up, nn.GELU(), down, nn.Dropout(cfg.dropout))

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
                with (mpu.get_rng_state_tracker().rng_state() if cfg.tensor_parallel
                      else contextlib.nullcontext()):
                    nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        split = isinstance(module, (mpu.ColumnParallelLinear, mpu.RowParallelLinear))
        if split:
            # each rank's shard from the model-parallel stream (seeded per rank by fleet.init):
            # shards drawn alike would start, and stay, as copies of one another
            with mpu.get_rng_state_tracker().rng_state():
                nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if (split or isinstance(module, nn.Linear)) and module.bias is not None:
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


class PipeEmbedding(nn.Module):
    """Token and position embeddings, the first layer of the pipelined GPT. The last stage
    holds a copy as the output head: ``weight`` (the token embedding's) is the tied matrix."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        for emb in (self.tok_emb, self.pos_emb):
            nn.init.normal_(emb.weight, std=0.02)

    @property
    def weight(self) -> nn.Parameter:
        return self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(positions))


class PipeBlock(Block):
    """A transformer block initialised on its own, as ``GPT`` initialises its blocks (each
    stage builds only its layers, so no whole model is there to initialise them)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.apply(GPT._init)
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))


def tied_head(embedding: PipeEmbedding, x: torch.Tensor) -> torch.Tensor:
    """The output head: logits from the token embedding's matrix (``GPT.head``'s tie)."""
    return x @ embedding.weight.t()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position (float32 even when the logits are not)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def pipeline_layers(cfg: GPTConfig) -> list:
    """``GPT`` as the layer list of a ``PipelineLayer``: index 0 the embeddings, 1..n_layer the
    blocks, n_layer + 1 the final LayerNorm, n_layer + 2 the head (the embedding's copy)."""
    return ([mpu.SharedLayerDesc("embed", PipeEmbedding, None, "weight", cfg)]
            + [mpu.LayerDesc(PipeBlock, cfg) for _ in range(cfg.n_layer)]
            + [mpu.LayerDesc(nn.LayerNorm, cfg.n_embd),
               mpu.SharedLayerDesc("embed", PipeEmbedding, tied_head, "weight", cfg)])


def unpipelined_state(state: dict, n_layer: int) -> dict:
    """``GPT``'s state dict from the stages' merged ones (keys ``"0.tok_emb.weight"``,
    ``"3.ln1.weight"``...); the head's copy of the embeddings is the tied matrix again."""
    out = {}
    for key, value in state.items():
        index, rest = key.split(".", 1)
        i = int(index)
        if i == 0:
            out[rest] = value
        elif i <= n_layer:
            out[f"blocks.{i - 1}.{rest}"] = value
        elif i == n_layer + 1:
            out[f"ln_f.{rest}"] = value
    out["head.weight"] = out["tok_emb.weight"]
    return out
