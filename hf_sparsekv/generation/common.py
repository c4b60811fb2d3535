"""Constants and helpers shared by the eager front (:mod:`.front`) and the static loop (:mod:`.graph_loop`): the
window cache's sink and default budget, a model's text config, a prompt without its left padding. A leaf module, so
that neither of the two imports the other."""

from __future__ import annotations

import torch

WINDOW_SINK = 4
CHUNK_SIZE = 8  # ChunkBudgetCache's default: tokens per scored chunk
DEFAULT_WINDOW_BUDGET = 1024


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _strip_left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if attention_mask is None or bool(attention_mask.all()):
        return input_ids
    mask = attention_mask[0].bool()
    first = int(mask.int().argmax())
    if not bool(mask[first:].all()) or first == mask.shape[0]:
        raise NotImplementedError(
            "attention_mask: only left padding is supported (each row's ones contiguous, reaching the last column, "
            "at least one)"
        )
    return input_ids[:, first:]
