"""Sink + sliding-window drafter cache (StreamingLLM / LongSpec §3.1): constant memory.

Each step attends to the first ``sink`` tokens, the ``window`` tokens before the step's input, and the input
itself (causally). The prefill attends to the whole prompt; afterwards only sink + window + ``max_rollback``
tokens are stored. The ``max_rollback`` extra tokens make rolling back up to that many rejected draft tokens exact:
the window after a rollback is what it was before the rejected tokens were appended.
"""

from __future__ import annotations

import functools

import torch

from .base import CompressedCache, CompressedLayer, is_integer, tensor_nbytes


class SinkWindowLayer(CompressedLayer):
    def __init__(self, sink: int, window: int, max_rollback: int) -> None:
        super().__init__()
        self.sink, self.window, self.max_rollback = sink, window, max_rollback
        self.recent_keys: torch.Tensor | None = None
        self.recent_values: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]  # sink tokens
        self.recent_keys, self.recent_values = self.keys, self.values

    def _visible_recent(self) -> int:
        return min(self.recent_keys.shape[-2], self.window)

    def stored_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.keys.shape[-2] + self._visible_recent()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.seen == 0:
            out = (key_states, value_states)  # the prefill attends to the whole prompt
        else:
            r = self._visible_recent()
            past_k = torch.cat([self.keys, self.recent_keys[..., self.recent_keys.shape[-2] - r :, :]], dim=-2)
            past_v = torch.cat([self.values, self.recent_values[..., self.recent_values.shape[-2] - r :, :]], dim=-2)
            out = (torch.cat([past_k, key_states], dim=-2), torch.cat([past_v, value_states], dim=-2))
        self._append(key_states, value_states)
        return out

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        to_sink = min(self.sink - self.keys.shape[-2], key_states.shape[-2])
        if to_sink > 0:
            self.keys = torch.cat([self.keys, key_states[..., :to_sink, :]], dim=-2)
            self.values = torch.cat([self.values, value_states[..., :to_sink, :]], dim=-2)
        capacity = self.window + self.max_rollback
        self.recent_keys = torch.cat([self.recent_keys, key_states[..., to_sink:, :]], dim=-2)[..., -capacity:, :]
        self.recent_values = torch.cat([self.recent_values, value_states[..., to_sink:, :]], dim=-2)[..., -capacity:, :]
        self.seen += key_states.shape[-2]

    def crop(self, tokens_to_remove: int) -> None:
        n = self._tokens_to_remove(tokens_to_remove)
        if n == 0:
            return
        n_recent, n_sink = self.recent_keys.shape[-2], self.keys.shape[-2]
        from_recent = min(n, n_recent)
        from_sink = n - from_recent
        non_sink_after = self.seen - n - (n_sink - from_sink)
        if n_recent - from_recent < min(self.window, non_sink_after):
            raise ValueError(
                f"cannot roll SinkWindowCache back by {n} tokens: only {max(n_recent - self.window, 0)} "
                f"tokens beyond the window are kept (max_rollback={self.max_rollback})"
            )
        self.recent_keys = self.recent_keys[..., : n_recent - from_recent, :]
        self.recent_values = self.recent_values[..., : n_recent - from_recent, :]
        self.keys = self.keys[..., : n_sink - from_sink, :]
        self.values = self.values[..., : n_sink - from_sink, :]
        self.seen -= n

    def reset(self) -> None:
        super().reset()
        self.recent_keys = self.recent_values = None

    def nbytes(self) -> int:
        return tensor_nbytes(self.keys, self.values, self.recent_keys, self.recent_values)


class SinkWindowCache(CompressedCache):
    """First ``sink`` tokens + last ``window`` tokens, O(sink + window + max_rollback) memory. Batch size 1.

    Args:
        sink: attention-sink tokens kept from the start (0 allowed).
        window: recent tokens attended before each step's input (>= 1).
        max_rollback: extra recent tokens stored so that ``crop`` of up to this many tokens is exact
            (the speculative loop rolls back at most γ − 1 rejected drafts; generate() checks it).
    """

    def __init__(self, sink: int = 4, window: int = 1024, max_rollback: int = 16):
        if not is_integer(sink) or sink < 0:
            raise ValueError(f"sink must be a non-negative integer, got {sink!r}")
        if not is_integer(window) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        if not is_integer(max_rollback) or max_rollback < 0:
            raise ValueError(f"max_rollback must be a non-negative integer, got {max_rollback!r}")
        sink, window, max_rollback = int(sink), int(window), int(max_rollback)
        self.sink, self.window, self.max_rollback = sink, window, max_rollback
        super().__init__(layer_class_to_replicate=functools.partial(SinkWindowLayer, sink, window, max_rollback))
