"""Small Hugging Face models built from a config (no weights downloaded), shared by the tests of
fleetx with transformers models: ``GPT2LMHeadModel`` (tied embedding and head, blocks in
``transformer.h``) and ``LlamaForCausalLM`` (blocks in ``model.layers``, grouped-query attention,
its own tensor-parallel plan). transformers is the ``hf`` extra that scripts/setup.sh installs;
without it the tests skip, which fails a CI run (tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

VOCAB = 256  # byte-level, as examples/hf_llama


def transformers():
    """The transformers module, or skip the test (a failure under CI=true)."""
    return pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")


def gpt2(n_layer: int = 2, n_embd: int = 32, n_head: int = 4, seed: int = 0, **config):
    """A ``GPT2LMHeadModel`` of ``n_layer`` blocks, initialised from ``seed``, dropout off."""
    tf = transformers()
    cfg = tf.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=n_embd, n_layer=n_layer,
                        n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0, **config)
    torch.manual_seed(seed)
    return tf.GPT2LMHeadModel(cfg)


def llama(n_layer: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2, seed: int = 0,
          **config):
    """A ``LlamaForCausalLM`` of ``n_layer`` decoder layers, initialised from ``seed``."""
    tf = transformers()
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=n_layer, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, **config)
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(cfg)


def batch(size: int, length: int = 16, seed: int = 1) -> torch.Tensor:
    """Token ids ``[size, length]`` (labels are the ids: the models shift them)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (size, length), generator=g)
