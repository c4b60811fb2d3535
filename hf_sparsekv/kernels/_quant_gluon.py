"""Gluon source of the tensor-core kernel for the quantized segment (see :mod:`hf_sparsekv.kernels.quant_gluon`,
which documents the index maps and launches it). Imported lazily, on CUDA only: Gluon kernels do not run under the
Triton interpreter."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

# The index chains (reshape to these shapes, then permute; see quant_gluon.key_channel / value_channel;
# tests/test_quant_gluon.py replays them on CPU).
@gluon.constexpr_function
def order(name):
    """The permutation of each chain:
    "key": code tiles [BLOCK, D/2] x (low, high nibble) -> [token, w, a, nibble, c, e] = operand column order;
    "channel": query rows / scales [D, rows] in stored order -> [w, a, nibble, c, e, row] = the same column order;
    "value": code pairs X_k joined to [BLOCK/2, D/2, k0, k1] -> [p, τ, i, k0, β, k1] = (token 2p + τ, stored
    channel); then [BLOCK, 8, D/8] is transposed to [D/8, 8, BLOCK]: operand row mu = 8x + r."""
    return list({"key": (0, 2, 3, 5, 1, 4), "channel": (1, 3, 4, 0, 2, 5), "value": (0, 3, 1, 4, 2, 5)}[name])


@gluon.constexpr_function
def key_tile_shape(block, head_dim):
    return [block, 4, head_dim // 32, 2, 2, 2]  # [token, c, w, a, e, nibble]


@gluon.constexpr_function
def channel_shape(head_dim, rows):
    return [4, head_dim // 32, 2, 2, 2, rows]  # [c, w, e, a, nibble, row]


@gluon.constexpr_function
def value_tile_shape(block, head_dim):
    return [block // 2, head_dim // 8, 2, 2, 2, 2]  # [p, i, β, τ, k0, k1]


# cp.async of a tile into shared memory: ``async_load`` from Triton 3.7 on, ``async_copy_global_to_shared`` before
async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

# ---- inline PTX: code bytes -> half-precision tensor-core operands --------------------------------------------------
# float16: a code c (< 1024) in the low bits of an otherwise zero half is the subnormal c·2^-24, exact, and the tensor
# cores multiply subnormal inputs exactly: the kernel masks codes into place and scales the float32 products by 2^24
# once (no subtraction per code). A high nibble masked in place reads as 16·c; its query channel (keys) or output
# row (values) carries the 1/16. bfloat16 cannot (c·2^-133 products would be float32 subnormals), so its codes go
# into the mantissa of 128.0 (c < 128) and one packed fma subtracts it; INT8's C up to 225 goes through float32.
# INT8's C = 14·upper + lower is one integer multiply-add on packed 16-bit lanes (C <= 225: no carry between lanes).
def _ptx_codes(out: list[str], sources: list[tuple[str, str | None, int]], int8: bool, dtype: str) -> list[str]:
    """``out[i]`` <- the two 16-bit lanes of codes at bit ``shift`` of register ``sources[i] = (upper, lower, shift)``
    as a half2 (float16: masked in place when ``shift`` is 0 or 4 and INT4, the high nibble then as 16·c)."""
    lines = []
    for dst, (up, lo, shift) in zip(out, sources):
        if dtype == "fp16" and not int8 and shift % 8 in (0, 4):
            lines.append(f"and.b32 {dst}, {up}, {'0x000f000f' if shift % 8 == 0 else '0x00f000f0'};")
            continue
        for reg, src in (("a", up), ("b", lo)) if int8 else (("a", up),):
            lines.append(f"shr.b32 {reg}, {src}, {shift};" if shift else f"mov.b32 {reg}, {src};")
        if not int8:  # bfloat16 INT4: into 128.0's mantissa
            lines += [f"lop3.b32 {dst}, a, m, g, 0xea;", f"fma.rn.bf16x2 {dst}, {dst}, one, neg;"]
            continue
        lines += ["and.b32 a, a, m;", "and.b32 b, b, m;", f"mad.lo.u32 {dst}, a, 14, b;"]
        if dtype == "bf16":  # 2^23 + C as float32, minus 2^23, two lanes into one bfloat16x2 (exact: C < 256)
            lines += [f"prmt.b32 x0, {dst}, k, 0x7610;", f"prmt.b32 x1, {dst}, k, 0x7632;",
                      "sub.f32 x0, x0, 0f4B000000;", "sub.f32 x1, x1, 0f4B000000;",
                      f"cvt.rn.bf16x2.f32 {dst}, x1, x0;"]
    return lines


def _wrap(lines: list[str]) -> str:
    consts = ("{\n.reg .b32 a, b, x0, x1, s, t, su, sl, tu, tl, m, g, one, neg, k;\nmov.b32 m, 0x000f000f;\n"
              "mov.b32 g, 0x43004300;\nmov.b32 one, 0x3f803f80;\nmov.b32 neg, 0xc300c300;\nmov.b32 k, 0x4b000000;\n")
    return consts + "\n".join(lines) + "\n}"


def key_ptx(int8: bool, dtype: str) -> str:
    """Keys: four code bytes of one token ($4; $5 its lower codes for INT8) -> half2 registers of bytes (0, 2)
    and (1, 3): low nibbles in $0, $1, high nibbles in $2, $3."""
    sources = [("$4", "$5", 0), ("$4", "$5", 8), ("$4", "$5", 4), ("$4", "$5", 12)]
    if dtype == "fp16" and not int8:
        return _wrap(["shr.b32 s, $4, 8;"] + _ptx_codes(["$0", "$1", "$2", "$3"],
                                                       [("$4", None, 0), ("s", None, 0), ("$4", None, 4),
                                                        ("s", None, 4)], int8, dtype))
    return _wrap(_ptx_codes(["$0", "$1", "$2", "$3"], sources, int8, dtype))


def value_ptx(int8: bool, dtype: str) -> str:
    """Values: four code bytes of an even token ($8) and of the next, odd one ($9) ($10, $11: their lower codes for
    INT8) -> half2 registers of (even, odd) codes of one channel: low nibbles of bytes 0..3 in $0..$3, high nibbles
    in $4..$7."""
    lines = ["prmt.b32 s, $8, $9, 0x5410;", "prmt.b32 t, $8, $9, 0x7632;"]  # bytes 0, 1 (2, 3) of both tokens
    if int8:
        lines += ["prmt.b32 sl, $10, $11, 0x5410;", "prmt.b32 tl, $10, $11, 0x7632;"]
    sources = [(u, lo, sh + nib) for nib in (0, 4) for u, lo in (("s", "sl"), ("t", "tl")) for sh in (0, 8)]
    # order: bytes 0, 1, 2, 3 (s, s >> 8, t, t >> 8), low nibbles, then high nibbles
    if dtype == "fp16" and not int8:
        lines += ["shr.b32 su, s, 8;", "shr.b32 tu, t, 8;"]
        sources = [(u, None, nib) for nib in (0, 4) for u in ("s", "su", "t", "tu")]
    return _wrap(lines + _ptx_codes([f"${i}" for i in range(8)], sources, int8, dtype))


PTX = gl.constexpr({(operand, int8, dtype): (key_ptx if operand == "key" else value_ptx)(int8, dtype)
                    for operand in ("key", "value") for int8 in (False, True) for dtype in ("fp16", "bf16")})


@gluon.constexpr_function
def code_ptx(operand, int8, dtype):
    """The PTX above for ``operand`` ("key" or "value"), view and operand dtype."""
    return PTX.value[operand, bool(int8), "fp16" if dtype == gl.float16 else "bf16"]


@gluon.constexpr_function
def key_bytes_layout(head_dim, block):
    """Key bytes ``[block, D/2]``: lane ``(r, c)`` (lane = 4r + c) holds tokens ``r + 8j`` and bytes
    ``[c·D/8, (c+1)·D/8)`` of each: one 16- or 8-byte vector per token."""
    bt = head_dim // 8
    tokens = [[8 << i, 0] for i in range((block // 8).bit_length() - 1)]
    regs = [[0, 1 << i] for i in range(bt.bit_length() - 1)] + tokens
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, bt], [0, 2 * bt], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[], block_bases=[], shape=[block, head_dim // 2])


@gluon.constexpr_function
def value_bytes_layout(head_dim, block):
    """Value bytes ``[block, D/2]``: lane ``(r, c)`` holds tokens ``2c + {0, 1} + 8j`` and bytes
    ``[r·D/16, (r+1)·D/16)`` of each (one 8- or 4-byte vector per token)."""
    bv = head_dim // 16
    tokens = [[8 << i, 0] for i in range((block // 8).bit_length() - 1)]
    regs = [[0, 1 << i] for i in range(bv.bit_length() - 1)] + [[1, 0]] + tokens
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[2, 0], [4, 0], [0, bv], [0, 2 * bv], [0, 4 * bv]],
                                      warp_bases=[], block_bases=[], shape=[block, head_dim // 2])


@gluon.jit
def _key_codes(ku, kl, INT8: gl.constexpr, DT: gl.constexpr):
    """uint8 ``[N, D/2]`` (``kl``: the lower codes, read for INT8) -> (low-nibble, high-nibble) codes in ``DT``,
    each ``[N, D/2]``."""
    return gl.inline_asm_elementwise(code_ptx("key", INT8, DT), "=r,=r,=r,=r,r,r", [ku, kl], dtype=(DT.value, DT.value),
                                     is_pure=True, pack=4)


@gluon.jit
def _value_codes(ue, uo, le, lo, INT8: gl.constexpr, DT: gl.constexpr):
    """uint8 ``[N/2, D/2]`` of the even and the odd tokens (``le``, ``lo``: their lower codes, read for INT8) ->
    four ``[N/2, D/2]`` tensors X0..X3 whose registers hold (even, odd) token pairs: ``X_k[p, 4i + 2β + τ]`` = code
    of token ``2p + τ``, byte ``4i + 2·(k % 2) + β``, nibble ``k // 2``."""
    return gl.inline_asm_elementwise(code_ptx("value", INT8, DT), "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [ue, uo, le, lo],
                                     dtype=(DT.value, DT.value, DT.value, DT.value), is_pure=True, pack=4)


