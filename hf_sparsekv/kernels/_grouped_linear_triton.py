"""Triton source of :mod:`hf_sparsekv.kernels.grouped_linear` (which documents and launches it). Imported lazily."""

import triton
import triton.language as tl


@triton.jit
def _dot_columns(X, W, W2, col_block, M, K, N, stride_xm, PAIR: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, WIDEN: tl.constexpr):
    """``(X @ W[cols].T, X @ W2[cols].T)`` in float32 ``[BLOCK_M, BLOCK_N]`` (``[1, BLOCK_N]`` for one row) for the
    ``BLOCK_N`` columns of block ``col_block``, over all of K; ``PAIR`` False: W2 is not read (the second value is
    the first). The pair's tiles load in the same iterations, so their memory latencies overlap. One row
    (BLOCK_M == 1): products accumulated per input channel, one reduction at the end. Several rows: tensor cores, the
    rows padded to BLOCK_M."""
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    offsets = cols[:, None].to(tl.int64) * K + ks[None, :]
    w_ptrs = W + offsets
    w2_ptrs = W2 + offsets
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w_ok = col_ok[:, None]
                x = tl.load(X + k0 + ks)
            else:
                k_ok = k0 + ks < K
                w_ok = col_ok[:, None] & k_ok[None, :]
                x = tl.load(X + k0 + ks, mask=k_ok, other=0.0)
            w = tl.load(w_ptrs, mask=w_ok, other=0.0, eviction_policy="evict_first")
            if PAIR:
                w2 = tl.load(w2_ptrs, mask=w_ok, other=0.0, eviction_policy="evict_first")
                acc2 += w2.to(tl.float32) * x.to(tl.float32)[None, :]
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
            w2_ptrs += BLOCK_K
        out = tl.sum(acc, axis=1)[None, :]
        out2 = tl.sum(acc2, axis=1)[None, :] if PAIR else out
    else:
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        x_ptrs = X + rows[:, None] * stride_xm + ks[None, :]
        out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        out2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w_ok = col_ok[:, None]
                x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                k_ok = k0 + ks < K
                w_ok = col_ok[:, None] & k_ok[None, :]
                x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=w_ok, other=0.0, eviction_policy="evict_first")
            if PAIR:
                w2 = tl.load(w2_ptrs, mask=w_ok, other=0.0, eviction_policy="evict_first")
            if WIDEN:  # the interpreter's bfloat16 dot is wrong (Triton 3.6): float32 operands, tests only
                out = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), out, input_precision="ieee")
                if PAIR:
                    out2 = tl.dot(x.to(tl.float32), tl.trans(w2.to(tl.float32)), out2, input_precision="ieee")
            else:
                out = tl.dot(x, tl.trans(w), out)
                if PAIR:
                    out2 = tl.dot(x, tl.trans(w2), out2)
            w_ptrs += BLOCK_K
            w2_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if not PAIR:
            out2 = out
    return out, out2


@triton.jit
def _store_columns(Y, out, col_block, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``Y[:, cols] = out`` (``out`` as :func:`_dot_columns` returns it), in Y's dtype."""
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    y_ptrs = Y + rows[:, None] * N + cols[None, :]
    tl.store(y_ptrs, out.to(Y.dtype.element_ty), mask=(rows[:, None] < M) & (cols < N)[None, :])


@triton.jit
def _columns(X, W, B, Y, col_block, M, K, N, stride_xm,
             HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             EVEN_K: tl.constexpr, WIDEN: tl.constexpr):
    """``Y[:, cols] = X @ W[cols].T (+ B[cols])`` for the ``BLOCK_N`` columns of block ``col_block``."""
    out, _ = _dot_columns(X, W, W, col_block, M, K, N, stride_xm, False, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, WIDEN)
    if HAS_BIAS:
        cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        out += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    _store_columns(Y, out, col_block, M, N, BLOCK_M, BLOCK_N)


@triton.jit
def grouped_linear_kernel(
    X, W0, W1, W2, B0, B1, B2, Y0, Y1, Y2, M, K, N0, N1, N2, stride_xm,
    NB0, NB1, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, WIDEN: tl.constexpr,
):
    """Programs ``[0, NB0)`` compute weight 0's columns, the next ``NB1`` weight 1's, the rest weight 2's."""
    pid = tl.program_id(0)
    if pid < NB0:
        _columns(X, W0, B0, Y0, pid, M, K, N0, stride_xm, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, WIDEN)
    elif pid < NB0 + NB1:
        _columns(X, W1, B1, Y1, pid - NB0, M, K, N1, stride_xm, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, WIDEN)
    else:
        _columns(X, W2, B2, Y2, pid - NB0 - NB1, M, K, N2, stride_xm, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, WIDEN)


@triton.jit
def gated_linear_kernel(X, WG, WU, Y, M, K, N, stride_xm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, WIDEN: tl.constexpr):
    """``Y[:, cols] = silu(g) * u`` with ``g = X @ WG[cols].T`` and ``u = X @ WU[cols].T``, each rounded to Y's dtype
    first (as the separate projections store them), the product formed in float32 and rounded once."""
    col_block = tl.program_id(0)
    g, u = _dot_columns(X, WG, WU, col_block, M, K, N, stride_xm, True, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, WIDEN)
    g = g.to(Y.dtype.element_ty).to(tl.float32)
    u = u.to(Y.dtype.element_ty).to(tl.float32)
    _store_columns(Y, g * tl.sigmoid(g) * u, col_block, M, N, BLOCK_M, BLOCK_N)
