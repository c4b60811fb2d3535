"""GPU: where the quantized launch's time goes (per kernel, torch.profiler, L2 flushed), 1 and 6 queries; split sweep."""
import sys, torch, json
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
from kernels import Timer, sdpa_flash
from hf_sparsekv.kernels import decode_core
from hf_sparsekv.kernels.quant_attention import quant_decode_attention
from hf_sparsekv.kernels.quantize import quantize_keys, quantize_values
from torch.profiler import profile, ProfilerActivity
timer = Timer(20)
clean = Timer(20)
class ReadFlush:  # evicts L2 by reading (clean lines), where zero_() leaves it full of dirty lines to write back
    def __init__(self, t): self.t = t
    def zero_(self): return self.t.view(torch.int32).amax()
clean.flush = ReadFlush(clean.flush)
dtype = torch.float16
hq, hkv, d = 32, 8, 128
flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
mode = sys.argv[1] if len(sys.argv) > 1 else "all"
for ctx in (65536, 131072):
    k = torch.randn(1, hkv, ctx, d, device="cuda", dtype=dtype)
    v = torch.randn(1, hkv, ctx, d, device="cuda", dtype=dtype)
    t_q = ctx - 128
    qk, qv = quantize_keys(k[:, :, :t_q], 128), quantize_values(v[:, :, :t_q])
    bk, bv = k[:, :, t_q:], v[:, :, t_q:]
    for L in (1, 6):
        q = torch.randn(1, hq, L, d, device="cuda", dtype=dtype)
        if L == 1:
            sd = timer.gpu_ms(lambda: sdpa_flash(q, k, v, d**-0.5))
            sdc = clean.gpu_ms(lambda: sdpa_flash(q, k, v, d**-0.5))
        for int8 in (False, True):
            run = lambda: quant_decode_attention(q, qk, qv, bk, bv, 128, int8, d**-0.5)
            tot = timer.gpu_ms(run)
            totc = clean.gpu_ms(run)
            for _ in range(3): run()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    flush.zero_(); run()
                torch.cuda.synchronize()
            parts = {}
            for e in prof.events():
                if e.device_type.name == "CUDA" and "zero" not in e.name.lower() and "fill" not in e.name.lower():
                    parts.setdefault(e.name[:40], []).append(e.device_time)
            desc = " | ".join(f"{n}: {sorted(t)[len(t)//2]:.1f}us x{len(t)//20}" for n, t in parts.items())
            print(f"ctx {ctx} L {L} {'int8' if int8 else 'int4'} graph {tot*1000:.1f}us"
                  + (f" (sdpa L1 {sd*1000:.1f}us, {sd/tot:.2f}x)" if L == 1 else "")
                  + f" | read-flush {totc*1000:.1f}us" + (f" (sdpa {sdc*1000:.1f}us, {sdc/totc:.2f}x)" if L == 1 else "")
                  + f" || {desc}", flush=True)
            if mode == "splits" and L == 1:
                line = []
                for ps, ms_ in ((8, 256), (8, 1024), (16, 512), (4, 512), (12, 512)):
                    with decode_core.quant_config(gluon_per_sm=ps, gluon_min_split=ms_):
                        t = timer.gpu_ms(run)
                    line.append(f"ps{ps}/min{ms_}: {t*1000:.1f}")
                print("   splits:", " | ".join(line), flush=True)
    del k, v, qk, qv, bk, bv; torch.cuda.empty_cache()
