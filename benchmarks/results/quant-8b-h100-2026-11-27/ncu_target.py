"""One Llama-3 64K launch repeated, for ncu."""
import sys, torch
sys.path.insert(0, ".")
from hf_sparsekv.kernels.quant_attention import quant_decode_attention
from hf_sparsekv.kernels.quantize import quantize_keys, quantize_values
int8 = sys.argv[1] == "int8"; L = int(sys.argv[2]) if len(sys.argv) > 2 else 1
hq, hkv, d, ctx = 32, 8, 128, 65536
k = torch.randn(1, hkv, ctx, d, device="cuda", dtype=torch.float16)
v = torch.randn(1, hkv, ctx, d, device="cuda", dtype=torch.float16)
q = torch.randn(1, hq, L, d, device="cuda", dtype=torch.float16)
t_q = ctx - 128
qk, qv = quantize_keys(k[:, :, :t_q], 128), quantize_values(v[:, :, :t_q])
for _ in range(4):
    quant_decode_attention(q, qk, qv, k[:, :, t_q:], v[:, :, t_q:], 128, int8, d**-0.5)
torch.cuda.synchronize()
