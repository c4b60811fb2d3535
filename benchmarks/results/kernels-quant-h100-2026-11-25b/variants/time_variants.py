"""Dot-path variants at the Llama-3-8B shape: base, token-blocked value codes (vt), raw codes, both. Interleaved, median."""
import sys, statistics, json
sys.path.insert(0, "benchmarks")
import torch
from kernels import Timer, sdpa_flash
from hf_sparsekv.kernels import decode_core
from hf_sparsekv.kernels.quant_reference import QuantizedTensor
from hf_sparsekv.kernels.quantize import quantize_keys, quantize_values
from hf_sparsekv.kernels.quant_attention import quant_decode_attention_reference

def blocked(qt):
    h, t, half = qt.upper.shape[1:]
    f = lambda c: c.view(1, h, t // 16, 16, half).transpose(-1, -2).contiguous()
    return QuantizedTensor(f(qt.upper), f(qt.lower), qt.scale, qt.zero)

timer = Timer(20)
VARIANTS = {"base": (False, {}), "vt": (True, {}), "raw": (False, {"raw_codes": True}), "vt+raw": (True, {"raw_codes": True})}
res = {}
for ctx in (65536, 131072):
    for dt in (torch.float16, torch.bfloat16):
        hq, hkv, d = 32, 8, 128
        t = ctx - 128
        k = torch.randn(1, hkv, ctx, d, device="cuda", dtype=dt); v = torch.randn_like(k)
        q = torch.randn(1, hq, 1, d, device="cuda", dtype=dt)
        qk, qv = quantize_keys(k[:, :, :t].contiguous(), 128), quantize_values(v[:, :, :t].contiguous())
        qvb = blocked(qv)
        bk, bv = k[:, :, t:].contiguous(), v[:, :, t:].contiguous()
        sd = timer.gpu_ms(lambda: sdpa_flash(q, k, v, d ** -0.5))
        for int8 in (False, True):
            ref = quant_decode_attention_reference(q, qk, qv, bk, bv, 128, int8, d ** -0.5).float()
            times = {n: [] for n in VARIANTS}
            err = 0.0
            for rep in range(3):
                for name, (vt, cfg) in VARIANTS.items():
                    with decode_core.quant_config(**cfg):
                        fn = lambda: decode_core.launch_decode(q, d ** -0.5, bk, bv, quant=(qk, qvb if vt else qv), group_size=128, int8=int8)
                        out = fn().float()
                        err = max(err, ((out - ref).norm() / ref.norm()).item())
                        times[name].append(timer.gpu_ms(fn))
            key = f"{ctx//1024}K {str(dt)[6:]} {'int8' if int8 else 'int4'}"
            med = {n: statistics.median(x) for n, x in times.items()}
            res[key] = dict(sdpa=sd, **med)
            print(f"{key:22} sdpa {sd:.4f} | " + " | ".join(f"{n} {m:.4f} ({sd/m:.2f}x)" for n, m in med.items()) + f" | err {err:.1e}", flush=True)
        del k, v, qk, qv, qvb
json.dump(res, open(sys.argv[1] if len(sys.argv) > 1 else "variants.json", "w"), indent=1)
