"""Full-precision (chunk / window) decode kernel: splits as now (>= 256 tokens) against filled to 4 programs per SM."""
import sys, statistics, json
sys.path.insert(0, "benchmarks")
import torch
from kernels import Timer
from hf_sparsekv.kernels import decode_core
from hf_sparsekv.kernels.reference import masked_attention_reference

timer = Timer(20)
orig = decode_core._split_tokens
def filled(tokens, pps, block, device, min_tokens, per_sm=4, fill_per_sm=0):
    return orig(tokens, pps, block, device, min_tokens, per_sm, 4)
out = {}
for name, hq, hkv, d, dt in (("bundled", 4, 2, 64, torch.bfloat16), ("llama3-8b", 32, 8, 128, torch.float16), ("llama2-7b", 32, 32, 128, torch.float16)):
    for s in (256, 1024, 2048, 4096):
        for L in (1, 6):
            k = torch.randn(1, hkv, s, d, device="cuda", dtype=dt); v = torch.randn_like(k)
            q = torch.randn(1, hq, L, d, device="cuda", dtype=dt)
            length = torch.tensor([s], dtype=torch.int32, device="cuda")
            fn = lambda: decode_core.launch_decode(q, d ** -0.5, k, v, fp_length=length)
            times = {"now": [], "fill4": []}
            for rep in range(3):
                for rule in times:
                    decode_core._split_tokens = filled if rule == "fill4" else orig
                    times[rule].append(timer.gpu_ms(fn))
            decode_core._split_tokens = orig
            a = decode_core.launch_decode(q, d ** -0.5, k, v, fp_length=length).float()
            decode_core._split_tokens = filled
            b = decode_core.launch_decode(q, d ** -0.5, k, v, fp_length=length).float()
            decode_core._split_tokens = orig
            med = {r: statistics.median(x) for r, x in times.items()}
            key = f"{name} S={s} L={L}"
            out[key] = dict(med, diff=(a - b).abs().max().item())
            print(f"{key:26} now {med['now']*1000:.1f} us | fill4 {med['fill4']*1000:.1f} us | max diff {out[key]['diff']:.1e}", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
