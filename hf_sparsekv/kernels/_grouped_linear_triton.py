"""Triton source of :mod:`hf_sparsekv.kernels.grouped_linear`, :mod:`.gated_linear` and :mod:`.normed_linear` (which
document and launch them). Imported lazily.

Every kernel reads its input rows ``X [M, K]`` (row stride ``stride_xm``) through :func:`_x_tile`: as they are, or
(``NORM``) as an RMSNorm's output ``NW ⊙ round(h / rms(h))`` of ``h = X`` or (``ADD``) ``h = round(X + D)``, each program
computing the rows' ``1 / rms`` first (:func:`_row_scale`; program 0 also writes ``h`` to ``HS [M, K]`` when ``ADD``).
Rounding follows the model's eager code: the sum, the normalised rows and their product with ``NW`` each rounded to
X's dtype; squares summed in float32."""

import triton
import triton.language as tl


@triton.jit
def _row_scale(X, D, HS, M, K, stride_xm, eps, pid, ADD: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """``1 / sqrt(mean(h²) + eps)`` per row of ``h = X (+ D)``, float32 ``[BLOCK_M, 1]``; with ``ADD``, program
    ``pid`` 0 stores ``h`` to ``HS``."""
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    squares = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask = row_ok[:, None] & (k0 + ks < K)[None, :]
        offsets = rows[:, None] * stride_xm + (k0 + ks)[None, :]
        h = tl.load(X + offsets, mask=mask, other=0.0)
        if ADD:
            h = (h.to(tl.float32) + tl.load(D + offsets, mask=mask, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
            if pid == 0:
                tl.store(HS + rows[:, None] * K + (k0 + ks)[None, :], h, mask=mask)
        h = h.to(tl.float32)
        squares += h * h
    return tl.rsqrt(tl.sum(squares, axis=1) / K + eps)[:, None]


@triton.jit
def _x_tile(X, D, NW, scale, rows, row_ok, k0, ks, K, stride_xm, NORM: tl.constexpr, ADD: tl.constexpr,
            EVEN_K: tl.constexpr):
    """The input rows' ``[BLOCK_M, BLOCK_K]`` tile at ``k0`` (see the module docstring), X's dtype."""
    k_ok = k0 + ks < K
    mask = row_ok[:, None] if EVEN_K else row_ok[:, None] & k_ok[None, :]
    offsets = rows[:, None] * stride_xm + (k0 + ks)[None, :]
    x = tl.load(X + offsets, mask=mask, other=0.0)
    if NORM:
        dt = X.dtype.element_ty
        if ADD:
            x = (x.to(tl.float32) + tl.load(D + offsets, mask=mask, other=0.0).to(tl.float32)).to(dt)
        x = (x.to(tl.float32) * scale).to(dt)
        nw = tl.load(NW + k0 + ks, mask=k_ok, other=0.0)
        x = (nw.to(tl.float32)[None, :] * x.to(tl.float32)).to(dt)
    return x


@triton.jit
def _dot_columns(X, D, NW, scale, W, W2, col_block, M, K, N, stride_xm, PAIR: tl.constexpr, NORM: tl.constexpr,
                 ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, WIDEN: tl.constexpr):
    """``(x @ W[cols].T, x @ W2[cols].T)`` in float32 ``[BLOCK_M, BLOCK_N]`` (``[1, BLOCK_N]`` for one row) for the
    ``BLOCK_N`` columns of block ``col_block``, over all of K, ``x`` the input rows (:func:`_x_tile`); ``PAIR``
    False: W2 is not read (the second value is the first). The pair's tiles load in the same iterations, so their
    memory latencies overlap. One row (BLOCK_M == 1): products accumulated per input channel, one reduction at the
    end. Several rows: tensor cores, the rows padded to BLOCK_M."""
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    offsets = cols[:, None].to(tl.int64) * K + ks[None, :]
    w_ptrs = W + offsets
    w2_ptrs = W2 + offsets
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_ok = col_ok[:, None] if EVEN_K else col_ok[:, None] & (k0 + ks < K)[None, :]
        x = _x_tile(X, D, NW, scale, rows, row_ok, k0, ks, K, stride_xm, NORM, ADD, EVEN_K)
        w = tl.load(w_ptrs, mask=w_ok, other=0.0, eviction_policy="evict_first")
        if PAIR:
            w2 = tl.load(w2_ptrs, mask=w_ok, other=0.0, eviction_policy="evict_first")
        if BLOCK_M == 1:
            acc += w.to(tl.float32) * x.to(tl.float32)
            if PAIR:
                acc2 += w2.to(tl.float32) * x.to(tl.float32)
        elif WIDEN:  # the interpreter's bfloat16 dot is wrong (Triton 3.6): float32 operands, tests only
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            if PAIR:
                acc2 = tl.dot(x.to(tl.float32), tl.trans(w2.to(tl.float32)), acc2, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
            if PAIR:
                acc2 = tl.dot(x, tl.trans(w2), acc2)
        w_ptrs += BLOCK_K
        w2_ptrs += BLOCK_K
    if BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[None, :]
        out2 = tl.sum(acc2, axis=1)[None, :] if PAIR else out
    else:
        out = acc
        out2 = acc2 if PAIR else acc
    return out, out2


@triton.jit
def _store_columns(Y, out, col_block, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``Y[:, cols] = out`` (``out`` as :func:`_dot_columns` returns it), in Y's dtype."""
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    y_ptrs = Y + rows[:, None] * N + cols[None, :]
    tl.store(y_ptrs, out.to(Y.dtype.element_ty), mask=(rows[:, None] < M) & (cols < N)[None, :])


@triton.jit
def _columns(X, D, NW, scale, W, B, Y, col_block, M, K, N, stride_xm, NORM: tl.constexpr, ADD: tl.constexpr,
             HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             EVEN_K: tl.constexpr, WIDEN: tl.constexpr):
    """``Y[:, cols] = x @ W[cols].T (+ B[cols])`` for the ``BLOCK_N`` columns of block ``col_block``."""
    out, _ = _dot_columns(X, D, NW, scale, W, W, col_block, M, K, N, stride_xm, False, NORM, ADD, BLOCK_M, BLOCK_N,
                          BLOCK_K, EVEN_K, WIDEN)
    if HAS_BIAS:
        cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        out += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    _store_columns(Y, out, col_block, M, N, BLOCK_M, BLOCK_N)


@triton.jit
def grouped_linear_kernel(
    X, D, NW, HS, eps, W0, W1, W2, B0, B1, B2, Y0, Y1, Y2, M, K, N0, N1, N2, stride_xm,
    NB0, NB1, NORM: tl.constexpr, ADD: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, WIDEN: tl.constexpr,
):
    """Programs ``[0, NB0)`` compute weight 0's columns, the next ``NB1`` weight 1's, the rest weight 2's."""
    pid = tl.program_id(0)
    scale = 1.0
    if NORM:
        scale = _row_scale(X, D, HS, M, K, stride_xm, eps, pid, ADD, BLOCK_M, BLOCK_K)
    if pid < NB0:
        _columns(X, D, NW, scale, W0, B0, Y0, pid, M, K, N0, stride_xm, NORM, ADD, HAS_BIAS, BLOCK_M, BLOCK_N,
                 BLOCK_K, EVEN_K, WIDEN)
    elif pid < NB0 + NB1:
        _columns(X, D, NW, scale, W1, B1, Y1, pid - NB0, M, K, N1, stride_xm, NORM, ADD, HAS_BIAS, BLOCK_M, BLOCK_N,
                 BLOCK_K, EVEN_K, WIDEN)
    else:
        _columns(X, D, NW, scale, W2, B2, Y2, pid - NB0 - NB1, M, K, N2, stride_xm, NORM, ADD, HAS_BIAS, BLOCK_M,
                 BLOCK_N, BLOCK_K, EVEN_K, WIDEN)


@triton.jit
def gated_linear_kernel(X, D, NW, HS, eps, WG, WU, Y, M, K, N, stride_xm, NORM: tl.constexpr, ADD: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                        WIDEN: tl.constexpr):
    """``Y[:, cols] = silu(g) * u`` with ``g = x @ WG[cols].T`` and ``u = x @ WU[cols].T``, each rounded to Y's dtype
    first (as the separate projections store them), the product formed in float32 and rounded once."""
    col_block = tl.program_id(0)
    scale = 1.0
    if NORM:
        scale = _row_scale(X, D, HS, M, K, stride_xm, eps, col_block, ADD, BLOCK_M, BLOCK_K)
    g, u = _dot_columns(X, D, NW, scale, WG, WU, col_block, M, K, N, stride_xm, True, NORM, ADD, BLOCK_M, BLOCK_N,
                        BLOCK_K, EVEN_K, WIDEN)
    g = g.to(Y.dtype.element_ty).to(tl.float32)
    u = u.to(Y.dtype.element_ty).to(tl.float32)
    _store_columns(Y, g * tl.sigmoid(g) * u, col_block, M, N, BLOCK_M, BLOCK_N)
