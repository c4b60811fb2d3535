"""One quantized-attention launch at 64K for ncu: python ncu_quant.py SHAPE VIEW (llama2-7b|llama3-8b, int4|int8)."""
import sys
import torch
from hf_sparsekv.kernels.quantize import quantize_keys, quantize_values
from hf_sparsekv.kernels.quant_attention import quant_decode_attention
shape, view = sys.argv[1], sys.argv[2]
hq, hkv, d = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128)}[shape]
ctx, buf = 65536, 128
k = torch.randn(1, hkv, ctx, d, device="cuda", dtype=torch.float16)
v = torch.randn(1, hkv, ctx, d, device="cuda", dtype=torch.float16)
q = torch.randn(1, hq, 1, d, device="cuda", dtype=torch.float16)
t = ctx - buf
qk, qv = quantize_keys(k[:, :, :t], 128), quantize_values(v[:, :, :t])
for _ in range(3):
    quant_decode_attention(q, qk, qv, k[:, :, t:], v[:, :, t:], 128, view == "int8", d**-0.5)
torch.cuda.synchronize()
