"""An RMSNorm (and the residual add before it) computed by the linear layers that read its output: the grouped
(:mod:`.grouped_linear`) or gated (:mod:`.gated_linear`) kernel, for the few rows of a decode or verify step.

A decoder layer (Llama, Qwen2, Mistral) adds each block's output to the residual stream and normalises the sum
before the next projections: in a compiled step that is one more small kernel twice a layer, which writes the
normalised rows for the projections to read. Here every program of the projections' kernel computes the rows' RMS
itself (the rows are ``K`` values each, read again from L2) and normalises its input tiles as it loads them;
program 0 also writes the sum, the residual stream's next value.

* :func:`normed_linear`: the custom operator ``hf_sparsekv::normed_linear`` (what the compiled steps call, see
  :mod:`hf_sparsekv.generation.projection_groups`): the Triton kernels where :func:`.runtime.enabled`, else the
  reference;
* :func:`normed_linear_reference`: the model's own computation (the spec): ``h = x (+ delta)``;
  ``n = w_norm * (h.float() * rsqrt(mean(h.float()²) + eps)).to(dtype)``; then the grouped projections of ``n``
  (or ``silu(n @ w_gate.T) * (n @ w_up.T)``, ``gated``).

Shapes: ``x [..., K]`` (``delta`` the same, or None) with at most :data:`~.grouped_linear.MAX_ROWS` rows,
float16/bfloat16; ``norm_weight [K]``; weights as the grouped (``biases`` there) or gated (two weights, no biases)
kernel takes them. Returns ``[h]`` (only with ``delta``) followed by the projections' outputs ``[..., N_i]`` (gated:
one), all in ``x``'s dtype.
"""

from __future__ import annotations

import torch

from . import gated_linear as gated_kernel
from . import grouped_linear as grouped_kernel
from . import runtime


def kernel_takes(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor,
                 weights: list[torch.Tensor], biases: list[torch.Tensor], gated: bool) -> bool:
    """Whether the Triton kernels compute this call (else the reference does)."""
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype):
        return False
    if norm_weight.shape != (x.shape[-1],) or norm_weight.dtype != x.dtype or not norm_weight.is_contiguous():
        return False
    if gated:
        return len(weights) == 2 and not biases and gated_kernel.kernel_takes(x, *weights)
    return grouped_kernel.kernel_takes(x, weights, biases)


def normed_linear_reference(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                            weights: list[torch.Tensor], biases: list[torch.Tensor], gated: bool) -> list[torch.Tensor]:
    """See the module docstring."""
    h = x if delta is None else x + delta
    h32 = h.to(torch.float32)
    normed = norm_weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if gated:
        outs = [gated_kernel.gated_linear_reference(normed, *weights)]
    else:
        outs = grouped_kernel.grouped_linear_reference(normed, weights, biases)
    return ([h] if delta is not None else []) + [y.contiguous() for y in outs]


@torch.library.custom_op("hf_sparsekv::normed_linear", mutates_args=())
def normed_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weights: list[torch.Tensor], biases: list[torch.Tensor], gated: bool) -> list[torch.Tensor]:
    """See the module docstring."""
    if not (runtime.enabled(x.device) and kernel_takes(x, delta, norm_weight, weights, biases, gated)):
        return normed_linear_reference(x, delta, norm_weight, eps, weights, biases, gated)
    flat = grouped_kernel.rows_of(x)
    rows = None if delta is None else grouped_kernel.rows_of(delta)
    if rows is not None and rows.stride() != flat.stride():
        flat, rows = flat.contiguous(), rows.contiguous()
    total = None if delta is None else torch.empty_like(flat)
    norm = (rows, norm_weight, eps, total)
    if gated:
        outs = [gated_kernel.launch(flat, *weights, norm=norm)]
    else:
        outs = grouped_kernel.launch(flat, weights, biases, norm=norm)
    outs = [y.reshape(*x.shape[:-1], y.shape[-1]) for y in outs]
    return ([total.reshape(x.shape)] if total is not None else []) + outs


@normed_linear.register_fake
def _normed_linear_shape(x, delta, norm_weight, eps, weights, biases, gated):
    outs = [x.new_empty(*x.shape[:-1], weights[0].shape[0])] if gated else \
        [x.new_empty(*x.shape[:-1], w.shape[0]) for w in weights]
    return ([x.new_empty(x.shape)] if delta is not None else []) + outs
