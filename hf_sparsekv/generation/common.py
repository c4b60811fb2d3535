"""Constants and helpers shared by the front door (:mod:`.front`) and the engine (:mod:`.engine`): the window
cache's sink and default budget, a model's text config and attention shape, where its layers are placed, a prompt
without its left padding. A leaf module, so that neither of the two imports the other."""

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


def _tp_size(model) -> int:
    """The tensor-parallel degree of a model loaded with ``tp_plan`` (transformers' ``_tp_size``), else 1."""
    return getattr(model, "_tp_size", None) or 1


def _attention_shape(model) -> tuple[int, int, int]:
    """(layers, key/value heads this process holds, head_dim): under tensor parallelism each rank holds
    ``1/tp_size`` of the heads."""
    config = _text_config(model)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers, kv_heads // _tp_size(model), head_dim


def placed_on(model) -> set[str]:
    """The devices of a model dispatched with ``device_map`` (its ``hf_device_map`` values), else an empty set."""
    return {str(device) for device in (getattr(model, "hf_device_map", None) or {}).values()}


def layer_devices(model) -> list[torch.device] | None:
    """The device of each decoder layer (its attention module's parameters) of a model dispatched over several
    devices with ``device_map``, in layer order; None for a model on one device (every layer on ``model.device``)."""
    if len(placed_on(model)) < 2:
        return None
    found = {}
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and index not in found:
            parameter = next(module.parameters(), None)
            if parameter is not None:
                found[index] = parameter.device
    return [found.get(i, model.device) for i in range(_text_config(model).num_hidden_layers)]
