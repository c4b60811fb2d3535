"""Occupancy knobs of the quantized kernel: fp-part pipelining off (fp_stages=1), quant pipelining depth, maxnreg.
Both shapes, fp16/bf16, INT4/INT8, q=1; each config checked against the float32 reference; interleaved, median of 3."""
import sys, statistics, json
sys.path.insert(0, "benchmarks")
import torch
from kernels import Timer, sdpa_flash
from hf_sparsekv.kernels import decode_core
from hf_sparsekv.kernels.quant_reference import QuantizedTensor
from hf_sparsekv.kernels.quantize import quantize_keys, quantize_values
from hf_sparsekv.kernels.quant_attention import quant_decode_attention_reference, quant_decode_attention

CONFIGS = {
    "base": {},
    "fp1": dict(fp_stages=1),
    "fp1 s2": dict(fp_stages=1, num_stages=2),
    "fp1 r168": dict(fp_stages=1, maxnreg=168),
    "fp1 s2 r168": dict(fp_stages=1, num_stages=2, maxnreg=168),
    "fp1 s2 r128": dict(fp_stages=1, num_stages=2, maxnreg=128),
}
f32 = lambda qt: QuantizedTensor(qt.upper, qt.lower, qt.scale.float(), qt.zero.float())
timer = Timer(20)
res = {}
ctxs = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "65536").split(",")]
dtypes = [getattr(torch, x) for x in (sys.argv[3] if len(sys.argv) > 3 else "float16").split(",")]
for ctx in ctxs:
    for dt in dtypes:
        for shape, (hq, hkv, d) in {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128)}.items():
            t = ctx - 128
            k = torch.randn(1, hkv, ctx, d, device="cuda", dtype=dt); v = torch.randn_like(k)
            q = torch.randn(1, hq, 1, d, device="cuda", dtype=dt)
            qk, qv = quantize_keys(k[:, :, :t].contiguous(), 128), quantize_values(v[:, :, :t].contiguous())
            bk, bv = k[:, :, t:].contiguous(), v[:, :, t:].contiguous()
            sd = timer.gpu_ms(lambda: sdpa_flash(q, k, v, d ** -0.5))
            for int8 in (False, True):
                ref = quant_decode_attention_reference(q.float(), f32(qk), f32(qv), bk.float(), bv.float(), 128, int8, d ** -0.5)
                times, errs = {n: [] for n in CONFIGS}, {}
                for rep in range(3):
                    for name, cfg in CONFIGS.items():
                        with decode_core.quant_config(**cfg):
                            fn = lambda: quant_decode_attention(q, qk, qv, bk, bv, 128, int8, d ** -0.5)
                            if rep == 0:
                                out = fn().float()
                                errs[name] = ((out - ref).norm() / ref.norm()).item()
                            times[name].append(timer.gpu_ms(fn))
                key = f"{shape} {ctx // 1024}K {str(dt)[6:]} {'int8' if int8 else 'int4'}"
                med = {n: statistics.median(x) for n, x in times.items()}
                res[key] = dict(sdpa=sd, ms=med, err=errs)
                print(f"{key:30} sdpa {sd*1000:.1f} | " + " | ".join(f"{n} {m*1000:.1f} ({sd/m:.2f}x)" for n, m in med.items())
                      + f" | max err {max(errs.values()):.1e}", flush=True)
            del k, v, qk, qv, bk, bv
json.dump(res, open(sys.argv[1], "w"), indent=1)
