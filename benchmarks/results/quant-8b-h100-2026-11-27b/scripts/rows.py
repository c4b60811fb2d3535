"""GPU: INT8 verification (6 queries, 24 rows per KV head) in 8- vs 16-row Gluon programs, fp16 and bf16."""
import sys, torch
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
from kernels import Timer, sdpa_flash
from hf_sparsekv.kernels import decode_core
from hf_sparsekv.kernels.quant_attention import quant_decode_attention
from hf_sparsekv.kernels.quantize import quantize_keys, quantize_values
timer = Timer(20)
hq, hkv, d = 32, 8, 128
for dt in (torch.bfloat16, torch.float16):
    for ctx in (32768, 131072):
        k = torch.randn(1, hkv, ctx, d, device="cuda", dtype=dt)
        v = torch.randn(1, hkv, ctx, d, device="cuda", dtype=dt)
        q6 = torch.randn(1, 6, hq, d, device="cuda", dtype=dt).transpose(1, 2)
        t_q = ctx - 128
        qk, qv = quantize_keys(k[:, :, :t_q], 128), quantize_values(v[:, :, :t_q])
        for int8 in (True, False):
            view = "gluon_int8_rows16" if int8 else "gluon_int4_rows16"
            line = []
            for cfg in ({view: None}, {view: (16, 3)}, {view: (32, 3)}, {view: (16, 2)}):
                with decode_core.quant_config(**cfg):
                    ms = timer.gpu_ms(lambda: quant_decode_attention(q6, qk, qv, k[:, :, t_q:], v[:, :, t_q:], 128, int8, d**-0.5))
                line.append(f"{cfg}: {ms*1000:.1f}us")
            print(f"{dt} {ctx} q=6 {'int8' if int8 else 'int4'}\n  " + "\n  ".join(line), flush=True)
        del k, v, qk, qv; torch.cuda.empty_cache()
