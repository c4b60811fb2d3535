"""Triton source of the hierarchical quantize/pack kernels (launched and documented by
:mod:`hf_sparsekv.kernels.quantize`). Imported lazily (imports Triton, reads ``TRITON_INTERPRET``)."""

import triton
import triton.language as tl


@triton.jit
def _round_half_even(y):
    """``torch.round`` (ties to even) of float32 ``y``, exactly: floor, then the fractional part decides."""
    r = tl.floor(y)
    f = y - r
    up = (f > 0.5) | ((f == 0.5) & ((r % 2.0) != 0.0))
    return tl.where(up, r + 1.0, r)


@triton.jit
def _outward_params(mn, mx, STORE: tl.constexpr, INT: tl.constexpr, NEG_TINY: tl.constexpr):
    """Zero point rounded down and scale rounded up in the storage dtype (see quant_reference._outward_params).
    ``nextafter`` is done on the bit pattern: one ulp towards -inf (zero point) or +inf (scale)."""
    z = mn.to(STORE)
    zf = z.to(tl.float32)
    zb = z.to(INT, bitcast=True)
    down = tl.where(zf > 0.0, zb - 1, tl.where(zf < 0.0, zb + 1, NEG_TINY)).to(INT)
    z = tl.where(zf > mn, down.to(STORE, bitcast=True), z)
    zf = z.to(tl.float32)
    s = tl.div_rn(mx - zf, tl.full(mx.shape, 15.0, tl.float32)).to(STORE)
    sf = s.to(tl.float32)
    sb = s.to(INT, bitcast=True)
    up = tl.where(sf > 0.0, sb + 1, tl.where(sf < 0.0, sb - 1, 1)).to(INT)
    s = tl.where(zf + 15.0 * sf < mx, up.to(STORE, bitcast=True), s)
    sf = s.to(tl.float32)
    sf = tl.where(sf > 0.0, sf, 1.0)
    return sf, zf


@triton.jit
def _codes(x, sf, zf):
    """Upper codes 0..15 and lower codes offset by 8 (1..15), as uint8, for float32 ``x`` and broadcastable params."""
    cu = _round_half_even(tl.div_rn(x - zf, sf))
    cu = tl.minimum(tl.maximum(cu, 0.0), 15.0)
    residual = x - (zf + sf * cu)
    cl = _round_half_even(tl.div_rn(residual * 14.0, sf))
    cl = tl.minimum(tl.maximum(cl, -7.0), 7.0) + 8.0
    return cu.to(tl.int32).to(tl.uint8), cl.to(tl.int32).to(tl.uint8)


@triton.jit
def quantize_keys_kernel(
    X, stride_xh, stride_xt,
    U, L, stride_uh, stride_ut,
    S, Z, stride_sh, stride_sg,
    GROUP_SIZE,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
    STORE: tl.constexpr, INT: tl.constexpr, NEG_TINY: tl.constexpr,
):
    """One program: one head, one group of GROUP_SIZE tokens, BLOCK_C channel pairs (channels 2c and 2c+1)."""
    h = tl.program_id(0)
    g = tl.program_id(1)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    r = tl.arange(0, BLOCK_G)
    r_ok = r < GROUP_SIZE
    t = g * GROUP_SIZE + r
    base = X + h * stride_xh + t[:, None] * stride_xt
    x_e = tl.load(base + 2 * c[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32)
    x_o = tl.load(base + 2 * c[None, :] + 1, mask=r_ok[:, None], other=0.0).to(tl.float32)
    inf = float("inf")
    s_e, z_e = _outward_params(
        tl.min(tl.where(r_ok[:, None], x_e, inf), 0), tl.max(tl.where(r_ok[:, None], x_e, -inf), 0), STORE, INT, NEG_TINY
    )
    s_o, z_o = _outward_params(
        tl.min(tl.where(r_ok[:, None], x_o, inf), 0), tl.max(tl.where(r_ok[:, None], x_o, -inf), 0), STORE, INT, NEG_TINY
    )
    cu_e, cl_e = _codes(x_e, s_e[None, :], z_e[None, :])
    cu_o, cl_o = _codes(x_o, s_o[None, :], z_o[None, :])
    out = h * stride_uh + t[:, None] * stride_ut + c[None, :]
    tl.store(U + out, cu_e | (cu_o << 4), mask=r_ok[:, None])
    tl.store(L + out, cl_e | (cl_o << 4), mask=r_ok[:, None])
    p = h * stride_sh + g * stride_sg + 2 * c
    tl.store(S + p, s_e.to(STORE))
    tl.store(S + p + 1, s_o.to(STORE))
    tl.store(Z + p, z_e.to(STORE))
    tl.store(Z + p + 1, z_o.to(STORE))


@triton.jit
def quantize_values_kernel(
    X, stride_xh, stride_xt,
    U, L, stride_uh, stride_ut,
    S, Z, stride_sh, stride_st,
    T,
    HALF: tl.constexpr, BLOCK_T: tl.constexpr,
    STORE: tl.constexpr, INT: tl.constexpr, NEG_TINY: tl.constexpr,
):
    """One program: one head, BLOCK_T tokens, each quantized over its HALF channel pairs."""
    h = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    c = tl.arange(0, HALF)
    base = X + h * stride_xh + t[:, None] * stride_xt
    x_e = tl.load(base + 2 * c[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
    x_o = tl.load(base + 2 * c[None, :] + 1, mask=t_ok[:, None], other=0.0).to(tl.float32)
    mn = tl.minimum(tl.min(x_e, 1), tl.min(x_o, 1))
    mx = tl.maximum(tl.max(x_e, 1), tl.max(x_o, 1))
    s, z = _outward_params(mn, mx, STORE, INT, NEG_TINY)
    cu_e, cl_e = _codes(x_e, s[:, None], z[:, None])
    cu_o, cl_o = _codes(x_o, s[:, None], z[:, None])
    out = h * stride_uh + t[:, None] * stride_ut + c[None, :]
    tl.store(U + out, cu_e | (cu_o << 4), mask=t_ok[:, None])
    tl.store(L + out, cl_e | (cl_o << 4), mask=t_ok[:, None])
    p = h * stride_sh + t * stride_st
    tl.store(S + p, s.to(STORE), mask=t_ok)
    tl.store(Z + p, z.to(STORE), mask=t_ok)
