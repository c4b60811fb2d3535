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


def _outputs(x: torch.Tensor, scale_rows: int, scale_width: int, out: QuantizedTensor | None) -> QuantizedTensor:
    """Where the kernel writes: ``out`` (views into a store: codes ``[1, H, T, D/2]``, scale/zero ``[1, H,
    scale_rows, scale_width]``, channels contiguous, each pair with one layout) checked, else fresh tensors."""
    _, h, t, d = x.shape
    codes, params = (1, h, t, d // 2), (1, h, scale_rows, scale_width)
    if out is None:
        upper = torch.empty(codes, dtype=torch.uint8, device=x.device)
        scale = torch.empty(params, dtype=x.dtype, device=x.device)
        return QuantizedTensor(upper, torch.empty_like(upper), scale, torch.empty_like(scale))
    if (out.upper.shape != codes or out.lower.shape != codes or out.scale.shape != params
            or out.zero.shape != params or out.upper.dtype != torch.uint8 or out.lower.dtype != torch.uint8
            or out.scale.dtype != x.dtype or out.zero.dtype != x.dtype):
        raise ValueError(f"out must hold uint8 codes {codes} and {x.dtype} scales {params}")
    if (out.upper.stride() != out.lower.stride() or out.scale.stride() != out.zero.stride()
            or out.upper.stride(-1) != 1 or out.scale.stride(-1) != 1):
        raise ValueError("out's codes (and its scales) must share one layout, contiguous in the last dimension")
    return out


@runtime.on_input_device
def quantize_keys(keys: torch.Tensor, group_size: int, out: QuantizedTensor | None = None) -> QuantizedTensor:
    """Keys ``[1, H, T, D]`` (T a multiple of ``group_size``), per channel over groups of tokens -> codes
    ``[1, H, T, D/2]`` uint8, scale/zero ``[1, H, T/group_size, D]`` in the keys' dtype; written into ``out`` where
    given (e.g. a store's slots: no copy)."""
    _check(keys, "keys")
    _, h, t, d = keys.shape
    if t % group_size:
        raise ValueError(f"key length {t} is not a multiple of group_size={group_size}")
    from . import _quantize_triton as tk

    codes = _outputs(keys, t // group_size, d, out)
    upper, lower, scale, zero = codes.upper, codes.lower, codes.scale, codes.zero
    if t:
        block_c = min(d // 2, 16)
        block_g = 1 << max(0, (group_size - 1).bit_length())
        tk.quantize_keys_kernel[(h, t // group_size, d // 2 // block_c)](
            keys, keys.stride(1), keys.stride(2), upper, lower, upper.stride(1), upper.stride(2),
            scale, zero, scale.stride(1), scale.stride(2), group_size,
            BLOCK_G=block_g, BLOCK_C=block_c, **_type_args(keys.dtype), num_warps=4, **runtime.LAUNCH_OPTIONS,
        )
    return codes


@runtime.on_input_device
def quantize_values(values: torch.Tensor, out: QuantizedTensor | None = None) -> QuantizedTensor:
    """Values ``[1, H, T, D]`` per token -> codes ``[1, H, T, D/2]`` uint8, scale/zero ``[1, H, T, 1]``; written into
    ``out`` where given."""
    _check(values, "values")
    _, h, t, d = values.shape
    from . import _quantize_triton as tk

    codes = _outputs(values, t, 1, out)
    upper, lower, scale, zero = codes.upper, codes.lower, codes.scale, codes.zero
    if t:
        block_t = 32
        tk.quantize_values_kernel[(h, -(-t // block_t))](
            values, values.stride(1), values.stride(2), upper, lower, upper.stride(1), upper.stride(2),
            scale, zero, scale.stride(1), scale.stride(2), t,
            HALF=d // 2, BLOCK_T=block_t, **_type_args(values.dtype), num_warps=4, **runtime.LAUNCH_OPTIONS,
        )
    return codes


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


def _into(fresh: QuantizedTensor, out: QuantizedTensor | None) -> QuantizedTensor:
    if out is None:
        return fresh
    for name in ("upper", "lower", "scale", "zero"):
        getattr(out, name).copy_(getattr(fresh, name))
    return out


def quantize_keys_auto(keys: torch.Tensor, group_size: int, out: QuantizedTensor | None = None) -> QuantizedTensor:
    """The kernel where it runs (see :func:`runtime.enabled`), else the reference; into ``out`` where given."""
    if _kernel_ok(keys):
        return quantize_keys(keys, group_size, out)
    return _into(quantize_keys_reference(keys, group_size), out)


def quantize_values_auto(values: torch.Tensor, out: QuantizedTensor | None = None) -> QuantizedTensor:
    """The kernel where it runs (see :func:`runtime.enabled`), else the reference; into ``out`` where given."""
    if _kernel_ok(values):
        return quantize_values(values, out)
    return _into(quantize_values_reference(values), out)
