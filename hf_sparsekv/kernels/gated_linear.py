"""A gated MLP's input side in one kernel: ``silu(x @ w_gate.T) * (x @ w_up.T)`` (Llama, Qwen2, Mistral), for the
few rows of a decode or verify step.

At those rows the two projections are reads of their weights, and after them the activation and the product are one
more small kernel that a decode step waits on (on the bundled 12-layer verifier at 16K, one of its ~11 kernels a
layer, about 1 µs plus the gap before it). Here each program computes the same ``BLOCK_N`` columns of both
projections over all of ``K`` (the grouped kernel's column scheme, :mod:`.grouped_linear`) and writes only their
gated product: the gate and up outputs are never written to memory.

* :func:`gated_linear`: the custom operator ``hf_sparsekv::gated_linear`` (what the compiled steps call, see
  :mod:`hf_sparsekv.generation.projection_groups`): the Triton kernel where :func:`.runtime.enabled`, else the
  reference;
* :func:`gated_linear_reference`: ``silu(F.linear(x, w_gate)) * F.linear(x, w_up)`` (the spec; eager PyTorch rounds
  after the activation and after the product, the kernel once, after the product, as Inductor's fused activation
  does: the two differ by the rounding of one bfloat16 operation).

Shapes: ``x [..., K]`` with at most :data:`~.grouped_linear.MAX_ROWS` rows, float16/bfloat16; ``w_gate, w_up
[N, K]`` contiguous, ``x``'s dtype, no bias. Returns ``[..., N]``, contiguous, ``x``'s dtype. Accumulation in
float32; the projections are rounded to ``x``'s dtype before the activation (as stored by separate projections).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import runtime
from .grouped_linear import _sm_count, block_rows, kernel_takes as grouped_takes, launch_config, prologue_args, rows_of


def kernel_takes(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> bool:
    """Whether the Triton kernel computes this call (else the reference does)."""
    return w_gate.shape == w_up.shape and grouped_takes(x, [w_gate, w_up], [])


def gated_linear_reference(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """``silu(x @ w_gate.T) * (x @ w_up.T)`` as eager PyTorch computes it."""
    return F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)


@torch.library.custom_op("hf_sparsekv::gated_linear", mutates_args=())
def gated_linear(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """``silu(x @ w_gate.T) * (x @ w_up.T)`` in one kernel launch; see the module docstring."""
    if runtime.enabled(x.device) and kernel_takes(x, w_gate, w_up):
        return launch(x, w_gate, w_up)
    return gated_linear_reference(x, w_gate, w_up).contiguous()


@gated_linear.register_fake
def _gated_linear_shape(x, w_gate, w_up):
    return x.new_empty(*x.shape[:-1], w_gate.shape[0])


def launch(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
           config: tuple[int, int, int, int] | None = None, norm: tuple | None = None) -> torch.Tensor:
    """The Triton kernel on a call :func:`kernel_takes`; ``config``: ``(BLOCK_N, BLOCK_K, num_warps, num_stages)``
    instead of :func:`~.grouped_linear.launch_config`'s for ``N`` outputs (each program reads both weights' columns
    in the same K tiles); ``norm``: the input rows are an RMSNorm's output (:func:`~.grouped_linear.prologue_args`)."""
    from ._grouped_linear_triton import gated_linear_kernel

    runtime.require(x, w_gate, w_up)
    k, n = x.shape[-1], w_gate.shape[0]
    flat = rows_of(x)
    rows = flat.shape[0]
    out = x.new_empty(rows, n)
    if config is None:
        block_n, block_k, warps, stages = launch_config(rows, k, n, _sm_count(x.device.index or 0))
        if rows == 1:  # two per-channel accumulators of [BLOCK_N, BLOCK_K]: half the grouped kernel's K tile
            block_k //= 2
    else:
        block_n, block_k, warps, stages = config
    prologue, flags = prologue_args(flat, norm)
    runtime.launch(
        gated_linear_kernel, (-(-n // block_n),),
        flat, *prologue, w_gate, w_up, out, rows, k, n, flat.stride(0), **flags,
        BLOCK_M=block_rows(rows), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        WIDEN=x.dtype == torch.bfloat16 and runtime.interpreting(), num_warps=warps, num_stages=stages,
        **runtime.LAUNCH_OPTIONS,
    )
    return out.reshape(*x.shape[:-1], n)
