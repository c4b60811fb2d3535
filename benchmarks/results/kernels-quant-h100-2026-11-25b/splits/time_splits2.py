"""Split rules for the tensor-core path: old (16/SM, >=1024), fill, 4/SM >= 64, 4/SM >= 256."""
import sys, statistics, json
sys.path.insert(0, "benchmarks")
import torch
from kernels import Timer
from hf_sparsekv.kernels import decode_core
from hf_sparsekv.kernels.quantize import quantize_keys, quantize_values

timer = Timer(20)
RULES = {"old": dict(fill_sms=False), "fill": dict(fill_sms=True), "4/SM>=64": dict(fill_sms=False, dot_programs_per_sm=4, dot_min_split=64),
         "4/SM>=256": dict(fill_sms=False, dot_programs_per_sm=4, dot_min_split=256), "8/SM>=64": dict(fill_sms=False, dot_programs_per_sm=8, dot_min_split=64)}
out = {}
for (name, hq, hkv, d, dt) in (("bundled", 4, 2, 64, torch.bfloat16), ("llama3-8b", 32, 8, 128, torch.float16)):
    for ctx in ((2048, 4096, 16384, 65536) if name == "bundled" else (4096, 16384, 65536, 131072)):
        t = ctx - 128
        k = torch.randn(1, hkv, ctx, d, device="cuda", dtype=dt); v = torch.randn_like(k)
        qk, qv = quantize_keys(k[:, :, :t].contiguous(), 128), quantize_values(v[:, :, :t].contiguous())
        bk, bv = k[:, :, t:].contiguous(), v[:, :, t:].contiguous()
        for L, int8 in ((1, False), (6, True)):
            q = torch.randn(1, hq, L, d, device="cuda", dtype=dt)
            times = {r: [] for r in RULES}
            for rep in range(3):
                for r, cfg in RULES.items():
                    with decode_core.quant_config(**cfg):
                        fn = lambda: decode_core.launch_decode(q, d ** -0.5, bk, bv, quant=(qk, qv), group_size=128, int8=int8)
                        times[r].append(timer.gpu_ms(fn))
            med = {r: statistics.median(x) for r, x in times.items()}
            key = f"{name} {ctx // 1024}K L={L} {'int8' if int8 else 'int4'}"
            out[key] = med
            print(f"{key:28} " + " | ".join(f"{r} {m * 1000:.1f}" for r, m in med.items()), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
