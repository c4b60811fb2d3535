"""A quantized store's prefill write as one opaque op (``hf_sparsekv::store_quantized_prompt``).

Of a prompt of P tokens, :class:`~.static.StaticQuantCache` quantizes the first ``T_q = G * max(0, P // G - 1)``
into its INT4/INT8 codes and keeps the rest in its full-precision buffer. ``T_q`` is Python arithmetic on the prompt
length, and the quantize kernels are Triton launches whose grids follow it: traced inline by ``torch.compile`` with
dynamic shapes they become guards (a compilation per length) or graph breaks. Behind a custom op the compiled
prefill sees one call per layer that writes the row's codes and buffer, and the arithmetic runs on concrete sizes
when the op runs. The host knows ``T_q`` before the forward, so the cache sets the row's quantized length and slot
positions there (:meth:`~.static.StaticQuantCache.begin_prefill`), outside the traced forward.
"""

from __future__ import annotations

import torch

from ..kernels.quant_reference import QuantizedTensor


def quantized_length(position: int, group_size: int) -> int:
    """``T_q`` seen by a step whose first position is ``position`` (the codes cover whole groups of ``group_size``,
    the last full group before ``position`` still in the buffer)."""
    return group_size * max(0, position // group_size - 1)


def quantize_into(qkeys: QuantizedTensor, qvalues: QuantizedTensor, row: int, keys: torch.Tensor,
                  values: torch.Tensor, start: int, group_size: int) -> None:
    """Quantize ``keys/values [1, H, n, D]`` (n and ``start`` multiples of ``group_size``) into row ``row`` of the
    code stores ``qkeys``/``qvalues`` (``[B, H, T, D/2]`` codes; keys' scale/zero per group, values' per token) at
    positions ``start..start+n-1``."""
    from ..kernels.quantize import quantize_keys_auto, quantize_values_auto

    n = keys.shape[-2]
    if n == 0:
        return

    def slots(store: QuantizedTensor, first: int, last: int) -> QuantizedTensor:  # row's codes and their scales
        rows, codes, params = slice(row, row + 1), slice(start, start + n), slice(first, last)
        return QuantizedTensor(store.upper[rows, :, codes], store.lower[rows, :, codes], store.scale[rows, :, params],
                               store.zero[rows, :, params])

    # the kernels write the store's slots themselves (a prefill's host work is a few launches a layer)
    quantize_keys_auto(keys, group_size, out=slots(qkeys, start // group_size, (start + n) // group_size))
    quantize_values_auto(values, out=slots(qvalues, start, start + n))


@torch.library.custom_op("hf_sparsekv::store_quantized_prompt",
                         mutates_args=("keys", "values", "key_upper", "key_lower", "key_scale", "key_zero",
                                       "value_upper", "value_lower", "value_scale", "value_zero"))
def store_quantized_prompt(key_states: torch.Tensor, value_states: torch.Tensor, keys: torch.Tensor,
                           values: torch.Tensor, key_upper: torch.Tensor, key_lower: torch.Tensor,
                           key_scale: torch.Tensor, key_zero: torch.Tensor, value_upper: torch.Tensor,
                           value_lower: torch.Tensor, value_scale: torch.Tensor, value_zero: torch.Tensor, row: int,
                           group_size: int) -> None:
    """Write a prompt's keys/values ``[1, Hkv, P, D]`` into row ``row`` of one layer of a quantized store: positions
    ``0..T_q-1`` (:func:`quantized_length` of P) as codes, the rest into the full-precision buffers
    ``keys``/``values`` ``[B, Hkv, C, D]`` from slot 0."""
    p = key_states.shape[-2]
    t = quantized_length(p, group_size)
    quantize_into(QuantizedTensor(key_upper, key_lower, key_scale, key_zero),
                  QuantizedTensor(value_upper, value_lower, value_scale, value_zero), row,
                  key_states[:, :, :t], value_states[:, :, :t], 0, group_size)
    keys[row, :, : p - t].copy_(key_states[0, :, t:])
    values[row, :, : p - t].copy_(value_states[0, :, t:])


@store_quantized_prompt.register_fake
def _(key_states, value_states, keys, values, key_upper, key_lower, key_scale, key_zero, value_upper, value_lower,
      value_scale, value_zero, row, group_size) -> None:
    return None
