"""4-bit weight-only linear layers (QuantSpec's draft weights): a weight ``[N, K]`` quantized per output row in groups
of ``G`` input channels, asymmetric, as ``w ≈ (q - 8) · scale + zero`` with codes ``q`` in 0..15 (the convention of
PyTorch's tinygemm kernel, ``aten._weight_int4pack_mm``).

* :func:`quantize_w4` -> :class:`W4Weight` (codes, scales, zeros; the scales and zeros in the model's dtype);
* :func:`dequantize_w4`: the reference — the weight the codes stand for;
* :func:`w4_linear`: ``x @ w.T`` on the 4-bit weight: on CUDA tinygemm (bfloat16 activations; one kernel that reads
  the packed codes), elsewhere ``x`` times the dequantized weight (the reference, which the CPU tests run).

tinygemm needs ``K`` a multiple of ``16 · inner_k_tiles`` (2, 4 or 8) and of ``G`` (32, 64, 128 or 256) and ``N`` a
multiple of 8; :func:`w4_shape_ok` says whether a layer qualifies (others keep their full-precision weight).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZES = (128, 64, 32)  # the largest that divides K is used


@dataclass
class W4Weight:
    """A weight ``[N, K]`` in 4 bits: ``codes [N, K]`` uint8 (0..15; on CUDA replaced by tinygemm's packed layout),
    ``scales``/``zeros [N, K/G]``; ``packed`` and ``scales_and_zeros [K/G, N, 2]`` bfloat16 for tinygemm."""

    shape: tuple[int, int]
    group: int
    codes: torch.Tensor | None
    scales: torch.Tensor
    zeros: torch.Tensor
    packed: torch.Tensor | None = None
    scales_and_zeros: torch.Tensor | None = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros, self.packed,
                                                          self.scales_and_zeros) if t is not None)


def w4_group(k: int) -> int | None:
    return next((g for g in GROUP_SIZES if k % g == 0), None)


def _inner_k_tiles(k: int) -> int | None:
    return next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)


def w4_shape_ok(n: int, k: int) -> bool:
    """Whether tinygemm takes a weight ``[n, k]``."""
    return n % 8 == 0 and w4_group(k) is not None and _inner_k_tiles(k) is not None


def quantize_w4(weight: torch.Tensor, pack: bool) -> W4Weight:
    """``weight [N, K]`` -> :class:`W4Weight` (group ``w4_group(K)``). ``pack``: also tinygemm's layout (CUDA), and
    the plain codes are dropped (the packed ones replace them)."""
    n, k = weight.shape
    group = w4_group(k)
    if group is None:
        raise ValueError(f"no 4-bit group size divides {k} input channels")
    w = weight.detach().float().reshape(n, k // group, group)
    low, high = w.amin(-1), w.amax(-1)
    scales = ((high - low).clamp_min(1e-6) / 15).to(weight.dtype)
    zeros = (low + 8 * scales.float()).to(weight.dtype)  # stored as they are read: in the model's dtype
    codes = ((w - low[..., None]) / scales.float()[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(n, k)
    out = W4Weight((n, k), group, codes, scales, zeros)
    if pack:
        pairs = (codes[:, ::2].int() << 4 | codes[:, 1::2].int()).to(torch.uint8)
        out.packed = torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), _inner_k_tiles(k))
        out.scales_and_zeros = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        out.codes = None
    return out


def dequantize_w4(w4: W4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The reference: the weight ``[N, K]`` the codes stand for, ``(q - 8) · scale + zero`` in float32, as ``dtype``."""
    n, k = w4.shape
    codes = w4.codes.float().reshape(n, k // w4.group, w4.group)
    return ((codes - 8) * w4.scales.float()[..., None] + w4.zeros.float()[..., None]).reshape(n, k).to(dtype)


def w4_linear(x: torch.Tensor, w4: W4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ w.T (+ bias)`` -> ``[..., N]`` in ``x``'s dtype, on the 4-bit weight (see the module
    docstring)."""
    if w4.packed is None:
        out = x @ dequantize_w4(w4, x.dtype).T
    else:
        flat = x.reshape(-1, w4.shape[1]).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm(flat, w4.packed, w4.group, w4.scales_and_zeros)
        out = out.to(x.dtype).reshape(*x.shape[:-1], w4.shape[0])
    return out if bias is None else out + bias