@gluon.constexpr_function
def channels_layout(head_dim, rows):
    """Query rows / per-channel vectors ``[D, rows]`` in stored channel order: lane ``(r, c)`` holds row ``r + 8j``
    and channels ``[c·D/4, (c+1)·D/4)`` (the channels of its key bytes)."""
    regs = [[1 << i, 0] for i in range((head_dim // 4).bit_length() - 1)] + [
        [0, 8 << i] for i in range((rows // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[head_dim // 4, 0], [head_dim // 2, 0], [0, 1],
                                                                  [0, 2], [0, 4]],
                                      warp_bases=[], block_bases=[], shape=[head_dim, rows])


@gluon.jit
def _key_order(x, HEAD_DIM: gl.constexpr, ROWS: gl.constexpr):
    """``[D, ROWS]`` in stored channel order -> the key operand's column order (``key_channel`` in quant_gluon):
    channel ``2·(c·D/8 + 4w + 2e + a) + h`` becomes column ``32w + 16a + 8h + 2c + e``."""
    x = gl.permute(gl.reshape(x, channel_shape(HEAD_DIM, ROWS)), order("channel").value)
    return gl.reshape(x, [HEAD_DIM, ROWS])


@gluon.jit
def _value_channel(mu, HEAD_DIM: gl.constexpr):
    """The stored channel behind row ``mu`` of the value operand and of the output (``value_channel``)."""
    return (HEAD_DIM // 8) * (mu % 8) + mu // 8


@gluon.jit
def _copy_block(sk, skl, sv, svl, slot, ku_base, kl_base, vu_base, vl_base, n0, key_off, value_off, stride_kun,
                stride_vun, INT8: gl.constexpr, BLOCK: gl.constexpr):
    """cp.async of the codes of the block at token ``n0`` (a multiple of BLOCK) into ring slot ``slot``, as one
    group."""
    n0 = gl.multiple_of(n0, BLOCK)
    async_load(sk.index(slot), ku_base + n0 * stride_kun + key_off)
    async_load(sv.index(slot), vu_base + n0 * stride_vun + value_off)
    if INT8:
        async_load(skl.index(slot), kl_base + n0 * stride_kun + key_off)
        async_load(svl.index(slot), vl_base + n0 * stride_vun + value_off)
    async_copy.commit_group()


@gluon.jit
def _group_query(q, ks_base, kz_base, g, stride_ksg, ch, k_unit, scale_log2, ZOFF: gl.constexpr,
                 HEAD_DIM: gl.constexpr, N_ROWS: gl.constexpr, DT: gl.constexpr, b_op: gl.constexpr,
                 rows_l: gl.constexpr):
    """Key group ``g``: the keys' B operand ``(q ⊙ s·unit)`` in operand order, and the rows' bias ``q·z``
    (base-2 logits)."""
    ks = gl.load(ks_base + g * stride_ksg + ch).to(gl.float32)
    kz = gl.load(kz_base + g * stride_ksg + ch).to(gl.float32)
    q = q.to(gl.float32)
    q_op = gl.convert_layout(_key_order((q * (ks * k_unit)[:, None]).to(DT), HEAD_DIM, N_ROWS), b_op,
                             assert_trivial=True)
    kbias = gl.convert_layout(gl.sum(q * (kz + ZOFF * ks)[:, None], axis=0) * scale_log2, rows_l)
    return q_op, kbias


@gluon.jit
def _block(ku, kl, vu, vl, vs, vz, q_op, kbias, s_scale, m_i, l_i, vbias, acc,
           P_UNIT: gl.constexpr, ZOFF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, N_ROWS: gl.constexpr,
           INT8: gl.constexpr, DT: gl.constexpr, a_op: gl.constexpr, b_op: gl.constexpr, mma: gl.constexpr):
    """One block of BLOCK tokens: scores, online softmax, and the value product into ``acc`` (the value operand is
    ``p ⊙ s_v·P_UNIT``)."""
    HB: gl.constexpr = HEAD_DIM // 2
    k_lo, k_hi = _key_codes(ku, kl, INT8, DT)
    # [BLOCK, HB] x2 -> [BLOCK, D]; register slot s = 2a + e of word w of lane c holds true byte c·D/8 + 4w + 2e + a
    # (the PTX pairs bytes 0, 2 and 1, 3)
    k = gl.reshape(gl.join(k_lo, k_hi), key_tile_shape(BLOCK, HEAD_DIM))
    k = gl.reshape(gl.permute(k, order("key").value), [BLOCK, HEAD_DIM])
    k = gl.convert_layout(k, a_op, assert_trivial=True)
    s = mma_v2(k, q_op, gl.zeros([BLOCK, N_ROWS], gl.float32, layout=mma))
    s = s * s_scale + kbias[None, :]
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[None, :])
    l_i = l_i * alpha + gl.sum(p, axis=0)
    vbias = vbias * alpha + gl.sum(p * (vz + ZOFF * vs)[:, None], axis=0)
    p_op = gl.convert_layout((p * (vs * P_UNIT)[:, None]).to(DT), b_op)  # [BLOCK, N_ROWS]
    # value bytes -> [D, BLOCK], row mu = stored channel value_channel(mu)
    ue, uo = gl.split(gl.permute(gl.reshape(vu, [BLOCK // 2, 2, HB]), [0, 2, 1]))
    le, lo = gl.split(gl.permute(gl.reshape(vl, [BLOCK // 2, 2, HB]), [0, 2, 1]))
    x0, x1, x2, x3 = _value_codes(ue, uo, le, lo, INT8, DT)
    v = gl.join(gl.join(x0, x1), gl.join(x2, x3))  # [p, HB, k0, k1]
    v = gl.permute(gl.reshape(v, value_tile_shape(BLOCK, HEAD_DIM)), order("value").value)  # token 2p + τ, channel
    v = gl.reshape(v, [BLOCK, 8, HEAD_DIM // 8])  # stored channel = (D/8)·r + x
    v = gl.reshape(gl.permute(v, [2, 1, 0]), [HEAD_DIM, BLOCK])  # row mu = 8·x + r
    v = gl.convert_layout(v, a_op, assert_trivial=True)
    acc = mma_v2(v, p_op, acc * alpha[None, :])
    return m_new, l_i, vbias, acc


@gluon.jit
def quant_split_kernel(
    Q, stride_qh, stride_ql,
    KU, KL, stride_kuh, stride_kun, KS, KZ, stride_ksh, stride_ksg,
    VU, VL, stride_vuh, stride_vun, VS, VZ, stride_vsh, stride_vsn, T_Q,
    OP, LP, stride_oph, stride_ops, stride_opm, stride_lph, stride_lps,
    scale_log2, L, QSPLIT_TOKENS, T_PTR, ROW_HEADS,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, N_ROWS: gl.constexpr, BLOCK: gl.constexpr,
    KEY_GROUP: gl.constexpr, INT8: gl.constexpr, DT: gl.constexpr, LENGTHS_ON_DEVICE: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warp per (row block, split, KV head): the quantized tokens ``[start, end)`` of the split against
    ``N_ROWS`` query rows, written as a partial output and its base-2 log-sum-exp, as the Triton split kernel does
    for its splits. Swapped operands: tokens are the MMA's M side, query rows its N side.

    * keys: ``S^T [BLOCK, N_ROWS] = codes [BLOCK, D] @ (q ⊙ s·CF)^T [D, N_ROWS] + q·z``;
    * values: ``O^T [D, N_ROWS] += codes^T [D, BLOCK] @ (p ⊙ s_v·CF·PV) [BLOCK, N_ROWS]``, ``+ Σ p z_v`` per row
      (PV = 2^8 in float16, divided out at the output).
    Code tiles are loaded as 16- or 8-byte vectors straight into the registers of the MMA operand layout (every
    ``convert_layout`` on them is checked to move no data); the operand columns (keys) and rows (values) are stored
    channels in a fixed permutation, undone on the query's side (keys) and on the output's (values). Token ranges
    are whole key groups (the launcher's splits are multiples of KEY_GROUP, and so is T_Q)."""
    gl.static_assert(HEAD_DIM == 64 or HEAD_DIM == 128)
    gl.static_assert(KEY_GROUP % BLOCK == 0)
    gl.static_assert(STAGES >= 2)
    HB: gl.constexpr = HEAD_DIM // 2  # code bytes per token
    if INT8:
        CF: gl.constexpr = 1.0 / 14.0  # dequantized = (z + ZOFF·s) + (s·CF)·C, C = 14·upper + stored lower
        ZOFF: gl.constexpr = -8.0 / 14.0
    else:
        CF: gl.constexpr = 1.0
        ZOFF: gl.constexpr = 0.0
    if DT == gl.float16:
        UNIT: gl.constexpr = 16777216.0  # codes enter the MMA as subnormals c·2^-24
        PV: gl.constexpr = 256.0  # p·s_v·CF enters the value MMA scaled by 2^8, off float16's subnormals (the
        # Triton kernel's PV); the output's unit divides it out
    else:
        UNIT: gl.constexpr = 1.0
        PV: gl.constexpr = 1.0
    HI16: gl.constexpr = DT == gl.float16 and not INT8  # high-nibble codes enter as 16·c

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    key_bytes: gl.constexpr = key_bytes_layout(HEAD_DIM, BLOCK)
    value_bytes: gl.constexpr = value_bytes_layout(HEAD_DIM, BLOCK)
    chan: gl.constexpr = channels_layout(HEAD_DIM, N_ROWS)
    rows_l: gl.constexpr = gl.SliceLayout(0, mma)  # [N_ROWS]: the accumulators' columns
    toks_l: gl.constexpr = gl.SliceLayout(1, mma)  # [BLOCK]: S^T's rows

    pid_s = gl.program_id(1)
    kvh = gl.program_id(2)
    if LENGTHS_ON_DEVICE:  # T_Q was the capacity (it sized the grid): the splits share the current length
        T_Q = gl.load(T_PTR + kvh // ROW_HEADS)
        QSPLIT_TOKENS = gl.cdiv(gl.cdiv(T_Q, gl.num_programs(1)), KEY_GROUP) * KEY_GROUP
    start = pid_s * QSPLIT_TOKENS
    end = gl.minimum(start + QSPLIT_TOKENS, T_Q)

    # query rows in stored channel order (in the query dtype: exact), and the high-nibble channels' 1/16
    ch = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, chan))
    n_c = gl.program_id(0) * N_ROWS + gl.arange(0, N_ROWS, layout=gl.SliceLayout(0, chan))
    q_ptrs = Q + ((kvh * GROUP + n_c // L) * stride_qh + (n_c % L) * stride_ql)[None, :] + ch[:, None]
    q = gl.load(q_ptrs, mask=(n_c < GROUP * L)[None, :], other=0.0)  # kept in the query dtype (exact)
    if HI16:
        k_unit = gl.where(ch % 2 == 1, CF / 16.0, CF)
    else:
        k_unit = gl.full([HEAD_DIM], CF, gl.float32, layout=gl.SliceLayout(1, chan))

    tok_k = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, key_bytes))
    byte_k = gl.arange(0, HB, layout=gl.SliceLayout(0, key_bytes))
    key_off = tok_k[:, None] * stride_kun + byte_k[None, :]
    tok_v = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, value_bytes))
    byte_v = gl.arange(0, HB, layout=gl.SliceLayout(0, value_bytes))
    value_off = tok_v[:, None] * stride_vun + byte_v[None, :]
    tok_s = gl.arange(0, BLOCK, layout=toks_l)

    ku_base = KU + kvh * stride_kuh
    kl_base = KL + kvh * stride_kuh
    vu_base = VU + kvh * stride_vuh
    vl_base = VL + kvh * stride_vuh
    ks_base = KS + kvh * stride_ksh
    kz_base = KZ + kvh * stride_ksh
    vs_base = VS + kvh * stride_vsh
    vz_base = VZ + kvh * stride_vsh
    s_scale = scale_log2 * UNIT

    m_i = gl.full([N_ROWS], -1.0e30, gl.float32, layout=rows_l)
    l_i = gl.zeros([N_ROWS], gl.float32, layout=rows_l)
    vbias = gl.zeros([N_ROWS], gl.float32, layout=rows_l)
    acc = gl.zeros([HEAD_DIM, N_ROWS], gl.float32, layout=mma)
    # a ring of STAGES blocks in shared memory, filled by cp.async ahead of the block computed
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    sk = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK, HB], flat)
    sv = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK, HB], flat)
    if INT8:
        skl = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK, HB], flat)
        svl = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK, HB], flat)
    else:
        skl = sk
        svl = sv
    q_op = gl.zeros([HEAD_DIM, N_ROWS], DT, layout=b_op)
    kbias = gl.zeros([N_ROWS], gl.float32, layout=rows_l)
    for i in gl.static_range(STAGES - 1):  # prologue: blocks 0 .. STAGES - 2 (clamped: a short split reloads)
        n = gl.minimum(start + i * BLOCK, gl.maximum(end - BLOCK, 0))
        _copy_block(sk, skl, sv, svl, i, ku_base, kl_base, vu_base, vl_base, n, key_off, value_off, stride_kun,
                    stride_vun, INT8, BLOCK)
    vs_n = gl.load(vs_base + (start + tok_s) * stride_vsn, mask=start + tok_s < end, other=0.0)
    vz_n = gl.load(vz_base + (start + tok_s) * stride_vsn, mask=start + tok_s < end, other=0.0)
    slot = 0
    for n0 in range(start, end, BLOCK):
        if n0 % KEY_GROUP == 0:
            q_op, kbias = _group_query(q, ks_base, kz_base, n0 // KEY_GROUP, stride_ksg, ch, k_unit, scale_log2,
                                       ZOFF, HEAD_DIM, N_ROWS, DT, b_op, rows_l)
        async_copy.wait_group(STAGES - 2)  # this block has landed
        ku = sk.index(slot).load(key_bytes)
        kl = skl.index(slot).load(key_bytes)
        vu = sv.index(slot).load(value_bytes)
        vl = svl.index(slot).load(value_bytes)
        vs = vs_n.to(gl.float32)
        vz = vz_n.to(gl.float32)
        nxt = n0 + BLOCK + tok_s  # the next block's value scales, a block ahead in registers
        vs_n = gl.load(vs_base + nxt * stride_vsn, mask=nxt < end, other=0.0)
        vz_n = gl.load(vz_base + nxt * stride_vsn, mask=nxt < end, other=0.0)
        ahead = (slot + STAGES - 1) % STAGES  # the slot read one block ago
        n = gl.minimum(n0 + (STAGES - 1) * BLOCK, gl.maximum(end - BLOCK, 0))
        _copy_block(sk, skl, sv, svl, ahead, ku_base, kl_base, vu_base, vl_base, n, key_off, value_off,
                    stride_kun, stride_vun, INT8, BLOCK)
        m_i, l_i, vbias, acc = _block(ku, kl, vu, vl, vs, vz, q_op, kbias, s_scale, m_i, l_i, vbias, acc, CF * PV,
                                      ZOFF, HEAD_DIM, BLOCK, N_ROWS, INT8, DT, a_op, b_op, mma)
        slot = (slot + 1) % STAGES
    async_copy.wait_group(0)

    mu = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, mma))
    o_ch = _value_channel(mu, HEAD_DIM)
    if HI16:
        o_unit = gl.where(o_ch % 2 == 1, UNIT / (16.0 * PV), UNIT / PV)
    else:
        o_unit = gl.full([HEAD_DIM], UNIT / PV, gl.float32, layout=gl.SliceLayout(1, mma))
    has = l_i > 0
    inv = 1.0 / gl.where(has, l_i, 1.0)
    out = (acc * o_unit[:, None] + vbias[None, :]) * inv[None, :]
    n_o = gl.program_id(0) * N_ROWS + gl.arange(0, N_ROWS, layout=rows_l)
    ok_o = n_o < GROUP * L
    o_ptrs = OP + kvh * stride_oph + pid_s * stride_ops + n_o[None, :] * stride_opm + o_ch[:, None]
    gl.store(o_ptrs, out, mask=ok_o[None, :])
    lse = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
    gl.store(LP + kvh * stride_lph + pid_s * stride_lps + n_o, lse, mask=ok_o)
