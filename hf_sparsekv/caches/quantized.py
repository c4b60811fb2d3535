"""QuantSpec's hierarchical quantized KV store (§4.2–4.3): one store, an INT4 draft view and an INT8 verify view.

Layout per layer (batch 1):

* quantized part, ``T_q`` tokens (a multiple of G = ``group_size``): keys quantized per channel over groups of G
  tokens, values per token; upper and lower INT4 codes packed two per byte (see
  :mod:`hf_sparsekv.kernels.quant_reference`);
* a full-precision buffer of the most recent tokens. The prefill quantizes whole groups so that between G and
  2G-1 tokens (all of them if the prompt is shorter than G) stay in full precision. Before each later update, while
  the buffer holds >= 2G tokens its oldest G are quantized. Rolled-back tokens therefore always live in the buffer
  and rollback never re-quantizes.

Attention paths. Reference (CPU, or any attention implementation): ``update`` returns the dequantized store in the
current view followed by the buffer. Kernel path (CUDA, the ``"sparsekv"`` attention, see :mod:`hf_sparsekv.attention`):
once that attention has seen a layer it sets ``kernel_attention``; from then on ``update`` returns *placeholders*
(meta tensors of the right shape, no memory, unusable by any other attention: a loud error, never a wrong result)
and the attention kernel reads the packed codes and the buffer directly. Quantization (prefill and flush) runs
through the Triton quantize kernels where they are enabled (bit-identical to the reference for float16/bfloat16).

The quantization state a token sees depends only on its position, so greedy decoding one token at a time and a
verification block that does not cross a flush (see :meth:`HierarchicalQuantCache.uniform_room`) see the same
numbers. The prefill attends in full precision.
"""

from __future__ import annotations

import functools

import torch

from ..kernels import runtime
from ..kernels.quant_reference import QuantizedTensor, dequantize_keys, dequantize_values
from ..kernels.quantize import quantize_keys_auto, quantize_values_auto
from .base import CompressedCache, CompressedLayer, is_integer, tensor_nbytes

VIEWS = ("int4", "int8")
DEFAULT_GROUP_SIZE = 128


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
        self.kernel_attention = False  # set by the "sparsekv" attention: update may return placeholders

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
        self.qkeys = _cat_quantized(self.qkeys, quantize_keys_auto(self.keys[..., :n_tokens, :], self.group_size))
        self.qvalues = _cat_quantized(self.qvalues, quantize_values_auto(self.values[..., :n_tokens, :]))
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
        if self.kernel_attention and runtime.enabled(self.device):
            shape = (*self.keys.shape[:2], self.seen, self.keys.shape[-1])
            placeholder = torch.empty(shape, dtype=self.dtype, device="meta")
            return placeholder, placeholder
        return self.materialized()

    def materialized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored token, the quantized part dequantized in the current view, ``[B, H, seen, D]`` (reference)."""
        if self.qkeys is None:
            return self.keys, self.values
        qk, qv = self.dequantized(self.owner.view)
        return torch.cat([qk, self.keys], dim=-2), torch.cat([qv, self.values], dim=-2)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest tokens of the full-precision buffer. Exact back to the length at the last flush; a
        flush that an update being removed ran is not undone (its tokens stay quantized)."""
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
        self.kernel_attention = False

    def nbytes(self) -> int:
        q = [t for qt in (self.qkeys, self.qvalues) if qt is not None for t in vars(qt).values()]
        return tensor_nbytes(self.keys, self.values, *q)


class HierarchicalQuantCache(CompressedCache):
    """Hierarchical INT4/INT8 KV cache with a double full-precision buffer of 2·``group_size`` tokens. Batch size 1.

    ``view`` selects what attention reads from the quantized part: ``"int8"`` (upper + lower codes, the verifier's
    view, default) or ``"int4"`` (upper codes only, the self-speculative draft). Switching costs nothing: both
    views read the same store.
    """

    def __init__(self, group_size: int = DEFAULT_GROUP_SIZE, view: str = "int8"):
        if not is_integer(group_size) or group_size <= 0 or group_size % 8:
            raise ValueError(f"group_size must be a positive multiple of 8, got {group_size!r}")
        self.group_size = group_size = int(group_size)
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
