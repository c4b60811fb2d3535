"""Decode attention over the hierarchical quantized store (QuantSpec): Triton kernel and its PyTorch reference.

``query [1, Hq, L, D]`` (L = 1..16) against the quantized part of a :class:`~hf_sparsekv.caches.HierarchicalQuantCache`
layer (``qkeys``/``qvalues``: packed codes ``[1, Hkv, T_q, D/2]``, key scale/zero ``[1, Hkv, T_q/G, D]``, value
scale/zero ``[1, Hkv, T_q, 1]``, see :mod:`.quant_reference`) followed by its full-precision buffer
``buffer_key/buffer_value [1, Hkv, S_b, D]`` whose last L tokens are the queries' own (causal among themselves).
``int8=False`` reads the upper codes only (the INT4 draft view), ``int8=True`` upper + lower (the INT8 verify view).

The kernel reads the packed bytes and dequantizes in registers (no dequantized copy of the store is made), splits
the store over the GPU (flash-decoding) and merges the splits and the buffer by log-sum-exp. Group size G must be a
multiple of 16. Returns ``[1, L, Hq, D]`` in the query dtype.
"""

from __future__ import annotations

import torch

from . import runtime
from .decode_core import launch_decode
from .quant_reference import QuantizedTensor, dequantize_keys, dequantize_values
from .reference import masked_attention_reference


def _check(query, qkeys, qvalues, buffer_key, buffer_value, group_size):
    runtime.check_attention_inputs(query, buffer_key, buffer_value)
    if buffer_key.shape[-2] < query.shape[-2]:
        raise ValueError(
            f"the full-precision buffer ({buffer_key.shape[-2]} tokens) must hold the {query.shape[-2]} query tokens"
        )
    if qkeys is None:
        return
    if not isinstance(group_size, int) or group_size <= 0 or group_size % 16:
        raise NotImplementedError(f"group_size must be a positive multiple of 16 for the kernel, got {group_size!r}")
    t_q = qkeys.upper.shape[-2]
    hkv, d = buffer_key.shape[1], buffer_key.shape[-1]
    if qkeys.upper.shape != (1, hkv, t_q, d // 2) or qvalues.upper.shape != (1, hkv, t_q, d // 2):
        raise ValueError(
            f"codes must be [1, {hkv}, T_q, {d // 2}], got {tuple(qkeys.upper.shape)} and {tuple(qvalues.upper.shape)}"
        )
    if qkeys.scale.shape != (1, hkv, t_q // group_size, d) or qvalues.scale.shape != (1, hkv, t_q, 1):
        raise ValueError("key/value scale shapes do not match the codes and group_size")
    for name, t in (("key codes", qkeys.upper), ("value codes", qvalues.upper)):
        if t.dtype != torch.uint8:
            raise ValueError(f"{name} must be uint8, got {t.dtype}")
    if qkeys.scale.dtype != query.dtype or qvalues.scale.dtype != query.dtype:
        raise ValueError("quantization scales must have the query dtype")
    for qt in (qkeys, qvalues):
        for t in vars(qt).values():
            if t.stride(-1) != 1:
                raise ValueError("quantized tensors must be contiguous in their last dimension")


def quant_decode_attention(
    query: torch.Tensor,
    qkeys: QuantizedTensor | None,
    qvalues: QuantizedTensor | None,
    buffer_key: torch.Tensor,
    buffer_value: torch.Tensor,
    group_size: int,
    int8: bool,
    scaling: float,
) -> torch.Tensor:
    """Triton kernel; see the module docstring. ``qkeys``/``qvalues`` None: nothing quantized yet."""
    _check(query, qkeys, qvalues, buffer_key, buffer_value, group_size)
    quant = None if qkeys is None or qkeys.upper.shape[-2] == 0 else (qkeys, qvalues)
    return launch_decode(query, scaling, buffer_key, buffer_value, quant=quant, group_size=group_size, int8=int8)


def quant_decode_attention_reference(
    query: torch.Tensor,
    qkeys: QuantizedTensor | None,
    qvalues: QuantizedTensor | None,
    buffer_key: torch.Tensor,
    buffer_value: torch.Tensor,
    group_size: int,
    int8: bool,
    scaling: float,
) -> torch.Tensor:
    """PyTorch reference: dequantize the store (float32), append the buffer, attend in float32."""
    key, value = buffer_key.float(), buffer_value.float()
    if qkeys is not None and qkeys.upper.shape[-2]:
        key = torch.cat([dequantize_keys(qkeys, group_size, int8, torch.float32), key], dim=-2)
        value = torch.cat([dequantize_values(qvalues, int8, torch.float32), value], dim=-2)
    return masked_attention_reference(query.float(), key, value, scaling).to(query.dtype)
