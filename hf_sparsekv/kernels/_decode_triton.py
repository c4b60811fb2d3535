"""Triton source of the split-KV decode kernels (see :mod:`hf_sparsekv.kernels.decode_core`, which documents them
and launches them). Imported lazily: importing this module imports Triton and decorates the kernels, which reads
``TRITON_INTERPRET`` at that moment."""

import triton
import triton.language as tl


@triton.jit
def _write_rows(
    acc, m_i, l_i, cols, rows, row_ok, q_head, qi, pid_s, kvh,
    OP, LP, stride_oph, stride_ops, stride_opm, stride_lph, stride_lps,
    O, stride_ol, stride_oh,
    FINAL: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if FINAL:
        ptrs = O + qi[:, None] * stride_ol + q_head[:, None] * stride_oh + cols[None, :]
        tl.store(ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    else:
        ptrs = OP + kvh * stride_oph + pid_s * stride_ops + rows[:, None] * stride_opm + cols[None, :]
        tl.store(ptrs, out, mask=row_ok[:, None])
        if WRITE_LSE:
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(LP + kvh * stride_lph + pid_s * stride_lps + rows, lse, mask=row_ok)

@triton.jit
def _softmax_step(s, m_i, l_i):
    """One block's base-2 scores ``s [M, N]`` in the running softmax: ``(p, alpha, m_new, l_new)``, the block's
    weights and the factor the accumulated output is rescaled by."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)

@triton.jit
def _fp_block(
    q, acc, m_i, l_i, k_base, v_base, offs_n, d, stride_kn, stride_vn, scale_log2, visible, n_ok,
    MASKED: tl.constexpr, DOT_PREC: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """One block of keys/values ``offs_n`` folded into the running softmax ``(acc, m_i, l_i)``; MASKED: only the
    keys ``visible [M, N]`` count and only ``n_ok [N]`` are read, else every key of the block is read and seen."""
    dt = DOT_DTYPE
    if MASKED:
        k = tl.load(k_base + offs_n[:, None] * stride_kn + d[None, :], mask=n_ok[:, None], other=0.0).to(dt)
    else:
        k = tl.load(k_base + offs_n[:, None] * stride_kn + d[None, :]).to(dt)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    p, alpha, m_new, l_i = _softmax_step(s, m_i, l_i)
    if MASKED:
        v = tl.load(v_base + offs_n[:, None] * stride_vn + d[None, :], mask=n_ok[:, None], other=0.0).to(dt)
    else:
        v = tl.load(v_base + offs_n[:, None] * stride_vn + d[None, :]).to(dt)
    acc = acc * alpha[:, None] + tl.dot(p.to(dt), v, input_precision=DOT_PREC)
    return acc, m_new, l_i

@triton.jit
def _fold_tile(q, acc, m_i, l_i, k, v, scale_log2, visible, DOT_PREC: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Keys/values ``k, v [N, D]`` held in registers folded into the running softmax, only ``visible [M, N]``
    counting (the step's own new keys, see :func:`_new_keys`)."""
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PREC) * scale_log2
    p, alpha, m_new, l_i = _softmax_step(tl.where(visible, s, float("-inf")), m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PREC)
    return acc, m_new, l_i

@triton.jit
def _rotated(base, offs, mask, d, cos, sin, HEAD_DIM: tl.constexpr):
    """Rows ``base + offs[r] + d`` (``[R, HEAD_DIM]``, ``mask [R]``) after the rotary embedding, in float32:
    transformers' ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x[D/2:], x[:D/2])``; ``cos, sin
    [R, HEAD_DIM]`` float32."""
    HALF: tl.constexpr = HEAD_DIM // 2
    x = tl.load(base + offs[:, None] + d[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
    pair = tl.load(base + offs[:, None] + ((d + HALF) % HEAD_DIM)[None, :], mask=mask[:, None],
                   other=0.0).to(tl.float32)
    return x * cos + tl.where((d < HALF)[None, :], -pair, pair) * sin

@triton.jit
def _angles(CS, SN, row, pos, stride_cb, stride_cl, mask, d):
    """The rotary embedding's ``cos, sin`` of rows ``pos [R]`` of batch row ``row``: ``[R, D]`` float32."""
    offs = row * stride_cb + pos[:, None] * stride_cl + d[None, :]
    cos = tl.load(CS + offs, mask=mask[:, None], other=0.0).to(tl.float32)
    sin = tl.load(SN + offs, mask=mask[:, None], other=0.0).to(tl.float32)
    return cos, sin

@triton.jit
def _new_keys(KN, VN, stride_knb, stride_knh, stride_knl, stride_vnb, stride_vnh, stride_vnl,
              CS, SN, stride_cb, stride_cl, row, head, j, j_ok, d, dtype, HEAD_DIM: tl.constexpr):
    """The step's own keys (rotated) and values of one KV head of batch row ``row``, ``[BLOCK_L, D]`` in the cache's
    ``dtype``: from the projections' outputs ``KN/VN [B, Hkv, L, D]`` (pre-rotary keys), rows ``j`` (``j_ok``)."""
    cos, sin = _angles(CS, SN, row, j, stride_cb, stride_cl, j_ok, d)
    k = _rotated(KN + row * stride_knb + head * stride_knh, j * stride_knl, j_ok, d, cos, sin, HEAD_DIM)
    v = tl.load(VN + row * stride_vnb + head * stride_vnh + j[:, None] * stride_vnl + d[None, :],
                mask=j_ok[:, None], other=0.0)
    return k.to(dtype), v.to(dtype)

@triton.jit
def _fp_part(
    Q, stride_qh, stride_ql, K, V, stride_kh, stride_kn, stride_vh, stride_vn, S_FP, L, fsplit, FSPLIT_TOKENS,
    scale_log2, pid_s, kvh, rows, row_ok, q_head, qi,
    OP, LP, stride_oph, stride_ops, stride_opm, stride_lph, stride_lps, O, stride_ol, stride_oh,
    SP, QP, SINK, WINDOW, CHUNK, TB,
    KN, VN, stride_knb, stride_knh, stride_knl, stride_vnb, stride_vnh, stride_vnl, CS, SN, stride_cb, stride_cl,
    SL, stride_slb, RW, row, ROW_HEADS,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FINAL: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_DTYPE: tl.constexpr, BY_POSITION: tl.constexpr, TREE: tl.constexpr,
    ROPE: tl.constexpr, BLOCK_L: tl.constexpr,
):
    """The split ``fsplit`` of the full-precision segment. Keys before the queries' own block (``S_FP - L``) are
    seen by every query: whole blocks of them run unmasked (LongSpec's prefix part), the rest with the causal or
    tree mask (the tree part). A ring (BY_POSITION) runs masked throughout: a slot is seen by the positions it
    holds, and with TREE the last L slots are the queries' tree block (seen by the ancestor bits alone).

    ROPE: ``Q`` holds the queries before the rotary embedding, applied here (``CS/SN [B, L, D]`` cos/sin), and the
    step's keys/values are the projections' ``KN/VN [B, Hkv, L, D]``: the programs of split 0 and row block 0 write
    them (keys rotated) to slots ``SL[b, :L]`` of row ``RW[b]``, and no program reads those slots from the buffer.
    In position order, where they are the queries' own block of this row (``S_FP - L ..``, a live row), every program
    folds them in from registers and reads the buffer only before the block, else (a finished row) it reads the
    buffer as it is. On a ring (BY_POSITION, no TREE) the slots holding positions from the step's first on are the
    ones written: the buffer's are skipped, and the program whose split holds slot ``SL[b, j]`` folds key j in from
    registers at position ``QP[j]``."""
    d = tl.arange(0, HEAD_DIM)
    if ROPE:
        cos, sin = _angles(CS, SN, row, qi, stride_cb, stride_cl, row_ok, d)
        q = _rotated(Q, q_head * stride_qh + qi * stride_ql, row_ok, d, cos, sin, HEAD_DIM)
        q = q.to(Q.dtype.element_ty).to(DOT_DTYPE)
    else:
        q = tl.load(Q + q_head[:, None] * stride_qh + qi[:, None] * stride_ql + d[None, :], mask=row_ok[:, None],
                    other=0.0).to(DOT_DTYPE)
    start = fsplit * FSPLIT_TOKENS
    end = tl.minimum(start + FSPLIT_TOKENS, S_FP)
    block_start = S_FP - L  # keys before it: every query's; from it: the queries' own (causal, or the tree)
    # what is read from the buffer first; with ROPE the block comes after, from registers or (a finished row) the
    # buffer, as the slots decide: the loops' bounds do not wait on their loads
    read_end = tl.minimum(end, block_start) if ROPE and not BY_POSITION else end
    if ROPE:
        j = tl.arange(0, BLOCK_L)
        j_ok = j < L
        slots = tl.load(SL + row * stride_slb + j, mask=j_ok, other=0)
        target = tl.load(RW + row)
        writes = (fsplit == 0) & (tl.program_id(0) == 0)
        if BY_POSITION:  # on a ring the slots of the step's positions, from the first on, are the ones being written
            first = tl.load(QP)
    limit = block_start + qi  # key n is visible to row r iff n <= limit[r]
    if TREE:  # query row r sees block slot j iff bit j of TB[r] is set
        tree_bits = tl.load(TB + qi, mask=row_ok, other=0)
    if BY_POSITION:  # slots in any order: visibility from the positions they hold (SP) and the queries' (QP)
        q_pos = tl.load(QP + qi, mask=row_ok, other=-1)
        # a slot holding s is visible iff 0 <= s <= q_pos and (s < SINK or s >= low): within WINDOW positions and
        # in the query's chunk of CHUNK positions (chunked attention; a CHUNK beyond every position: no chunks)
        low = tl.maximum(q_pos - WINDOW, q_pos - q_pos % CHUNK)
        masked_from = start
    else:
        masked_from = start + tl.maximum(tl.minimum(end, block_start) - start, 0) // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    for n0 in range(start, masked_from, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = _fp_block(q, acc, m_i, l_i, k_base, v_base, offs_n, d, stride_kn, stride_vn, scale_log2,
                                  None, None, False, DOT_PREC, DOT_DTYPE)
    for n0 in range(masked_from, read_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < read_end
        if BY_POSITION:
            sp = tl.load(SP + offs_n, mask=n_ok, other=-1)[None, :]
            visible = (sp >= 0) & (sp <= q_pos[:, None]) & ((sp < SINK) | (sp >= low[:, None]))
            if ROPE:
                visible = visible & (sp < first)
            if TREE:
                rel = tl.maximum(offs_n - block_start, 0).to(tl.int64)
                ancestor = ((tree_bits[:, None] >> rel[None, :]) & 1) != 0
                in_block = (offs_n >= block_start)[None, :]
                visible = tl.where(in_block, ancestor & (offs_n[None, :] <= limit[:, None]) & n_ok[None, :],
                                   visible)
        else:
            visible = (offs_n[None, :] <= limit[:, None]) & n_ok[None, :]
            if TREE:
                rel = tl.maximum(offs_n - block_start, 0).to(tl.int64)
                ancestor = ((tree_bits[:, None] >> rel[None, :]) & 1) != 0
                visible = visible & ((offs_n < block_start)[None, :] | ancestor)
        acc, m_i, l_i = _fp_block(q, acc, m_i, l_i, k_base, v_base, offs_n, d, stride_kn, stride_vn, scale_log2,
                                  visible, n_ok, True, DOT_PREC, DOT_DTYPE)
    if ROPE:
        if BY_POSITION:  # the new keys whose slots lie in this split
            folds = tl.sum(tl.where(j_ok & (slots >= start) & (slots < end), 1, 0), 0) > 0
        else:
            fresh = (tl.sum(tl.where(j_ok & (slots != block_start + j), 1, 0), 0) == 0) & (target == row)
            # a finished row (its output discarded): its block's slots read from the buffer, causal
            for n0 in range(tl.where(fresh, end, tl.maximum(read_end, start)), end, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_ok = offs_n < end
                visible = (offs_n[None, :] <= limit[:, None]) & n_ok[None, :]
                acc, m_i, l_i = _fp_block(q, acc, m_i, l_i, k_base, v_base, offs_n, d, stride_kn, stride_vn,
                                          scale_log2, visible, n_ok, True, DOT_PREC, DOT_DTYPE)
            folds = fresh & (end > block_start)
        if writes | folds:
            head = kvh % ROW_HEADS
            k_new, v_new = _new_keys(KN, VN, stride_knb, stride_knh, stride_knl, stride_vnb, stride_vnh, stride_vnl,
                                     CS, SN, stride_cb, stride_cl, row, head, j, j_ok, d, K.dtype.element_ty,
                                     HEAD_DIM)
            if writes:
                to = target * ROW_HEADS + head
                tl.store(K + to * stride_kh + slots[:, None] * stride_kn + d[None, :], k_new, mask=j_ok[:, None])
                tl.store(V + to * stride_vh + slots[:, None] * stride_vn + d[None, :], v_new, mask=j_ok[:, None])
            if folds:
                if BY_POSITION:  # new key j holds position QP[j]: the ring's rule
                    kp = tl.load(QP + j, mask=j_ok, other=-1)[None, :]
                    seen = (j_ok & (slots >= start) & (slots < end))[None, :] & (kp >= 0) & (kp <= q_pos[:, None]) & (
                        (kp < SINK) | (kp >= low[:, None]))
                else:
                    n = block_start + j
                    seen = (j_ok & (n >= start) & (n < end))[None, :] & (n[None, :] <= limit[:, None])
                if TREE:
                    seen = seen & (((tree_bits[:, None] >> j[None, :].to(tl.int64)) & 1) != 0)
                acc, m_i, l_i = _fold_tile(q, acc, m_i, l_i, k_new, v_new, scale_log2, seen, DOT_PREC, DOT_DTYPE)
    _write_rows(acc, m_i, l_i, d, rows, row_ok, q_head, qi, pid_s, kvh,
                OP, LP, stride_oph, stride_ops, stride_opm, stride_lph, stride_lps, O, stride_ol, stride_oh,
                FINAL, True)

@triton.jit
def _head_bases(KU, KL, VU, VL, KS, KZ, VS, VZ, kvh, stride_kuh, stride_vuh, stride_ksh, stride_vsh):
    """Pointers to KV head ``kvh`` of the quantized store: key/value upper and lower codes, key group scales/zeros,
    value token scales/zeros."""
    return (KU + kvh * stride_kuh, KL + kvh * stride_kuh, VU + kvh * stride_vuh, VL + kvh * stride_vuh,
            KS + kvh * stride_ksh, KZ + kvh * stride_ksh, VS + kvh * stride_vsh, VZ + kvh * stride_vsh)

@triton.jit
def _query_halves(Q, stride_qh, stride_ql, q_head, qi, row_ok, even):
    """The query rows' even and odd channels ``[M, D/2]`` in float32 (masked rows read 0)."""
    q_rows = Q + q_head[:, None] * stride_qh + qi[:, None] * stride_ql
    q_e = tl.load(q_rows + even[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    q_o = tl.load(q_rows + even[None, :] + 1, mask=row_ok[:, None], other=0.0).to(tl.float32)
    return q_e, q_o

@triton.jit
def _key_group_scales(ks_base, kz_base, g, stride_ksg, even):
    """Per-channel key scales and zero points of key group ``g``, even and odd channels, float32 ``[D/2]``."""
    ks_e = tl.load(ks_base + g * stride_ksg + even).to(tl.float32)
    ks_o = tl.load(ks_base + g * stride_ksg + even + 1).to(tl.float32)
    kz_e = tl.load(kz_base + g * stride_ksg + even).to(tl.float32)
    kz_o = tl.load(kz_base + g * stride_ksg + even + 1).to(tl.float32)
    return ks_e, ks_o, kz_e, kz_o

@triton.jit
def _codes_half(bu, bl, INT8: tl.constexpr, DT: tl.constexpr):
    """Packed code bytes -> ``DT`` (float16, or bfloat16 for INT4) ``(even, odd)`` channel codes, exact, with no
    int->float convert: a code ORed into the mantissa of 1024.0 (float16 0x6400, c < 1024; INT8's ``C = 14·u + l``
    <= 225) or of 128.0 (bfloat16 0x4300, c < 128: INT4 only) reads as ``1024 + c`` / ``128 + c``, and one
    half-precision subtraction leaves ``c``. Every step is elementwise from the byte tile with constant operands, so
    before a dot the compiler loads the bytes from shared memory straight into the dot's operand layout and converts
    there (no converted tile goes back through shared memory)."""
    if INT8:
        ce = 14 * (bu & 15).to(tl.int16) + (bl & 15).to(tl.int16)
        co = 14 * (bu >> 4).to(tl.int16) + (bl >> 4).to(tl.int16)
    else:
        ce = (bu & 15).to(tl.int16)
        co = (bu >> 4).to(tl.int16)
    MAGIC: tl.constexpr = 0x6400 if DT == tl.float16 else 0x4300
    BASE: tl.constexpr = 1024.0 if DT == tl.float16 else 128.0
    return (ce | MAGIC).to(DT, bitcast=True) - BASE, (co | MAGIC).to(DT, bitcast=True) - BASE

# Inline PTX for _codes_asm: four code bytes in one register ($4; $5 the lower codes for INT8) -> two half2
# registers of even-channel codes ($0, $1) and two of odd-channel codes ($2, $3). prmt spreads bytes 0,1 (2,3) to
# bytes 0 and 2 of a word, so one lop3 ((x & mask) | magic) leaves two codes in the mantissas of two half-precision
# magic numbers, and one packed subtraction of the magic leaves the codes.
_PTX_INT4 = """{
.reg .b32 t0, t1, s0, s1, h, one;
mov.b32 h, MAGIC;
prmt.b32 t0, $4, $4, 0x1100;
prmt.b32 t1, $4, $4, 0x3322;
shr.b32 s0, t0, 4;
shr.b32 s1, t1, 4;
lop3.b32 $0, t0, 0x000f000f, h, 0xea;
lop3.b32 $1, t1, 0x000f000f, h, 0xea;
lop3.b32 $2, s0, 0x000f000f, h, 0xea;
lop3.b32 $3, s1, 0x000f000f, h, 0xea;
SUB
}"""
_SUB_F16 = "sub.f16x2 $0, $0, h;\nsub.f16x2 $1, $1, h;\nsub.f16x2 $2, $2, h;\nsub.f16x2 $3, $3, h;"
# bfloat16: fma with 1.0 and -128.0 (sub.bf16x2 needs sm_90; this runs from sm_80)
_SUB_BF16 = ("mov.b32 one, 0x3f803f80;\nmov.b32 h, 0xc300c300;\nfma.rn.bf16x2 $0, $0, one, h;\n"
             "fma.rn.bf16x2 $1, $1, one, h;\nfma.rn.bf16x2 $2, $2, one, h;\nfma.rn.bf16x2 $3, $3, one, h;")
PTX_INT4_F16 = tl.constexpr(_PTX_INT4.replace("MAGIC", "0x64006400").replace("SUB", _SUB_F16))
PTX_INT4_BF16 = tl.constexpr(_PTX_INT4.replace("MAGIC", "0x43004300").replace("SUB", _SUB_BF16))


def _int8_lanes(out: str, upper: str, lower: str) -> str:
    return (f"and.b32 a, {upper}, 0x000f000f;\nlop3.b32 b, {lower}, 0x000f000f, h, 0xea;\n"
            f"mad.lo.u32 {out}, a, 14, b;\n")


# INT8 (float16 only): C = 14·u + l per 16-bit lane by one integer multiply-add on the packed lanes (C <= 225: no
# carry between lanes), the magic ORed into the lower codes first
PTX_INT8_F16 = tl.constexpr(
    "{\n.reg .b32 u0, u1, l0, l1, a, b, h;\nmov.b32 h, 0x64006400;\n"
    "prmt.b32 u0, $4, $4, 0x1100;\nprmt.b32 u1, $4, $4, 0x3322;\nprmt.b32 l0, $5, $5, 0x1100;\n"
    "prmt.b32 l1, $5, $5, 0x3322;\n"
    + _int8_lanes("$0", "u0", "l0") + _int8_lanes("$1", "u1", "l1")
    + "shr.b32 u0, u0, 4;\nshr.b32 u1, u1, 4;\nshr.b32 l0, l0, 4;\nshr.b32 l1, l1, 4;\n"
    + _int8_lanes("$2", "u0", "l0") + _int8_lanes("$3", "u1", "l1")
    + _SUB_F16 + "\n}"
)


@triton.jit
def _codes_asm(bu, bl, INT8: tl.constexpr, DT: tl.constexpr):
    """:func:`_codes_half` in inline PTX (compiled kernels only; the interpreter cannot run it): the same exact
    ``(even, odd)`` channel codes in ``DT``, four bytes per call; INT4 takes 13 instructions per 8 codes and no
    per-byte unpacking. ``bu``/``bl``: uint8 code tiles (``bl`` read for INT8 only, float16 only)."""
    if INT8:
        return tl.inline_asm_elementwise(PTX_INT8_F16, "=r,=r,=r,=r,r,r", [bu, bl], dtype=(tl.float16, tl.float16),
                                         is_pure=True, pack=4)
    elif DT == tl.float16:
        return tl.inline_asm_elementwise(PTX_INT4_F16, "=r,=r,=r,=r,r", [bu], dtype=(tl.float16, tl.float16),
                                         is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(PTX_INT4_BF16, "=r,=r,=r,=r,r", [bu], dtype=(tl.bfloat16, tl.bfloat16),
                                         is_pure=True, pack=4)

@triton.jit
def _dot_codes(bu, bl, MAGIC, INT8: tl.constexpr, DT: tl.constexpr, HALF_CODES: tl.constexpr,
               ASM_CODES: tl.constexpr, SPLIT8: tl.constexpr):
    """The tensor-core path's ``(even, odd)`` code operands in ``DT`` for one tile of key or value bytes, by the route
    :func:`_quant_part` chose: SPLIT8 the lower codes alone (the caller adds the upper ones' dots); else the PTX or
    Triton-op half-precision trick (odd codes plain); else float32 via :func:`_codes_f32` (odd codes as 16·c)."""
    if SPLIT8:
        ce, co = _codes_asm(bl, bl, False, DT)
    elif HALF_CODES and ASM_CODES:
        ce, co = _codes_asm(bu, bl, INT8, DT)
    elif HALF_CODES:
        ce, co = _codes_half(bu, bl, INT8, DT)
    else:
        ce, co = _codes_f32(bu.to(tl.int32), bl.to(tl.int32), MAGIC, INT8)  # exact integers: no int->float
        ce = ce.to(DT)
        co = co.to(DT)
    return ce, co

@triton.jit
def _quant_part(
    Q, stride_qh, stride_ql,
    KU, KL, stride_kuh, stride_kun, KS, KZ, stride_ksh, stride_ksg,
    VU, VL, stride_vuh, stride_vun, VS, VZ, stride_vsh, stride_vsn,
    T_Q, QSPLIT_TOKENS, scale_log2, pid_s, kvh, rows, row_ok, q_head, qi, MAGIC,
    OP, LP, stride_oph, stride_ops, stride_opm, stride_lph, stride_lps, O, stride_ol, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, QBLOCK_N: tl.constexpr, KEY_GROUP: tl.constexpr,
    INT8: tl.constexpr, FINAL: tl.constexpr, DOT_PREC: tl.constexpr, DOT_DTYPE: tl.constexpr,
    TRANS_LOAD: tl.constexpr, ASM_CODES: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    if INT8:
        CF: tl.constexpr = 1.0 / 14.0  # dequantized = (z + ZOFF·s) + (s·CF)·C, C = 14·upper + stored lower
        ZOFF: tl.constexpr = -8.0 / 14.0
    else:
        CF: tl.constexpr = 1.0
        ZOFF: tl.constexpr = 0.0
    dt = DOT_DTYPE
    # p·s·CF enters a float16 value dot scaled by PV = 2^8 (divided out at the end): unscaled, small value scales put
    # it among float16's subnormals (INT8 relative error 2e-2 at a token value range of 0.015;
    # benchmarks/results/HISTORY.md); the scaled operand overflows only past an INT4 value range of 15·65504/2^8 ≈ 3800 per token
    if DOT_DTYPE == tl.float16:
        PV: tl.constexpr = 256.0
    else:
        PV: tl.constexpr = 1.0
    # odd channel codes come as ODD·c: plain from _codes_asm / _codes_half (float16 operands; bfloat16 for INT4),
    # 16·c from _codes_f32 (float32 operands; bfloat16 INT8 without the PTX: its 7-bit mantissa cannot hold INT8's
    # combined codes up to 225). SPLIT8 (bfloat16 INT8 with the PTX): upper and lower codes enter separate dots
    # (each < 16 fits bfloat16's trick), the upper ones against q⊙s, the lower ones against q⊙s/14.
    SPLIT8: tl.constexpr = ASM_CODES and INT8 and DOT_DTYPE == tl.bfloat16
    HALF_CODES: tl.constexpr = DOT_DTYPE == tl.float16 or (DOT_DTYPE == tl.bfloat16 and not INT8) or SPLIT8
    ODD: tl.constexpr = 1.0 if HALF_CODES else 16.0
    half = tl.arange(0, HALF)
    even = 2 * half
    q_e, q_o = _query_halves(Q, stride_qh, stride_ql, q_head, qi, row_ok, even)
    start = pid_s * QSPLIT_TOKENS
    end = tl.minimum(start + QSPLIT_TOKENS, T_Q)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_e = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc_o = tl.zeros([BLOCK_M, HALF], tl.float32)
    vbias = tl.zeros([BLOCK_M], tl.float32)
    ku_base, kl_base, vu_base, vl_base, ks_base, kz_base, vs_base, vz_base = _head_bases(
        KU, KL, VU, VL, KS, KZ, VS, VZ, kvh, stride_kuh, stride_vuh, stride_ksh, stride_vsh)
    for n0 in range(start, end, QBLOCK_N):
        offs_n = n0 + tl.arange(0, QBLOCK_N)
        n_ok = offs_n < end
        # keys: fold the group's per-channel scale into the query, its zero point into a per-row bias
        g = n0 // KEY_GROUP
        ks_e, ks_o, kz_e, kz_o = _key_group_scales(ks_base, kz_base, g, stride_ksg, even)
        qs_e = (q_e * (ks_e * CF)[None, :]).to(dt)
        qs_o = (q_o * (ks_o * (CF / ODD))[None, :]).to(dt)
        kbias = tl.sum(q_e * (kz_e + ZOFF * ks_e)[None, :], 1) + tl.sum(q_o * (kz_o + ZOFF * ks_o)[None, :], 1)
        if TRANS_LOAD:  # codes loaded as [HALF, N]: the dot's right operand as is
            code_ptrs = offs_n[None, :] * stride_kun + half[:, None]
            code_mask = n_ok[None, :]
        else:
            code_ptrs = offs_n[:, None] * stride_kun + half[None, :]
            code_mask = n_ok[:, None]
        ku = tl.load(ku_base + code_ptrs, mask=code_mask, other=0)
        if INT8:
            kl = tl.load(kl_base + code_ptrs, mask=code_mask, other=0)
        else:
            kl = ku
        ke, ko = _dot_codes(ku, kl, MAGIC, INT8, DOT_DTYPE, HALF_CODES, ASM_CODES, SPLIT8)
        if not TRANS_LOAD:
            ke = tl.trans(ke)
            ko = tl.trans(ko)
        s = tl.dot(qs_e, ke, input_precision=DOT_PREC)
        s += tl.dot(qs_o, ko, input_precision=DOT_PREC)
        if SPLIT8:
            ue, uo = _codes_asm(ku, ku, False, DOT_DTYPE)
            s += tl.dot((q_e * ks_e[None, :]).to(dt), ue, input_precision=DOT_PREC)
            s += tl.dot((q_o * ks_o[None, :]).to(dt), uo, input_precision=DOT_PREC)
        s = (s + kbias[:, None]) * scale_log2
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # values: fold the per-token scale into p, the zero point into a per-row bias
        vs = tl.load(vs_base + offs_n * stride_vsn, mask=n_ok, other=0.0).to(tl.float32)
        vz = tl.load(vz_base + offs_n * stride_vsn, mask=n_ok, other=0.0).to(tl.float32)
        ps = (p * (vs * (CF * PV))[None, :]).to(dt)
        vbias = vbias * alpha + tl.sum(p * (vz + ZOFF * vs)[None, :], 1)
        vcode_ptrs = offs_n[:, None] * stride_vun + half[None, :]
        vu = tl.load(vu_base + vcode_ptrs, mask=n_ok[:, None], other=0)
        if INT8:
            vl = tl.load(vl_base + vcode_ptrs, mask=n_ok[:, None], other=0)
        else:
            vl = vu
        ve, vo = _dot_codes(vu, vl, MAGIC, INT8, DOT_DTYPE, HALF_CODES, ASM_CODES, SPLIT8)
        acc_e = acc_e * alpha[:, None] + tl.dot(ps, ve, input_precision=DOT_PREC)
        acc_o = acc_o * alpha[:, None] + tl.dot(ps, vo, input_precision=DOT_PREC)
        if SPLIT8:
            psu = (p * vs[None, :]).to(dt)
            ue, uo = _codes_asm(vu, vu, False, DOT_DTYPE)
            acc_e += tl.dot(psu, ue, input_precision=DOT_PREC)
            acc_o += tl.dot(psu, uo, input_precision=DOT_PREC)
        m_i = m_new
    acc_e = acc_e * (1.0 / PV) + vbias[:, None]
    acc_o = acc_o * (1.0 / (ODD * PV)) + vbias[:, None]
    _write_rows(acc_e, m_i, l_i, even, rows, row_ok, q_head, qi, pid_s, kvh,
                OP, LP, stride_oph, stride_ops, stride_opm, stride_lph, stride_lps, O, stride_ol, stride_oh,
                FINAL, True)
    _write_rows(acc_o, m_i, l_i, even + 1, rows, row_ok, q_head, qi, pid_s, kvh,
                OP, LP, stride_oph, stride_ops, stride_opm, stride_lph, stride_lps, O, stride_ol, stride_oh,
                FINAL, False)

@triton.jit
def _codes_f32(bu, bl, MAGIC, INT8: tl.constexpr):
    """Packed code bytes (int32, 0..255) -> float32 ``(even, 16·odd)`` channel codes without int->float converts:
    an integer ``0 <= x < 2^23`` ORed into the bits of 2^23 reads as ``2^23 + x``; one subtraction leaves ``x``.
    The odd nibble is taken in place (``byte & 0xF0`` = 16·code; callers fold the 1/16 into their scales). INT8:
    upper ``u`` and stored lower ``l`` (offset 8) combine as integers into ``C = 14·u + l`` (0..225): the dequantized
    value is ``z + s·u + (s/14)·(l - 8) = (z - 8s/14) + (s/14)·C``, so the INT8 view converts as many codes as INT4.
    ``MAGIC`` (= 0x4B000000) is a runtime argument, so it sits in a register and mask + OR is one LOP3."""
    if INT8:
        ce = 14 * (bu & 15) + (bl & 15)
        co = 14 * (bu & 240) + (bl & 240)
    else:
        ce = bu & 15
        co = bu & 240
    fe = (ce | MAGIC).to(tl.float32, bitcast=True) - 8388608.0
    fo = (co | MAGIC).to(tl.float32, bitcast=True) - 8388608.0
    return fe, fo

@triton.jit
def _key_codes(ku_base, kl_base, offs_n, end, half, stride_kun, INT8: tl.constexpr):
    """Packed key code bytes of one block ``[QBLOCK_N, D/2]`` (upper; lower too for INT8, else the upper again)."""
    ok = offs_n < end
    ptrs = offs_n[:, None] * stride_kun + half[None, :]
    ku = tl.load(ku_base + ptrs, mask=ok[:, None], other=0)
    if INT8:
        kl = tl.load(kl_base + ptrs, mask=ok[:, None], other=0)
    else:
        kl = ku
    return ku, kl

@triton.jit
def _value_codes(vu_base, vl_base, vs_base, vz_base, offs_n, end, half, stride_vun, stride_vsn, INT8: tl.constexpr):
    """Packed value code bytes of one block (as :func:`_key_codes`) and the tokens' scales and zero points."""
    ok = offs_n < end
    ptrs = offs_n[:, None] * stride_vun + half[None, :]
    vu = tl.load(vu_base + ptrs, mask=ok[:, None], other=0)
    if INT8:
        vl = tl.load(vl_base + ptrs, mask=ok[:, None], other=0)
    else:
        vl = vu
    vs = tl.load(vs_base + offs_n * stride_vsn, mask=ok, other=0.0)
    vz = tl.load(vz_base + offs_n * stride_vsn, mask=ok, other=0.0)
    return vu, vl, vs, vz

@triton.jit
def _quant_part_vec1(
    Q, stride_qh, KU, KL, stride_kuh, stride_kun, KS, KZ, stride_ksh, stride_ksg,
    VU, VL, stride_vuh, stride_vun, VS, VZ, stride_vsh, stride_vsn,
    T_Q, QSPLIT_TOKENS, scale_log2, pid_s, kvh, MAGIC,
    OP, LP, stride_oph, stride_ops, stride_opm, stride_lph, stride_lps, O, stride_oh,
    HEAD_DIM: tl.constexpr, QBLOCK_N: tl.constexpr, KEY_GROUP: tl.constexpr, INT8: tl.constexpr,
    FINAL: tl.constexpr, PREFETCH: tl.constexpr, ACC_ROWS: tl.constexpr,
):
    """:func:`_quant_part_vec` for one query row per KV head (no GQA, one query token): vectors and scalars only,
    so every tensor of a block shares the code tile's layout (no layout conversions in the loop). The value sums stay
    per token slot (``[ACC_ROWS, D/2]`` accumulators, reduced over slots once at the end, no cross-thread reduction
    per block): with ``ACC_ROWS == QBLOCK_N`` one FMA per code; with fewer, block rows ``r`` and ``r + ACC_ROWS``
    share a slot, which the launcher chooses so that they sit in one thread's registers (``ACC_ROWS`` = the rows one
    repetition of the code tile's layout covers) and the fold costs no data movement, only fewer accumulator
    registers. Lazy rescaling: probabilities are taken against a running maximum that is raised (and the
    accumulators rescaled) only when a block's maximum exceeds it by more than 2^8, so p <= 2^8."""
    HALF: tl.constexpr = HEAD_DIM // 2
    if INT8:
        CF: tl.constexpr = 1.0 / 14.0
        ZOFF: tl.constexpr = -8.0 / 14.0
    else:
        CF: tl.constexpr = 1.0
        ZOFF: tl.constexpr = 0.0
    half = tl.arange(0, HALF)
    even = 2 * half
    q_ptr = Q + kvh * stride_qh
    q_e = tl.load(q_ptr + even).to(tl.float32)
    q_o = tl.load(q_ptr + even + 1).to(tl.float32)
    start = pid_s * QSPLIT_TOKENS
    end = tl.minimum(start + QSPLIT_TOKENS, T_Q)
    m_i = tl.max(tl.full([2], -1.0e30, tl.float32), 0)
    acc_e = tl.zeros([ACC_ROWS, HALF], tl.float32)
    acc_o = tl.zeros([ACC_ROWS, HALF], tl.float32)
    pv = tl.zeros([QBLOCK_N], tl.float32)  # per token slot: Σ p (the denominator) and Σ p·(z + ZOFF·s)
    pz = tl.zeros([QBLOCK_N], tl.float32)
    ku_base, kl_base, vu_base, vl_base, ks_base, kz_base, vs_base, vz_base = _head_bases(
        KU, KL, VU, VL, KS, KZ, VS, VZ, kvh, stride_kuh, stride_vuh, stride_ksh, stride_vsh)
    tok = tl.arange(0, QBLOCK_N)
    if PREFETCH:
        ku, kl = _key_codes(ku_base, kl_base, start + tok, end, half, stride_kun, INT8)
        vu, vl, vs, vz = _value_codes(vu_base, vl_base, vs_base, vz_base, start + tok, end, half, stride_vun,
                                      stride_vsn, INT8)
    for n0 in range(start, end, QBLOCK_N):
        offs_n = n0 + tok
        n_ok = offs_n < end
        if PREFETCH:
            ku_c, kl_c, vu_c, vl_c, vs_c, vz_c = ku, kl, vu, vl, vs, vz
            ku, kl = _key_codes(ku_base, kl_base, offs_n + QBLOCK_N, end, half, stride_kun, INT8)
            vu, vl, vs, vz = _value_codes(vu_base, vl_base, vs_base, vz_base, offs_n + QBLOCK_N, end, half,
                                          stride_vun, stride_vsn, INT8)
        else:
            ku_c, kl_c = _key_codes(ku_base, kl_base, offs_n, end, half, stride_kun, INT8)
            vu_c, vl_c, vs_c, vz_c = _value_codes(vu_base, vl_base, vs_base, vz_base, offs_n, end, half, stride_vun,
                                                  stride_vsn, INT8)
        g = n0 // KEY_GROUP
        ks_e, ks_o, kz_e, kz_o = _key_group_scales(ks_base, kz_base, g, stride_ksg, even)
        qs_e = q_e * (ks_e * CF)
        qs_o = q_o * (ks_o * (CF / 16.0))
        kbias = tl.sum(q_e * (kz_e + ZOFF * ks_e) + q_o * (kz_o + ZOFF * ks_o), 0)
        fe, fo = _codes_f32(ku_c.to(tl.int32), kl_c.to(tl.int32), MAGIC, INT8)
        s = tl.sum(fe * qs_e[None, :] + fo * qs_o[None, :], 1)
        s = (s + kbias) * scale_log2
        s = tl.where(n_ok, s, float("-inf"))
        m_blk = tl.max(s, 0)
        if m_blk > m_i + 8.0:  # rare after the first block: raise the running maximum, rescale
            alpha = tl.exp2(m_i - m_blk)
            acc_e = acc_e * alpha
            acc_o = acc_o * alpha
            pv = pv * alpha
            pz = pz * alpha
            m_i = m_blk
        p = tl.exp2(s - m_i)
        vsf = vs_c.to(tl.float32)
        ps = p * (vsf * CF)
        pv += p
        pz += p * (vz_c.to(tl.float32) + ZOFF * vsf)
        fe, fo = _codes_f32(vu_c.to(tl.int32), vl_c.to(tl.int32), MAGIC, INT8)
        if ACC_ROWS == QBLOCK_N:
            acc_e += ps[:, None] * fe
            acc_o += ps[:, None] * fo
        else:
            acc_e += tl.sum(tl.reshape(ps[:, None] * fe, [QBLOCK_N // ACC_ROWS, ACC_ROWS, HALF]), 0)
            acc_o += tl.sum(tl.reshape(ps[:, None] * fo, [QBLOCK_N // ACC_ROWS, ACC_ROWS, HALF]), 0)
    l_i = tl.sum(pv, 0)
    vbias = tl.sum(pz, 0)
    has = l_i > 0
    inv = 1.0 / tl.where(has, l_i, 1.0)
    out_e = (tl.sum(acc_e, 0) + vbias) * inv
    out_o = (tl.sum(acc_o, 0) * (1.0 / 16.0) + vbias) * inv
    if FINAL:
        tl.store(O + kvh * stride_oh + even, out_e.to(O.dtype.element_ty))
        tl.store(O + kvh * stride_oh + even + 1, out_o.to(O.dtype.element_ty))
    else:
        base = OP + kvh * stride_oph + pid_s * stride_ops
        tl.store(base + even, out_e)
        tl.store(base + even + 1, out_o)
        tl.store(LP + kvh * stride_lph + pid_s * stride_lps,
                 tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf")))

@triton.jit
def _quant_part_vec(
    Q, stride_qh, stride_ql,
    KU, KL, stride_kuh, stride_kun, KS, KZ, stride_ksh, stride_ksg,
    VU, VL, stride_vuh, stride_vun, VS, VZ, stride_vsh, stride_vsn,
    T_Q, QSPLIT_TOKENS, scale_log2, pid_s, kvh, L, MAGIC,
    OP, LP, stride_oph, stride_ops, stride_opm, stride_lph, stride_lps, O, stride_ol, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, VEC_M: tl.constexpr, QBLOCK_N: tl.constexpr,
    KEY_GROUP: tl.constexpr, INT8: tl.constexpr, FINAL: tl.constexpr, PREFETCH: tl.constexpr,
):
    """The quantized segment without tensor cores, for few query rows per KV head (``VEC_M`` <= 4, a power of two):
    everything stays in registers, dots are broadcast multiplies + sums (over channels for the scores, over tokens
    for the output). Scales/zeros folded as in :func:`_quant_part`; codes converted once by :func:`_codes_f32`.
    ``PREFETCH``: the next block's codes are loaded before the current block is computed (register double buffer)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    if INT8:
        CF: tl.constexpr = 1.0 / 14.0  # value = (z + ZOFF·s) + (s·CF)·C
        ZOFF: tl.constexpr = -8.0 / 14.0
    else:
        CF: tl.constexpr = 1.0
        ZOFF: tl.constexpr = 0.0
    rows = tl.arange(0, VEC_M)
    row_ok = rows < GROUP * L
    qi = rows % L
    q_head = kvh * GROUP + rows // L
    half = tl.arange(0, HALF)
    even = 2 * half
    q_e, q_o = _query_halves(Q, stride_qh, stride_ql, q_head, qi, row_ok, even)
    start = pid_s * QSPLIT_TOKENS
    end = tl.minimum(start + QSPLIT_TOKENS, T_Q)
    m_i = tl.full([VEC_M], -1.0e30, tl.float32)
    l_i = tl.zeros([VEC_M], tl.float32)
    acc_e = tl.zeros([VEC_M, HALF], tl.float32)
    acc_o = tl.zeros([VEC_M, HALF], tl.float32)
    vbias = tl.zeros([VEC_M], tl.float32)
    ku_base, kl_base, vu_base, vl_base, ks_base, kz_base, vs_base, vz_base = _head_bases(
        KU, KL, VU, VL, KS, KZ, VS, VZ, kvh, stride_kuh, stride_vuh, stride_ksh, stride_vsh)
    tok = tl.arange(0, QBLOCK_N)
    if PREFETCH:  # the first block's codes
        ku, kl = _key_codes(ku_base, kl_base, start + tok, end, half, stride_kun, INT8)
        vu, vl, vs, vz = _value_codes(vu_base, vl_base, vs_base, vz_base, start + tok, end, half, stride_vun,
                                      stride_vsn, INT8)
    for n0 in range(start, end, QBLOCK_N):
        offs_n = n0 + tok
        n_ok = offs_n < end
        if PREFETCH:
            ku_c, kl_c, vu_c, vl_c, vs_c, vz_c = ku, kl, vu, vl, vs, vz
            ku, kl = _key_codes(ku_base, kl_base, offs_n + QBLOCK_N, end, half, stride_kun, INT8)
            vu, vl, vs, vz = _value_codes(vu_base, vl_base, vs_base, vz_base, offs_n + QBLOCK_N, end, half,
                                          stride_vun, stride_vsn, INT8)
        else:  # values are loaded after the scores (fewer live registers)
            ku_c, kl_c = _key_codes(ku_base, kl_base, offs_n, end, half, stride_kun, INT8)
        # keys: q·k = (q⊙s·CF)·C + q·(z + ZOFF·s), the group's s, z loaded once per block
        g = n0 // KEY_GROUP
        ks_e, ks_o, kz_e, kz_o = _key_group_scales(ks_base, kz_base, g, stride_ksg, even)
        qs_e = q_e * (ks_e * CF)[None, :]
        qs_o = q_o * (ks_o * (CF / 16.0))[None, :]
        kbias = tl.sum(q_e * (kz_e + ZOFF * ks_e)[None, :], 1) + tl.sum(q_o * (kz_o + ZOFF * ks_o)[None, :], 1)
        fe, fo = _codes_f32(ku_c.to(tl.int32), kl_c.to(tl.int32), MAGIC, INT8)
        if VEC_M == 1:
            s = tl.sum(fe * tl.sum(qs_e, 0)[None, :] + fo * tl.sum(qs_o, 0)[None, :], 1)[None, :]
        else:
            s = tl.sum(fe[None, :, :] * qs_e[:, None, :] + fo[None, :, :] * qs_o[:, None, :], 2)
        s = (s + kbias[:, None]) * scale_log2
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # values: Σ p_n v_n = (p⊙s·CF)·C + Σ p_n (z_n + ZOFF·s_n)
        if not PREFETCH:
            vu_c, vl_c, vs_c, vz_c = _value_codes(vu_base, vl_base, vs_base, vz_base, offs_n, end, half, stride_vun,
                                                  stride_vsn, INT8)
        vsf = vs_c.to(tl.float32)
        ps = p * (vsf * CF)[None, :]
        vbias = vbias * alpha + tl.sum(p * (vz_c.to(tl.float32) + ZOFF * vsf)[None, :], 1)
        fe, fo = _codes_f32(vu_c.to(tl.int32), vl_c.to(tl.int32), MAGIC, INT8)
        if VEC_M == 1:
            p1 = tl.sum(ps, 0)
            acc_e = acc_e * alpha[:, None] + tl.sum(p1[:, None] * fe, 0)[None, :]
            acc_o = acc_o * alpha[:, None] + tl.sum(p1[:, None] * fo, 0)[None, :]
        else:
            acc_e = acc_e * alpha[:, None] + tl.sum(ps[:, :, None] * fe[None, :, :], 1)
            acc_o = acc_o * alpha[:, None] + tl.sum(ps[:, :, None] * fo[None, :, :], 1)
        m_i = m_new
    acc_e += vbias[:, None]
    acc_o = acc_o * (1.0 / 16.0) + vbias[:, None]
    _write_rows(acc_e, m_i, l_i, even, rows, row_ok, q_head, qi, pid_s, kvh,
                OP, LP, stride_oph, stride_ops, stride_opm, stride_lph, stride_lps, O, stride_ol, stride_oh,
                FINAL, True)
    _write_rows(acc_o, m_i, l_i, even + 1, rows, row_ok, q_head, qi, pid_s, kvh,
                OP, LP, stride_oph, stride_ops, stride_opm, stride_lph, stride_lps, O, stride_ol, stride_oh,
                FINAL, False)

@triton.jit
def _merge_when_last(
    TICKETS, row_block, kvh, ARRIVALS, NS, OP, LP, stride_oph, stride_ops, stride_opm, stride_lph, stride_lps,
    O, stride_ol, stride_oh, L,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MERGE_S: tl.constexpr,
    MERGE_R: tl.constexpr,
):
    """The merge of :func:`combine_kernel` for one row block of one KV head, run by the last of its ``ARRIVALS``
    programs to finish (the others return): each program counts itself in on ``TICKETS[kvh, row_block]`` (int32,
    zero before the launch) after its partial output is stored, and the one that draws the last ticket sets it back
    to zero and merges the ``NS`` splits' partial outputs (the block's rows ``<= MERGE_R``), ``MERGE_S`` splits (one
    tile) at a time with a running maximum. Partials are read from L2 (``.cg``): another program wrote them during
    this launch."""
    ticket = TICKETS + kvh * tl.num_programs(0) + row_block
    tl.debug_barrier()  # every thread's partial-output stores come before the ticket (release)
    if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == ARRIVALS - 1:
        tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")
        r = row_block * BLOCK_M + tl.arange(0, MERGE_R)[:, None]  # [R, 1]
        d = tl.arange(0, HEAD_DIM)[None, :]  # [1, D]
        row_ok = r < tl.minimum(row_block * BLOCK_M + BLOCK_M, GROUP * L)
        m = tl.full([MERGE_R, 1], float("-inf"), tl.float32)  # the largest log-sum-exp so far
        denom = tl.zeros([MERGE_R, 1], tl.float32)
        acc = tl.zeros([MERGE_R, HEAD_DIM], tl.float32)
        for first in range(0, NS, MERGE_S):
            s = first + tl.arange(0, MERGE_S)[:, None, None]
            ok = (s < NS) & row_ok[None]
            lse = tl.load(LP + kvh * stride_lph + s * stride_lps + r[None], mask=ok, other=float("-inf"),
                          cache_modifier=".cg")  # [S, R, 1]
            o = tl.load(OP + kvh * stride_oph + s * stride_ops + r[None] * stride_opm + d[None], mask=ok, other=0.0,
                        cache_modifier=".cg")  # [S, R, D]
            m_new = tl.maximum(m, tl.max(lse, 0))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split saw a visible key yet: weights 0
            kept = tl.exp2(m - base)  # what the tiles before weigh now (0 before the first visible key)
            w = tl.exp2(lse - base[None])
            denom = denom * kept + tl.sum(w, 0)
            acc = acc * kept + tl.sum(o * w, 0)
            m = m_new
        out = acc / tl.where(denom > 0, denom, 1.0)  # [R, D]; a finished row (no visible key): 0
        tl.store(O + (r % L) * stride_ol + (kvh * GROUP + r // L) * stride_oh + d, out.to(O.dtype.element_ty),
                 mask=row_ok)

# Arguments that follow an engine's capacity (a longer prompt grows it) and are only loop bounds or scalar strides:
# not specialized (Triton would otherwise compile the kernel again when one of them changes divisibility by 16 or
# passes 1), so a grown engine launches the code compiled for the first. Pointer strides that set vector widths stay
# specialized: capacities are multiples of 256, so they keep their divisibility.
CAPACITY_ARGS = ("S_FP", "T_Q", "N_QSPLITS", "N_FSPLITS", "N_MERGE", "SPLIT_BASE", "stride_lph")


@triton.jit(do_not_specialize=CAPACITY_ARGS)
def decode_split_kernel(
    Q, stride_qh, stride_ql,
    K, V, stride_kh, stride_kn, stride_vh, stride_vn, S_FP,
    KU, KL, stride_kuh, stride_kun, KS, KZ, stride_ksh, stride_ksg,
    VU, VL, stride_vuh, stride_vun, VS, VZ, stride_vsh, stride_vsn, T_Q,
    OP, LP, stride_oph, stride_ops, stride_opm, stride_lph, stride_lps,
    O, stride_ol, stride_oh,
    scale_log2, L, N_QSPLITS, QSPLIT_TOKENS, N_FSPLITS, FSPLIT_TOKENS, MAGIC, S_PTR, T_PTR, ROW_HEADS,
    SP, stride_spb, QP, stride_qpb, SINK, WINDOW, CHUNK, TB, stride_tbb, SPLIT_BASE, TICKETS, N_MERGE,
    KN, VN, stride_knb, stride_knh, stride_knl, stride_vnb, stride_vnh, stride_vnl, CS, SN, stride_cb, stride_cl,
    SL, stride_slb, RW,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QBLOCK_N: tl.constexpr, KEY_GROUP: tl.constexpr, HAS_QUANT: tl.constexpr, INT8: tl.constexpr,
    FINAL: tl.constexpr, DOT_PREC: tl.constexpr, DOT_DTYPE: tl.constexpr, TRANS_LOAD: tl.constexpr,
    VEC_M: tl.constexpr, PREFETCH: tl.constexpr, LENGTHS_ON_DEVICE: tl.constexpr, BY_POSITION: tl.constexpr,
    ACC_ROWS: tl.constexpr, ASM_CODES: tl.constexpr, TREE: tl.constexpr,
    MERGE: tl.constexpr, MERGE_S: tl.constexpr, MERGE_R: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr,
):
    pid_s = tl.program_id(1)  # axis 0: the row blocks of one split and KV head run side by side (they read the same
    kvh = tl.program_id(2)  # keys, which they can then share through L2)
    row = kvh // ROW_HEADS  # the batch row (a batch is laid out as ROW_HEADS KV heads per row)
    if LENGTHS_ON_DEVICE:  # S_FP / T_Q are capacities (they sized the grid); the lengths are read here, one per row
        S_FP = tl.load(S_PTR + row)
        # the N_FSPLITS programs of the segment share the row's current length (not the capacity) equally
        FSPLIT_TOKENS = tl.cdiv(tl.cdiv(S_FP, N_FSPLITS), BLOCK_N) * BLOCK_N
        if HAS_QUANT:  # and the N_QSPLITS programs the quantized segment's current length
            T_Q = tl.load(T_PTR + row)
            QSPLIT_TOKENS = tl.cdiv(tl.cdiv(T_Q, N_QSPLITS), QBLOCK_N) * QBLOCK_N
        if BY_POSITION:  # this row's slot positions [S] and query positions [L]
            SP += row * stride_spb
            QP += row * stride_qpb
        if TREE:  # this row's ancestor bits [L] (stride 0: one tree for every row)
            TB += row * stride_tbb
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # full precision: query rows in blocks of BLOCK_M
    row_ok = rows < GROUP * L
    qi = rows % L
    q_head = kvh * GROUP + rows // L
    if HAS_QUANT:
        if pid_s < N_QSPLITS:
            if VEC_M == 1 and GROUP == 1:  # constexpr (L == 1 follows: rows = GROUP·L <= VEC_M)
                _quant_part_vec1(Q, stride_qh, KU, KL, stride_kuh, stride_kun, KS, KZ, stride_ksh, stride_ksg,
                                 VU, VL, stride_vuh, stride_vun, VS, VZ, stride_vsh, stride_vsn,
                                 T_Q, QSPLIT_TOKENS, scale_log2, pid_s, kvh, MAGIC,
                                 OP, LP, stride_oph, stride_ops, stride_opm, stride_lph, stride_lps, O, stride_oh,
                                 HEAD_DIM, QBLOCK_N, KEY_GROUP, INT8, FINAL, PREFETCH, ACC_ROWS)
            elif VEC_M > 0:  # constexpr: only one of the two quantized paths is compiled into a kernel
                _quant_part_vec(Q, stride_qh, stride_ql, KU, KL, stride_kuh, stride_kun, KS, KZ, stride_ksh,
                                stride_ksg, VU, VL, stride_vuh, stride_vun, VS, VZ, stride_vsh, stride_vsn,
                                T_Q, QSPLIT_TOKENS, scale_log2, pid_s, kvh, L, MAGIC,
                                OP, LP, stride_oph, stride_ops, stride_opm, stride_lph, stride_lps, O, stride_ol,
                                stride_oh, GROUP, HEAD_DIM, VEC_M, QBLOCK_N, KEY_GROUP, INT8, FINAL, PREFETCH)
            else:
                _quant_part(Q, stride_qh, stride_ql, KU, KL, stride_kuh, stride_kun, KS, KZ, stride_ksh, stride_ksg,
                            VU, VL, stride_vuh, stride_vun, VS, VZ, stride_vsh, stride_vsn,
                            T_Q, QSPLIT_TOKENS, scale_log2, pid_s, kvh, rows, row_ok, q_head, qi, MAGIC,
                            OP, LP, stride_oph, stride_ops, stride_opm, stride_lph, stride_lps, O, stride_ol,
                            stride_oh, HEAD_DIM, BLOCK_M, QBLOCK_N, KEY_GROUP, INT8, FINAL, DOT_PREC, DOT_DTYPE,
                            TRANS_LOAD, ASM_CODES)
        else:
            _fp_part(Q, stride_qh, stride_ql, K, V, stride_kh, stride_kn, stride_vh, stride_vn, S_FP, L,
                     pid_s - N_QSPLITS, FSPLIT_TOKENS, scale_log2, pid_s, kvh, rows, row_ok, q_head, qi,
                     OP, LP, stride_oph, stride_ops, stride_opm, stride_lph, stride_lps, O, stride_ol, stride_oh,
                     SP, QP, SINK, WINDOW, CHUNK, TB,
                     KN, VN, stride_knb, stride_knh, stride_knl, stride_vnb, stride_vnh, stride_vnl, CS, SN,
                     stride_cb, stride_cl, SL, stride_slb, RW, row, ROW_HEADS,
                     HEAD_DIM, BLOCK_M, BLOCK_N, FINAL, DOT_PREC, DOT_DTYPE, BY_POSITION, TREE, False, BLOCK_L)
    else:
        _fp_part(Q, stride_qh, stride_ql, K, V, stride_kh, stride_kn, stride_vh, stride_vn, S_FP, L,
                 pid_s, FSPLIT_TOKENS, scale_log2, pid_s + SPLIT_BASE, kvh, rows, row_ok, q_head, qi,
                 OP, LP, stride_oph, stride_ops, stride_opm, stride_lph, stride_lps, O, stride_ol, stride_oh,
                 SP, QP, SINK, WINDOW, CHUNK, TB,
                 KN, VN, stride_knb, stride_knh, stride_knl, stride_vnb, stride_vnh, stride_vnl, CS, SN,
                 stride_cb, stride_cl, SL, stride_slb, RW, row, ROW_HEADS,
                 HEAD_DIM, BLOCK_M, BLOCK_N, FINAL, DOT_PREC, DOT_DTYPE, BY_POSITION, TREE, ROPE, BLOCK_L)
    if MERGE:  # the last program of this row block and KV head merges every split (no second launch)
        _merge_when_last(TICKETS, tl.program_id(0), kvh, tl.num_programs(1), N_MERGE, OP, LP, stride_oph, stride_ops,
                         stride_opm, stride_lph, stride_lps, O, stride_ol, stride_oh, L, GROUP, HEAD_DIM, BLOCK_M,
                         MERGE_S, MERGE_R)

COMBINE_CAPACITY_ARGS = ("NS", "stride_lph")  # the merge kernel's (as CAPACITY_ARGS)


@triton.jit(do_not_specialize=COMBINE_CAPACITY_ARGS)
def combine_kernel(
    OP, LP, stride_oph, stride_ops, stride_opm, stride_lph, stride_lps,
    O, stride_ol, stride_oh, NS, L,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    CHUNK_S: tl.constexpr,
):
    """One program per (KV head, query row, ``BLOCK_D`` channels): merge the NS split results by their base-2
    log-sum-exp. All split weights are loaded at once and the partial outputs in chunks of ``CHUNK_S`` splits
    (one chunk when ``BLOCK_S <= CHUNK_S``), so a program waits on memory about twice, not once per chunk."""
    kvh = tl.program_id(0)
    row = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    s_all = tl.arange(0, BLOCK_S)
    lse_base = LP + kvh * stride_lph + row
    lse = tl.load(lse_base + s_all * stride_lps, mask=s_all < NS, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no split saw a visible key (a finished row): the output is 0
    denom = tl.sum(tl.exp2(lse - m), 0)
    denom = tl.where(denom > 0, denom, 1.0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for c0 in range(0, NS, CHUNK_S):
        sc = c0 + tl.arange(0, CHUNK_S)
        ok = sc < NS
        w = tl.exp2(tl.load(lse_base + sc * stride_lps, mask=ok, other=float("-inf")) - m)
        o = tl.load(OP + kvh * stride_oph + sc[:, None] * stride_ops + row * stride_opm + d[None, :],
                    mask=ok[:, None], other=0.0)
        acc += tl.sum(o * w[:, None], 0)
    q_head = kvh * GROUP + row // L
    qi = row % L
    tl.store(O + qi * stride_ol + q_head * stride_oh + d, (acc / denom).to(O.dtype.element_ty))
