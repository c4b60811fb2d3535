"""Triton source of the masked speculative-block attention + log-sum-exp merge (launched and documented by
:mod:`hf_sparsekv.kernels.verify_attention`). Imported lazily (imports Triton, reads ``TRITON_INTERPRET``)."""

import triton
import triton.language as tl


@triton.jit
def block_merge_kernel(
    Q, stride_qh, stride_ql,
    K, V, stride_kh, stride_kn, stride_vh, stride_vn, P,
    PO, stride_pol, stride_poh, PL, stride_plh, stride_pll,
    MASK, stride_ml,
    O, stride_ol, stride_oh,
    scale_log2, L,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_PREFIX: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PREC: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """One program per KV head: its GROUP·L query rows against the L block keys (tokens P..P+L-1), masked, then
    merged with the prefix result (output PO and natural-log LSE PL, per query head and token)."""
    kvh = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * L
    qi = rows % L
    q_head = kvh * GROUP + rows // L
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    n_ok = n < L
    q = tl.load(Q + q_head[:, None] * stride_qh + qi[:, None] * stride_ql + d[None, :], mask=row_ok[:, None], other=0.0)
    k = tl.load(K + kvh * stride_kh + (P + n)[:, None] * stride_kn + d[None, :], mask=n_ok[:, None], other=0.0)
    v = tl.load(V + kvh * stride_vh + (P + n)[:, None] * stride_vn + d[None, :], mask=n_ok[:, None], other=0.0)
    s = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PREC) * scale_log2
    if HAS_MASK:
        allowed = tl.load(MASK + qi[:, None] * stride_ml + n[None, :], mask=row_ok[:, None] & n_ok[None, :], other=0) != 0
    else:
        allowed = n[None, :] <= qi[:, None]
    allowed = allowed & n_ok[None, :]
    s = tl.where(allowed, s, float("-inf"))
    m_b = tl.maximum(tl.max(s, 1), -1.0e30)
    p = tl.exp2(s - m_b[:, None])
    l_b = tl.sum(p, 1)
    acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PREC)
    has_b = l_b > 0
    lse_b = tl.where(has_b, m_b + tl.log2(tl.where(has_b, l_b, 1.0)), float("-inf"))
    o_b = acc / tl.where(has_b, l_b, 1.0)[:, None]
    if HAS_PREFIX:
        lse_p = tl.load(PL + q_head * stride_plh + qi * stride_pll, mask=row_ok, other=0.0) * 1.4426950408889634
        o_p = tl.load(PO + qi[:, None] * stride_pol + q_head[:, None] * stride_poh + d[None, :],
                      mask=row_ok[:, None], other=0.0).to(tl.float32)
        m = tl.maximum(tl.maximum(lse_p, lse_b), -1.0e30)
        w_p = tl.exp2(lse_p - m)
        w_b = tl.exp2(lse_b - m)
        out = (o_p * w_p[:, None] + o_b * w_b[:, None]) / (w_p + w_b)[:, None]
    else:
        out = o_b
    tl.store(O + qi[:, None] * stride_ol + q_head[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None])
