"""GPU: the Gluon quantized kernel against the float32 reference and the Triton kernel; then timings."""
import itertools, sys, time, torch
sys.path.insert(0, ".")
from hf_sparsekv.kernels import decode_core
from hf_sparsekv.kernels.quant_attention import quant_decode_attention, quant_decode_attention_reference
from hf_sparsekv.kernels.quantize import quantize_keys, quantize_values
from hf_sparsekv.kernels.quant_reference import QuantizedTensor

def f32(qt): return QuantizedTensor(qt.upper, qt.lower, qt.scale.float(), qt.zero.float())
def rel(a, b): return ((a.float() - b.float()).norm() / b.float().norm()).item()

fails = 0
for dtype, (hq, hkv, d), L, t_q, int8 in itertools.product(
        (torch.float16, torch.bfloat16), ((32, 8, 128), (32, 32, 128), (4, 2, 64), (28, 4, 128), (16, 2, 64)),
        (1, 6), (128, 384, 4096), (False, True)):
    g = torch.Generator().manual_seed(t_q + L)
    q = torch.randn(1, hq, L, d, generator=g).to("cuda", dtype)
    k = (torch.randn(1, hkv, t_q + 40, d, generator=g) * 1.5 + 0.3).to("cuda", dtype)
    v = torch.randn(1, hkv, t_q + 40, d, generator=g).to("cuda", dtype)
    qk, qv = quantize_keys(k[:, :, :t_q], 128), quantize_values(v[:, :, :t_q])
    ref = quant_decode_attention_reference(q, f32(qk), f32(qv), k[:, :, t_q:], v[:, :, t_q:], 128, int8, d**-0.5)
    outs = {}
    for kern in (("gluon",) + (("triton",) if "--triton" in sys.argv else ())):
        with decode_core.quant_config(kernel=kern):
            try:
                outs[kern] = rel(quant_decode_attention(q, qk, qv, k[:, :, t_q:], v[:, :, t_q:], 128, int8, d**-0.5), ref)
            except Exception as e:
                outs[kern] = f"ERR {type(e).__name__}: {str(e)[:300]}"
    bad = not isinstance(outs["gluon"], float) or outs["gluon"] > 2e-2
    fails += bad
    print(f"{'FAIL' if bad else 'ok  '} {str(dtype)[6:]:8s} {hq}x{hkv}x{d} L={L} t_q={t_q:5d} int8={int8:d}  gluon {outs['gluon']}  triton {outs.get('triton')}", flush=True)
print("FAILS", fails)
