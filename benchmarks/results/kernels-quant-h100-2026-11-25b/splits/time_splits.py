"""Split rule at small shapes: bundled verifier (4 q / 2 KV heads, d=64) and Llama-3-8B; plus per-variant errors."""
import sys, statistics, json
sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".dev")
import torch
from kernels import Timer
from hf_sparsekv.kernels import decode_core
from hf_sparsekv.kernels.quantize import quantize_keys, quantize_values
from hf_sparsekv.kernels.quant_attention import quant_decode_attention_reference
from time_variants_lib import blocked

timer = Timer(20)
out = {}
# 1. errors per variant (fp16 int4, Llama-3 shape, 64K)
hq, hkv, d, ctx = 32, 8, 128, 65536
t = ctx - 128
k = torch.randn(1, hkv, ctx, d, device="cuda", dtype=torch.float16); v = torch.randn_like(k)
q = torch.randn(1, hq, 1, d, device="cuda", dtype=torch.float16)
qk, qv = quantize_keys(k[:, :, :t].contiguous(), 128), quantize_values(v[:, :, :t].contiguous())
bk, bv = k[:, :, t:].contiguous(), v[:, :, t:].contiguous()
for int8 in (False, True):
    ref = quant_decode_attention_reference(q, qk, qv, bk, bv, 128, int8, d ** -0.5).float()
    for name, vt, cfg in (("base", False, {}), ("vt", True, {}), ("raw", False, {"raw_codes": True})):
        with decode_core.quant_config(**cfg):
            o = decode_core.launch_decode(q, d ** -0.5, bk, bv, quant=(qk, blocked(qv) if vt else qv), group_size=128, int8=int8).float()
        e = ((o - ref).norm() / ref.norm()).item()
        out[f"err {name} {'int8' if int8 else 'int4'}"] = e
        print(f"64K fp16 {'int8' if int8 else 'int4'} {name}: rel err {e:.2e}", flush=True)
del k, v, qk, qv, bk, bv
# 2. split rules
RULES = {"1024 (old)": dict(fill_sms=False), "1024+fill": dict(fill_sms=True), "512": dict(fill_sms=False, dot_min_split=512), "256": dict(fill_sms=False, dot_min_split=256)}
for (name, hq, hkv, d, dt) in (("bundled", 4, 2, 64, torch.bfloat16), ("llama3-8b", 32, 8, 128, torch.float16)):
    for ctx in ((4096, 16384, 65536) if name == "bundled" else (16384, 65536)):
        t = ctx - 128
        k = torch.randn(1, hkv, ctx, d, device="cuda", dtype=dt); v = torch.randn_like(k)
        qk, qv = quantize_keys(k[:, :, :t].contiguous(), 128), quantize_values(v[:, :, :t].contiguous())
        bk, bv = k[:, :, t:].contiguous(), v[:, :, t:].contiguous()
        for L, int8 in ((1, False), (6, True)):
            q = torch.randn(1, hq, L, d, device="cuda", dtype=dt)
            bq = bk.clone(); bvv = bv.clone()
            times = {r: [] for r in RULES}
            for rep in range(3):
                for r, cfg in RULES.items():
                    with decode_core.quant_config(**cfg):
                        fn = lambda: decode_core.launch_decode(q, d ** -0.5, bq, bvv, quant=(qk, qv), group_size=128, int8=int8)
                        times[r].append(timer.gpu_ms(fn))
            med = {r: statistics.median(x) for r, x in times.items()}
            key = f"{name} {ctx // 1024}K L={L} {'int8' if int8 else 'int4'}"
            out[key] = med
            print(f"{key:28} " + " | ".join(f"{r} {m * 1000:.1f} us" for r, m in med.items()), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
