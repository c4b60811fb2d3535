"""Linear layers that share one input, computed by one kernel: ``y_i = x @ w_i.T (+ b_i)`` for up to three weights
(a layer's q/k/v projections, an MLP's gate/up), for the few rows of a decode or verify step.

At those rows a linear layer is a read of its weight (bandwidth-bound), and cuBLAS runs each small one as a
split-K GEMV plus a reduce kernel. This kernel reads each weight once, in place (nothing is concatenated, so the
model's parameters are untouched), with no reduce pass: each program owns ``BLOCK_N`` output columns of one weight
over the whole of ``K``, and the grid covers the weights one after the other.

* :func:`grouped_linear`: the custom operator ``hf_sparsekv::grouped_linear`` (what the compiled steps call; see
  :mod:`hf_sparsekv.generation.projection_groups`): the Triton kernel where :func:`.runtime.enabled`, else the
  reference;
* :func:`grouped_linear_reference`: ``F.linear`` per weight (the spec);
* :func:`kernel_takes`: the shapes the kernel takes.

Shapes: ``x [..., K]`` with at most :data:`MAX_ROWS` rows (the product of the leading dims), float16/bfloat16;
``weights[i] [N_i, K]`` contiguous, ``x``'s dtype; ``biases`` empty or one ``[N_i]`` per weight. Returns
``[..., N_i]`` per weight, contiguous, ``x``'s dtype. Accumulation in float32.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import runtime
from .decode_core import _block_m

MAX_ROWS = 32  # rows up to which one pass over the weight serves every row (tensor cores pad them to 16 or 32)
MAX_WEIGHTS = 3


def kernel_takes(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> bool:
    """Whether the Triton kernel computes this call (else the reference does)."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    return (
        1 <= len(weights) <= MAX_WEIGHTS
        and x.dtype in (torch.float16, torch.bfloat16)
        and 1 <= rows <= MAX_ROWS
        and k % 16 == 0
        and all(w.dim() == 2 and w.shape[1] == k and w.dtype == x.dtype and w.is_contiguous() for w in weights)
        and (not biases or (len(biases) == len(weights)
                            and all(b.shape == (w.shape[0],) and b.dtype == x.dtype and b.is_contiguous()
                                    for b, w in zip(biases, weights))))
    )


def grouped_linear_reference(x: torch.Tensor, weights: list[torch.Tensor],
                             biases: list[torch.Tensor]) -> list[torch.Tensor]:
    """``[F.linear(x, w_i, b_i)]``."""
    if biases:
        return [F.linear(x, w, b) for w, b in zip(weights, biases)]
    return [F.linear(x, w) for w in weights]


@torch.library.custom_op("hf_sparsekv::grouped_linear", mutates_args=())
def grouped_linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> list[torch.Tensor]:
    """``[x @ w_i.T (+ b_i)]`` in one kernel launch; see the module docstring."""
    if runtime.enabled(x.device) and kernel_takes(x, weights, biases):
        return launch(x, weights, biases)
    return [y.contiguous() for y in grouped_linear_reference(x, weights, biases)]


@grouped_linear.register_fake
def _grouped_linear_shape(x, weights, biases):
    return [x.new_empty(*x.shape[:-1], w.shape[0]) for w in weights]


