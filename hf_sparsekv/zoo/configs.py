"""Shapes of the bundled pair: a 12-layer long-context verifier and a 2-layer, 2K-position drafter (Llama).

The pair mirrors the papers' setting at toy scale (a 7B verifier trained for 128K with a 68M drafter trained at
2K): same vocabulary, the drafter is run far beyond its native positions at inference.
"""

from __future__ import annotations

from transformers import LlamaConfig

VOCAB_SIZE = 8192
VERIFIER_MAX_POSITIONS = 16384
DRAFTER_MAX_POSITIONS = 2048


def _config(layers: int, max_positions: int, rope_theta: float, vocab_size: int, eos: int, pad: int, **overrides) -> LlamaConfig:
    values = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def verifier_config(vocab_size: int = VOCAB_SIZE, eos: int = 0, pad: int = 1, **overrides) -> LlamaConfig:
    """12 layers, d=256, 4 query / 2 KV heads of 64; RoPE base 5e5 so that 16K positions stay well resolved."""
    return _config(12, VERIFIER_MAX_POSITIONS, 500_000.0, vocab_size, eos, pad, **overrides)


def drafter_config(vocab_size: int = VOCAB_SIZE, eos: int = 0, pad: int = 1, **overrides) -> LlamaConfig:
    """2 layers, same width and heads, native 2048 positions, RoPE base 1e4."""
    return _config(2, DRAFTER_MAX_POSITIONS, 10_000.0, vocab_size, eos, pad, **overrides)
