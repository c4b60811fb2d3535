"""Hierarchical quantize/pack kernels for the quantized store (prefill and buffer flush): Triton, with the PyTorch
reference of :mod:`.quant_reference` as the spec (same signatures: ``quantize_keys(keys, group_size)``,
``quantize_values(values)``).

Agreement: for float16 and bfloat16 inputs the codes, scales and zero points are bit-identical to the reference
(float32 arithmetic in the same order, IEEE division, ties-to-even rounding, the outward ``nextafter`` done on the
bit pattern; ``z + s·cu`` is exact in float32 because ``s`` has at most 11 significant bits, so a fused
multiply-add cannot change it). For float32 inputs the product ``s·cu`` is rounded and the compiler may fuse it
into an FMA, so a lower code can differ by one where the residual lands exactly on a rounding tie (upper codes,
scales and zero points stay identical); tests allow that.

:func:`quantize_keys_auto` / :func:`quantize_values_auto` pick the kernel where :func:`runtime.enabled` says so and
the reference otherwise; the cache calls those.
"""

from __future__ import annotations

import torch

from . import runtime
from .quant_reference import QuantizedTensor
from .quant_reference import quantize_keys as quantize_keys_reference
from .quant_reference import quantize_values as quantize_values_reference

__all__ = [
    "quantize_keys",
    "quantize_keys_auto",
    "quantize_keys_reference",
    "quantize_values",
    "quantize_values_auto",
    "quantize_values_reference",
]


def _type_args(dtype: torch.dtype):
    import triton.language as tl

    if dtype == torch.float16:
        return dict(STORE=tl.float16, INT=tl.int16, NEG_TINY=-32767)
    if dtype == torch.bfloat16:
        return dict(STORE=tl.bfloat16, INT=tl.int16, NEG_TINY=-32767)
    if dtype == torch.float32:
        return dict(STORE=tl.float32, INT=tl.int32, NEG_TINY=-2147483647)
    raise NotImplementedError(f"dtype {dtype} is not supported by the quantize kernels (float16, bfloat16, float32)")


def _check(x: torch.Tensor, name: str) -> None:
    if x.dim() != 4 or x.shape[0] != 1:
        raise NotImplementedError(f"{name} must be [1, H, T, D] (batch size 1), got shape {tuple(x.shape)}")
    d = x.shape[-1]
    if d % 2 or d & (d - 1):
        raise NotImplementedError(f"head_dim must be an even power of two for the quantize kernels, got {d}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in the last dimension")
    runtime.require(x)


@runtime.on_input_device
def quantize_keys(keys: torch.Tensor, group_size: int) -> QuantizedTensor:
    """Keys ``[1, H, T, D]`` (T a multiple of ``group_size``), per channel over groups of tokens -> codes
    ``[1, H, T, D/2]`` uint8, scale/zero ``[1, H, T/group_size, D]`` in the keys' dtype."""
    _check(keys, "keys")
    _, h, t, d = keys.shape
    if t % group_size:
        raise ValueError(f"key length {t} is not a multiple of group_size={group_size}")
    from . import _quantize_triton as tk

    upper = torch.empty(1, h, t, d // 2, dtype=torch.uint8, device=keys.device)
    lower = torch.empty_like(upper)
    scale = torch.empty(1, h, t // group_size, d, dtype=keys.dtype, device=keys.device)
    zero = torch.empty_like(scale)
    if t:
        block_c = min(d // 2, 16)
        block_g = 1 << max(0, (group_size - 1).bit_length())
        tk.quantize_keys_kernel[(h, t // group_size, d // 2 // block_c)](
            keys, keys.stride(1), keys.stride(2), upper, lower, upper.stride(1), upper.stride(2),
            scale, zero, scale.stride(1), scale.stride(2), group_size,
            BLOCK_G=block_g, BLOCK_C=block_c, **_type_args(keys.dtype), num_warps=4, **runtime.LAUNCH_OPTIONS,
        )
    return QuantizedTensor(upper, lower, scale, zero)


@runtime.on_input_device
def quantize_values(values: torch.Tensor) -> QuantizedTensor:
    """Values ``[1, H, T, D]`` per token -> codes ``[1, H, T, D/2]`` uint8, scale/zero ``[1, H, T, 1]``."""
    _check(values, "values")
    _, h, t, d = values.shape
    from . import _quantize_triton as tk

    upper = torch.empty(1, h, t, d // 2, dtype=torch.uint8, device=values.device)
    lower = torch.empty_like(upper)
    scale = torch.empty(1, h, t, 1, dtype=values.dtype, device=values.device)
    zero = torch.empty_like(scale)
    if t:
        block_t = 32
        tk.quantize_values_kernel[(h, -(-t // block_t))](
            values, values.stride(1), values.stride(2), upper, lower, upper.stride(1), upper.stride(2),
            scale, zero, scale.stride(1), scale.stride(2), t,
            HALF=d // 2, BLOCK_T=block_t, **_type_args(values.dtype), num_warps=4, **runtime.LAUNCH_OPTIONS,
        )
    return QuantizedTensor(upper, lower, scale, zero)


def _kernel_ok(x: torch.Tensor) -> bool:
    d = x.shape[-1]
    return (
        runtime.enabled(x.device)
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and x.dim() == 4
        and x.shape[0] == 1
        and d >= 2
        and not d & (d - 1)
        and x.stride(-1) == 1
    )


def quantize_keys_auto(keys: torch.Tensor, group_size: int) -> QuantizedTensor:
    """The kernel where it runs (see :func:`runtime.enabled`), else the reference."""
    return quantize_keys(keys, group_size) if _kernel_ok(keys) else quantize_keys_reference(keys, group_size)


def quantize_values_auto(values: torch.Tensor) -> QuantizedTensor:
    """The kernel where it runs (see :func:`runtime.enabled`), else the reference."""
    return quantize_values(values) if _kernel_ok(values) else quantize_values_reference(values)