def launch_config(rows: int, k: int, n_total: int, sm_count: int) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` for ``rows`` rows over weights of ``n_total`` outputs and ``k``
    inputs: the widest column block that still gives every SM a few programs (K is not split, so the programs fill
    the GPU by columns alone). From a sweep on the H100 (``benchmarks/linear_kernels.py --sweep``); for 2-16 rows over
    a small group (:data:`SMALL_GROUP`), 4 pipeline stages (H200, the bundled verifier at 4-6 rows: its down projection
    2.8 against 3.3 µs with 3, the others within 0.2 µs)."""
    stages = 4 if 1 < rows <= 16 and n_total * k <= SMALL_GROUP else 3
    if rows == 1:
        block_n, floor, wanted, block_k, warps = 32, 8, 4 * sm_count, 512, 8
    elif rows <= 16:
        block_n, floor, wanted, block_k, warps = 64, 16, 2 * sm_count, 256, 4
    else:  # 32 padded rows: a shorter K tile
        block_n, floor, wanted, block_k, warps = 64, 16, 2 * sm_count, 128, 4
    while block_n > floor and n_total // block_n < wanted:
        block_n //= 2
    return block_n, block_k, warps, stages


def block_rows(rows: int) -> int:
    """The kernel's row tile: 1 (the FMA route), else the rows padded to a tensor-core tile of 16 or 32."""
    return 1 if rows == 1 else _block_m(rows)


SMALL_WEIGHT = 1 << 18  # elements of a weight whose read is latency-bound: the kernel wins at any row count
SMALL_GROUP = 1 << 19  # elements of a group (or a gated pair's one weight) whose launch settings are the small ones


def worth_it(rows: int, shapes: list[tuple[int, int]]) -> bool:
    """Whether the kernel beats cuBLAS on these weights ``(N, K)``: always for several weights and for one row; for
    one weight and several rows when it is wide (N ≥ 2K, an output projection; H100 sweep at 8B shape: a narrow one,
    an MLP's down projection, gives too few column blocks without splitting K) or small (N·K ≤ :data:`SMALL_WEIGHT`:
    both are launch-bound there; H200, 4-8 rows: the bundled verifier's o / down projections 2.1 / 3.1 µs against
    cuBLAS's 2.6 / 3.3 µs, while Qwen2.5-0.5B's o projection (0.8M elements) ties and Llama-3.2-1B's loses)."""
    n, k = shapes[0]
    return len(shapes) > 1 or rows == 1 or n >= 2 * k or n * k <= SMALL_WEIGHT


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    if not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor],
           config: tuple[int, int, int, int] | None = None, norm: tuple | None = None) -> list[torch.Tensor]:
    """The Triton kernel on a call :func:`kernel_takes`; ``config``: ``(BLOCK_N, BLOCK_K, num_warps, num_stages)``
    instead of :func:`launch_config`'s; ``norm``: the input rows are an RMSNorm's output (:func:`prologue_args`;
    :mod:`.normed_linear` passes it)."""
    from ._grouped_linear_triton import grouped_linear_kernel

    runtime.require(x, *weights)
    k = x.shape[-1]
    flat = rows_of(x)
    rows = flat.shape[0]
    outs = [x.new_empty(rows, w.shape[0]) for w in weights]
    ns = [w.shape[0] for w in weights]
    block_n, block_k, warps, stages = config or launch_config(rows, k, sum(ns), _sm_count(x.device.index or 0))
    blocks = [-(-n // block_n) for n in ns]
    pad = MAX_WEIGHTS - len(weights)
    w3 = list(weights) + [weights[0]] * pad
    o3 = outs + [outs[0]] * pad
    b3 = (list(biases) + [biases[0]] * pad) if biases else w3  # unread without HAS_BIAS
    n3 = ns + [0] * pad
    nb = blocks + [0] * pad
    prologue, flags = prologue_args(flat, norm)
    runtime.launch(
        grouped_linear_kernel, (sum(blocks),),
        flat, *prologue, *w3, *b3, *o3, rows, k, *n3, flat.stride(0),
        NB0=nb[0], NB1=nb[1], **flags, HAS_BIAS=bool(biases), BLOCK_M=block_rows(rows), BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        WIDEN=x.dtype == torch.bfloat16 and runtime.interpreting(), num_warps=warps, num_stages=stages,
        **runtime.LAUNCH_OPTIONS,
    )
    return [o.reshape(*x.shape[:-1], n) for o, n in zip(outs, ns)]


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` as ``[M, K]`` rows with a contiguous last dimension."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def prologue_args(flat: torch.Tensor, norm: tuple | None) -> tuple[tuple, dict]:
    """The kernels' ``(D, NW, HS, eps)`` arguments and ``NORM``/``ADD`` flags for ``norm`` = ``(delta [M, K] or
    None, norm weight [K], eps, sum output [M, K] or None)`` with rows of ``flat``'s strides (None: no norm)."""
    if norm is None:
        return (flat, flat, flat, 0.0), dict(NORM=False, ADD=False)
    delta, weight, eps, total = norm
    if delta is not None and delta.stride() != flat.stride():
        raise ValueError("the residual's rows must have the input rows' strides")
    return ((flat if delta is None else delta), weight, (flat if total is None else total), float(eps)), \
        dict(NORM=True, ADD=delta is not None)
