"""GPU: programs per SM up to the register limit (INT4 32-token blocks: 184 registers -> 11 warps/SM; INT8: 185)."""
import sys, torch
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
from kernels import Timer, sdpa_flash
from hf_sparsekv.kernels import decode_core
from hf_sparsekv.kernels.quant_attention import quant_decode_attention
from hf_sparsekv.kernels.quantize import quantize_keys, quantize_values
timer = Timer(20)
hq, hkv, d = 32, 8, 128
for ctx in (65536, 131072):
    k = torch.randn(1, hkv, ctx, d, device="cuda", dtype=torch.float16)
    v = torch.randn(1, hkv, ctx, d, device="cuda", dtype=torch.float16)
    q = torch.randn(1, hq, 1, d, device="cuda", dtype=torch.float16)
    sd = timer.gpu_ms(lambda: sdpa_flash(q, k, v, d**-0.5))
    t_q = ctx - 128
    qk, qv = quantize_keys(k[:, :, :t_q], 128), quantize_values(v[:, :, :t_q])
    for int8 in (False, True):
        view = "gluon_int8" if int8 else "gluon_int4"
        sets = [dict()] + [dict(merge_buffer=True)] + [
            {view: (b, st), "gluon_per_sm": ps} for b, st in (((32, 2), (32, 3)) if not int8 else ((32, 3),))
            for ps in (8, 10, 11)]
        line = []
        for cfg in sets:
            with decode_core.quant_config(**cfg):
                ms = timer.gpu_ms(lambda: quant_decode_attention(q, qk, qv, k[:, :, t_q:], v[:, :, t_q:], 128, int8, d**-0.5))
            line.append(f"{cfg}: {ms*1000:.1f}us ({sd/ms:.2f}x)")
        print(f"{ctx} {'int8' if int8 else 'int4'} sdpa {sd*1000:.1f}us\n  " + "\n  ".join(line), flush=True)
    del k, v, qk, qv; torch.cuda.empty_cache()

# verification: 6 queries (24 rows per KV head), programs of 8 rows (default) against 16 rows with 16/32-token blocks
for ctx in (32768, 131072):
    k = torch.randn(1, hkv, ctx, d, device="cuda", dtype=torch.float16)
    v = torch.randn(1, hkv, ctx, d, device="cuda", dtype=torch.float16)
    q6 = torch.randn(1, 6, hq, d, device="cuda", dtype=torch.float16).transpose(1, 2)
    t_q = ctx - 128
    qk, qv = quantize_keys(k[:, :, :t_q], 128), quantize_values(v[:, :, :t_q])
    for int8 in (True, False):
        view = "gluon_int8" if int8 else "gluon_int4"
        line = []
        for cfg in ({}, {"gluon_rows": 16, view: (16, 3)}, {"gluon_rows": 16, view: (16, 4)},
                    {"gluon_rows": 16, view: (32, 3)}, {"merge_buffer": True}):
            with decode_core.quant_config(**cfg):
                ms = timer.gpu_ms(lambda: quant_decode_attention(q6, qk, qv, k[:, :, t_q:], v[:, :, t_q:], 128, int8, d**-0.5))
            line.append(f"{cfg}: {ms*1000:.1f}us")
        print(f"{ctx} q=6 {'int8' if int8 else 'int4'}\n  " + "\n  ".join(line), flush=True)
    del k, v, qk, qv; torch.cuda.empty_cache()
