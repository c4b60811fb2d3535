"""The ``"sparsekv"`` attention implementation registered with transformers.

It computes attention exactly like PyTorch SDPA (the reference path) and, when a cache layer asked for the
prompt's queries (chunk scoring, see :mod:`hf_sparsekv.caches.chunk_budget`), hands them over.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from .caches import scoring_hook

NAME = "sparsekv"


def sparsekv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """query ``[B, Hq, q, D]``, key/value ``[B, Hkv, kv, D]`` (as returned by the cache) -> ``([B, q, Hq, D], None)``."""
    out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    layer = scoring_hook.take(getattr(module, "layer_idx", -1), key)
    if layer is not None:
        layer.select(query, scaling if scaling is not None else query.shape[-1] ** -0.5)
    return out


def register() -> None:
    AttentionInterface.register(NAME, sparsekv_attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
