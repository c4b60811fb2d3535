"""QuantSpec's hierarchical quantized KV store (§4.2–4.3): one store, an INT4 draft view and an INT8 verify view.

Layout per layer (batch 1):

* quantized part, ``T_q`` tokens (a multiple of G = ``group_size``): keys quantized per channel over groups of G
  tokens, values per token; upper and lower INT4 codes packed two per byte (see
  :mod:`hf_sparsekv.kernels.quant_reference`);
* a full-precision buffer of the most recent tokens. The prefill quantizes whole groups so that between G and
  2G-1 tokens (all of them if the prompt is shorter than G) stay in full precision. Before each later update, while
  the buffer holds >= 2G tokens its oldest G are quantized. Rolled-back tokens therefore always live in the buffer
  and rollback never re-quantizes.

The quantization state a token sees depends only on its position, so greedy decoding one token at a time and a
verification block that does not cross a flush (see :meth:`HierarchicalQuantCache.uniform_room`) see the same
numbers. The prefill attends in full precision.
"""

from __future__ import annotations

import functools

import torch

from ..kernels.quant_reference import (
    QuantizedTensor,
    dequantize_keys,
    dequantize_values,
    quantize_keys,
    quantize_values,
)
from .base import CompressedCache, CompressedLayer, tensor_nbytes

VIEWS = ("int4", "int8")


def _cat_quantized(a: QuantizedTensor | None, b: QuantizedTensor) -> QuantizedTensor:
    if a is None:
        return b
    return QuantizedTensor(*(torch.cat([x, y], dim=-2) for x, y in zip(vars(a).values(), vars(b).values())))


class HierarchicalQuantLayer(CompressedLayer):
    def __init__(self, group_size: int, owner: "HierarchicalQuantCache") -> None:
        super().__init__()
        self.group_size = group_size
        self.owner = owner  # holds the current view, shared by all layers
        self.qkeys: QuantizedTensor | None = None
        self.qvalues: QuantizedTensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        if key_states.shape[-1] % 2:
            raise ValueError(f"head_dim must be even to pack INT4 codes, got {key_states.shape[-1]}")
        self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]  # the full-precision buffer

    @property
    def quantized_length(self) -> int:
        return 0 if self.qkeys is None else self.qkeys.upper.shape[-2]

    def stored_length(self) -> int:
        return self.seen

    def _flush(self, n_tokens: int) -> None:
        """Quantize the oldest ``n_tokens`` (a multiple of G) of the buffer."""
        if n_tokens <= 0:
            return
        self.qkeys = _cat_quantized(self.qkeys, quantize_keys(self.keys[..., :n_tokens, :], self.group_size))
        self.qvalues = _cat_quantized(self.qvalues, quantize_values(self.values[..., :n_tokens, :]))
        self.keys, self.values = self.keys[..., n_tokens:, :], self.values[..., n_tokens:, :]

    def pending_flush(self) -> int:
        """Tokens the next update quantizes before appending."""
        g, n = self.group_size, self.keys.shape[-2] if self.keys is not None else 0
        return g * max(0, n // g - 1)

    def dequantized(self, view: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The quantized part in ``view`` precision, ``[B, H, T_q, D]`` in the cache dtype (reference path)."""
        int8 = view == "int8"
        return (
            dequantize_keys(self.qkeys, self.group_size, int8, self.dtype),
            dequantize_values(self.qvalues, int8, self.dtype),
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.seen == 0:  # prefill: attend in full precision, then keep G..2G-1 tokens in the buffer
            self.keys, self.values = key_states, value_states
            self.seen = key_states.shape[-2]
            self._flush(self.pending_flush())
            return key_states, value_states
        self._flush(self.pending_flush())
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.seen += key_states.shape[-2]
        if self.qkeys is None:
            return self.keys, self.values
        qk, qv = self.dequantized(self.owner.view)
        return torch.cat([qk, self.keys], dim=-2), torch.cat([qv, self.values], dim=-2)

    def crop(self, tokens_to_remove: int) -> None:
        n = self._tokens_to_remove(tokens_to_remove)
        if n == 0:
            return
        if n > self.keys.shape[-2]:
            raise ValueError(
                f"cannot roll HierarchicalQuantCache back by {n} tokens: only the {self.keys.shape[-2]} tokens of the "
                "full-precision buffer can be removed (the rest is quantized)"
            )
        self.keys = self.keys[..., : self.keys.shape[-2] - n, :]
        self.values = self.values[..., : self.values.shape[-2] - n, :]
        self.seen -= n

    def reset(self) -> None:
        super().reset()
        self.qkeys = self.qvalues = None

    def nbytes(self) -> int:
        q = [t for qt in (self.qkeys, self.qvalues) if qt is not None for t in vars(qt).values()]
        return tensor_nbytes(self.keys, self.values, *q)


class HierarchicalQuantCache(CompressedCache):
    """Hierarchical INT4/INT8 KV cache with a double full-precision buffer of 2·``group_size`` tokens. Batch size 1.

    ``view`` selects what attention reads from the quantized part: ``"int8"`` (upper + lower codes, the verifier's
    view, default) or ``"int4"`` (upper codes only, the self-speculative draft). Switching costs nothing: both
    views read the same store.
    """

    def __init__(self, group_size: int = 128, view: str = "int8"):
        if not isinstance(group_size, int) or group_size <= 0 or group_size % 8:
            raise ValueError(f"group_size must be a positive multiple of 8, got {group_size!r}")
        self.group_size = group_size
        self.view = "int8"
        self.set_view(view)
        super().__init__(layer_class_to_replicate=functools.partial(HierarchicalQuantLayer, group_size, self))

    def set_view(self, view: str) -> None:
        if view not in VIEWS:
            raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
        self.view = view

    def uniform_room(self) -> int:
        """How many tokens the next update may carry so that each sees the quantization state it would see if the
        tokens were fed one at a time (no flush boundary inside the block). Always >= 1."""
        if not self.layers or not self.layers[0].is_initialized:
            return 2 * self.group_size
        layer = self.layers[0]
        return 2 * self.group_size - (layer.keys.shape[-2] - layer.pending_flush())

    def buffer_length(self) -> int:
        return self.layers[0].keys.shape[-2] if self.layers and self.layers[0].is_initialized else 0
