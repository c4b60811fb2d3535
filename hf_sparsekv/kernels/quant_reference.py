"""Hierarchical INT4/INT8 quantization (QuantSpec §4.2), PyTorch reference.

A group of values ``x`` (reduced over ``dim``) is stored as

* upper codes ``cu ∈ [0, 15]`` with an asymmetric scale ``s`` and zero point ``z``:
  ``x ≈ z + s·cu``  (the INT4 view, error ≤ s/2);
* lower codes ``cl ∈ [-7, 7]`` quantizing the residual symmetrically with scale ``s/14``:
  ``x ≈ z + s·cu + (s/14)·cl``  (the INT8 view, error ≤ s/28).

``s`` and ``z`` are stored in the input's dtype, rounded outwards (``z`` down, ``s`` up) so that the bounds
above hold for the stored values exactly (up to float32 arithmetic). Codes are packed two per byte along the
last dimension: byte = even | odd << 4 (lower codes are stored offset by 8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

UPPER_LEVELS = 15  # codes 0..15
LOWER_DIVISOR = 14  # lower scale = s / 14, codes -7..7
LOWER_OFFSET = 8


@dataclass
class QuantizedTensor:
    """Packed hierarchical codes and their per-group parameters.

    ``upper``/``lower``: uint8 ``[..., D/2]``; ``scale``/``zero``: broadcastable to the unpacked ``[..., D]``
    after the caller's group reshape (see :func:`quantize_keys` / :func:`quantize_values`).
    """

    upper: torch.Tensor
    lower: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def kernel_args(self) -> tuple:
        """The decode kernels' arguments for these codes (the Triton split kernel's and the Gluon one's, in this
        order): upper, lower, their head and token strides, scale, zero, their head and group strides."""
        return (self.upper, self.lower, self.upper.stride(1), self.upper.stride(2), self.scale, self.zero,
                self.scale.stride(1), self.scale.stride(2))

    def float32(self) -> QuantizedTensor:
        """The same codes with float32 scales and zeros (the float32 reference's parameters)."""
        return QuantizedTensor(self.upper, self.lower, self.scale.float(), self.zero.float())


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` integer codes in 0..15 -> ``[..., D/2]`` uint8 (D even)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"last dimension must be even to pack two codes per byte, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[..., D/2]`` uint8 -> ``[..., D]`` uint8 codes in 0..15."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def _outward_params(x: torch.Tensor, dim: int, store_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero point (rounded down) and scale (rounded up) in ``store_dtype`` so that z + 15·s >= max."""
    xf = x.float()
    mn = xf.amin(dim=dim, keepdim=True)
    mx = xf.amax(dim=dim, keepdim=True)
    z = mn.to(store_dtype)
    z = torch.where(z.float() > mn, torch.nextafter(z, torch.full_like(z, float("-inf"))), z)
    s = ((mx - z.float()) / UPPER_LEVELS).to(store_dtype)
    s = torch.where(z.float() + UPPER_LEVELS * s.float() < mx, torch.nextafter(s, torch.full_like(s, float("inf"))), s)
    s = torch.where(s > 0, s, torch.ones_like(s))  # constant group: any scale is exact
    return s, z


def _quantize(x: torch.Tensor, dim: int) -> QuantizedTensor:
    s, z = _outward_params(x, dim, x.dtype)
    sf, zf = s.float(), z.float()
    xf = x.float()
    cu = torch.clamp(torch.round((xf - zf) / sf), 0, UPPER_LEVELS)
    residual = xf - (zf + sf * cu)
    cl = torch.clamp(torch.round(residual * LOWER_DIVISOR / sf), -7, 7)
    return QuantizedTensor(pack_nibbles(cu), pack_nibbles(cl + LOWER_OFFSET), s, z)


def _dequantize(q: QuantizedTensor, int8: bool) -> torch.Tensor:
    """Unpacked float32 values ``[..., D]`` (scale/zero already broadcastable)."""
    x = q.zero.float() + q.scale.float() * unpack_nibbles(q.upper).float()
    if int8:
        cl = unpack_nibbles(q.lower).float() - LOWER_OFFSET
        x = x + q.scale.float() / LOWER_DIVISOR * cl
    return x


def quantize_keys(keys: torch.Tensor, group_size: int) -> QuantizedTensor:
    """Keys ``[B, H, T, D]`` (T a multiple of ``group_size``), quantized per channel over groups of tokens.

    Returns codes ``[B, H, T, D/2]`` and scale/zero ``[B, H, T/group_size, D]``.
    """
    b, h, t, d = keys.shape
    if t % group_size:
        raise ValueError(f"key length {t} is not a multiple of group_size={group_size}")
    grouped = keys.reshape(b, h, t // group_size, group_size, d)
    q = _quantize(grouped, dim=-2)
    return QuantizedTensor(
        q.upper.reshape(b, h, t, d // 2),
        q.lower.reshape(b, h, t, d // 2),
        q.scale.squeeze(-2),
        q.zero.squeeze(-2),
    )


def dequantize_keys(q: QuantizedTensor, group_size: int, int8: bool, dtype: torch.dtype) -> torch.Tensor:
    b, h, t, half = q.upper.shape
    g = t // group_size
    grouped = QuantizedTensor(
        q.upper.reshape(b, h, g, group_size, half),
        q.lower.reshape(b, h, g, group_size, half),
        q.scale.unsqueeze(-2),
        q.zero.unsqueeze(-2),
    )
    return _dequantize(grouped, int8).reshape(b, h, t, 2 * half).to(dtype)


def quantize_values(values: torch.Tensor) -> QuantizedTensor:
    """Values ``[B, H, T, D]`` quantized per token (one group = one head vector).

    Returns codes ``[B, H, T, D/2]`` and scale/zero ``[B, H, T, 1]``.
    """
    return _quantize(values, dim=-1)


def dequantize_values(q: QuantizedTensor, int8: bool, dtype: torch.dtype) -> torch.Tensor:
    return _dequantize(q, int8).to(dtype)
