"""Tensor-core kernel for the quantized segment, written in Gluon (Triton's explicit-layout dialect), and its index
maps. :func:`~hf_sparsekv.kernels.decode_core.launch_decode` runs it for the quantized splits where
:func:`usable` says so, the Triton split kernel for the full-precision splits, and merges both by log-sum-exp.

Why Gluon: the Triton kernel's GQA path moved each code tile through shared memory into the MMA's operand layout
and padded 4 query rows to 16 MMA rows. Here one warp per program loads the code bytes with 16-byte (keys) and
8-byte (values) vectors straight into the registers the MMA reads, turns them into half-precision operands with a
few bit operations (``_quant_gluon``'s PTX), and puts tokens on the MMA's M side and query rows on its N side
(8 rows per program). That needs two fixed permutations:

* **keys**: operand column ``kappa`` holds stored channel :func:`key_channel` ``(kappa)``; the query side (``q ⊙ s``,
  a few registers per key group) is loaded in stored order and permuted the same way;
* **values**: operand row ``mu`` (and the output row) holds stored channel :func:`value_channel` ``(mu)``; the output
  is written back through it.

Both are bit permutations of the index, fixed by which bytes a lane loads and by the register pairs the MMA
operand layout asks for. ``tests/test_quant_gluon.py`` checks them against an emulation of the kernel's register
moves on CPU; the CUDA tests check the kernel against the float32 reference.
"""

from __future__ import annotations

import logging
import math

import torch

from . import runtime

logger = logging.getLogger(__name__)

ROWS = 8  # query rows per program (the MMA's N side); more rows run as more programs of the same split, of 8 or 16
# rows (decode_core.gluon_settings: 16 shares each block's code conversion between twice the rows)
BLOCK = 64  # tokens per MMA tile (the M side)


def key_channel(kappa: torch.Tensor | int, head_dim: int):
    """Stored channel of key-operand column ``kappa``: lane ``c`` of a token's 4 loads holds bytes
    ``[c·D/8, (c+1)·D/8)``; in its word ``w`` the PTX pairs bytes (0, 2) and (1, 3), so column
    ``32w + 16a + 8h + 2c + e`` (``e`` the pair's half, ``a`` the pair, ``h`` the nibble) is channel
    ``2·(c·D/8 + 4w + 2e + a) + h``."""
    e, c, h, a, w = kappa % 2, (kappa // 2) % 4, (kappa // 8) % 2, (kappa // 16) % 2, kappa // 32
    return 2 * (c * (head_dim // 8) + 4 * w + 2 * e + a) + h


def value_channel(mu: torch.Tensor | int, head_dim: int):
    """Stored channel of value-operand (and output) row ``mu``: lane row ``r = mu % 8`` loads channels
    ``[r·D/8, (r+1)·D/8)``, and the MMA operand layout puts its ``x``-th at row ``8x + r``."""
    return (head_dim // 8) * (mu % 8) + mu // 8


def usable(query: torch.Tensor, head_dim: int, group_size: int) -> bool:
    """Whether the Gluon kernel runs this launch: an NVIDIA GPU of compute capability 8.0 or newer (``mma.sync``),
    float16/bfloat16, head_dim 64 or 128, key groups a multiple of :data:`BLOCK`, and Gluon importable."""
    if query.device.type != "cuda" or torch.version.hip is not None or runtime.interpreting():
        return False  # (mma.sync and cp.async: NVIDIA only)
    if query.dtype not in (torch.float16, torch.bfloat16) or head_dim not in (64, 128) or group_size % BLOCK:
        return False
    if torch.cuda.get_device_capability(query.device)[0] < 8:
        return False
    return _module() is not None


def _module():
    global _MODULE
    if _MODULE is False:
        try:
            from . import _quant_gluon
            _MODULE = _quant_gluon
        except Exception as err:  # a Triton without Gluon, or with a Gluon API this kernel does not know
            disable(err)
    return _MODULE


_MODULE = False


def disable(err: Exception) -> None:
    """Run every later launch on the Triton kernel (once Gluon failed to import or to compile here), saying why."""
    global _MODULE
    _MODULE = None
    logger.warning("hf_sparsekv: the Gluon quantized-attention kernel is unavailable with this Triton (%s: %s); the "
                   "Triton kernel runs the quantized segment instead", type(err).__name__, str(err).splitlines()[0])


class CompileFailed(RuntimeError):
    """The Gluon kernel did not compile with this Triton; :func:`disable` has been called."""


def launch_quant_splits(q, scaling_log2, quant, group_size, int8, t_q, qsplit, n_qsplits, op, lp, quant_length,
                        row_heads, length, block=BLOCK, stages=3, rows_per_program=ROWS):
    """The quantized splits ``0 .. n_qsplits - 1`` of one decode launch into ``op [Hkv, splits, rows, D]`` /
    ``lp [Hkv, splits, rows]`` (``qsplit``: tokens per split, a multiple of ``group_size``; query rows in programs
    of ``rows_per_program``, 8 or 16). Raises
    :class:`CompileFailed` (after :func:`disable`) where this Triton cannot compile the kernel."""
    from triton.compiler.errors import CompilationError

    try:
        _launch(_module().quant_split_kernel, q, scaling_log2, quant, group_size, int8, t_q, qsplit, n_qsplits, op,
                lp, quant_length, row_heads, length, block, stages, rows_per_program)
    except CompilationError as err:
        disable(err)
        raise CompileFailed(str(err)) from err


def _launch(kern, q, scaling_log2, quant, group_size, int8, t_q, qsplit, n_qsplits, op, lp, quant_length, row_heads,
            length, block, stages, rows_per_program):
    from triton.experimental.gluon import language as gl

    qk, qv = quant
    _, hq, _, d = q.shape
    hkv = qk.upper.shape[1]
    group = hq // hkv
    rows = group * length
    runtime.launch(
        kern, (math.ceil(rows / rows_per_program), n_qsplits, hkv),
        q, q.stride(1), q.stride(2),
        *qk.kernel_args(), *qv.kernel_args(), t_q,
        op, lp, *op.stride()[:3], *lp.stride()[:2],
        scaling_log2, length, qsplit, quant_length if quant_length is not None else op, row_heads,
        GROUP=group, HEAD_DIM=d, N_ROWS=rows_per_program, BLOCK=block, KEY_GROUP=group_size, INT8=int8,
        DT=gl.float16 if q.dtype == torch.float16 else gl.bfloat16, LENGTHS_ON_DEVICE=quant_length is not None,
        STAGES=stages, num_warps=1,
    )
