"""GPU: gluon settings against the Triton kernel and SDPA-flash, 64K/128K, Llama-3 and Llama-2 shapes (L2 flushed)."""
import sys, torch
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
from kernels import Timer, sdpa_flash
from hf_sparsekv.kernels import decode_core
from hf_sparsekv.kernels.quant_attention import quant_decode_attention
from hf_sparsekv.kernels.quantize import quantize_keys, quantize_values
timer = Timer(20)
dtype = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.float16
settings = [("triton", dict(kernel="triton"))] + [
    (f"gluon b{b} st{st} ps{ps}", dict(kernel="gluon", gluon_block=b, gluon_stages=st, gluon_per_sm=ps))
    for b, st, ps in ((64, 0, 8), (32, 3, 8), (32, 2, 8), (64, 2, 8), (64, 3, 8), (32, 4, 8), (32, 3, 12), (32, 3, 6))]
for name, (hq, hkv, d) in (("llama3", (32, 8, 128)), ("llama2", (32, 32, 128))):
    for ctx in (65536, 131072):
        k = torch.randn(1, hkv, ctx, d, device="cuda", dtype=dtype)
        v = torch.randn(1, hkv, ctx, d, device="cuda", dtype=dtype)
        q = torch.randn(1, hq, 1, d, device="cuda", dtype=dtype)
        sd = timer.gpu_ms(lambda: sdpa_flash(q, k, v, d**-0.5))
        t_q = ctx - 128
        qk, qv = quantize_keys(k[:, :, :t_q], 128), quantize_values(v[:, :, :t_q])
        bk, bv = k[:, :, t_q:], v[:, :, t_q:]
        for int8 in (False, True):
            line = []
            for sname, cfg in settings:
                if name == "llama2" and sname.startswith("gluon") and sname != settings[1][0]:
                    continue
                with decode_core.quant_config(**cfg):
                    ms = timer.gpu_ms(lambda: quant_decode_attention(q, qk, qv, bk, bv, 128, int8, d**-0.5))
                line.append(f"{sname}: {ms*1000:.1f}us ({sd/ms:.2f}x)")
            print(f"{name} {ctx} {'int8' if int8 else 'int4'} sdpa {sd*1000:.1f}us | " + " | ".join(line), flush=True)
        del k, v, qk, qv, bk, bv; torch.cuda.empty_cache()
