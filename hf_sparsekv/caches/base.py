"""Shared layer mechanics of the compressed caches: logical length, mask sizes, crop arguments, memory."""

from __future__ import annotations

import numbers

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .kernel_hook import offer


def is_integer(value) -> bool:
    """An integer setting: a Python or NumPy integer (a swept value) or a 0-d integer tensor, not a bool (callers
    store ``int(value)``)."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def tensor_nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class CompressedLayer(CacheLayerMixin):
    """A cache layer that stores fewer tokens than it has seen.

    Invariants: ``seen`` is the logical length (tokens seen, what RoPE positions and ``cache_position`` use);
    ``stored_length()`` is the number of past tokens the next ``update`` returns ahead of the new ones. The
    mask offset ``seen - stored`` makes the standard causal mask see every stored past token and be causal
    among the new ones.
    """

    is_sliding = False
    is_croppable = True

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.shape[0] != 1:
            raise NotImplementedError(
                f"{type(self).__name__} supports batch size 1 only, got key_states with batch size "
                f"{key_states.shape[0]}: "
                "as a drop-in cache it holds one sequence; pass one prompt per call, or decode the batch with "
                "generate(ids, attention_mask=mask, assistant_model=..., draft_cache=...) (rows together)"
            )
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def stored_length(self) -> int:
        raise NotImplementedError

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = self.stored_length()
        return stored + query_length, self.seen - stored

    def nbytes(self) -> int:
        raise NotImplementedError

    def reset(self) -> None:
        """Back to the empty, uninitialized state (subclasses clear their own extra state too)."""
        self.keys = self.values = None
        self.seen = 0
        self.is_initialized = False

    def _tokens_to_remove(self, tokens_to_remove: int) -> int:
        """``crop`` argument -> number of tokens to drop. Negative: remove that many; positive: keep that many (the
        legacy transformers convention); zero: nothing."""
        if tokens_to_remove == 0:
            return 0
        n = -tokens_to_remove if tokens_to_remove < 0 else self.seen - tokens_to_remove
        if n > self.seen:
            raise ValueError(f"cannot remove {n} tokens from a cache that has seen {self.seen}")
        return max(n, 0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support beam search (num_beams > 1)")


class CompressedCache(Cache):
    """Base of the project's caches: memory reporting and a crop that accepts either convention."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """The layer's update, then the layer is handed to the attention function that follows (see
        :mod:`.kernel_hook`), which may run a kernel over the layer's own storage."""
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        offer(layer_idx, self.layers[layer_idx], keys)
        return keys, values

    def nbytes(self) -> int:
        """Bytes held by the cache's tensors (stored tokens and quantization parameters)."""
        return sum(layer.nbytes() for layer in self.layers)

    def crop(self, tokens_to_remove: int) -> None:
        """Negative: remove that many most recent tokens; positive: keep the first ``tokens_to_remove``; zero: no-op."""
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError(f"{type(self).__name__} supports batch size 1 only (repeats={repeats})")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} supports batch size 1 only")
