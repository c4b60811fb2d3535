import torch
from hf_sparsekv.kernels.quant_reference import QuantizedTensor

def blocked(qt):
    h, t, half = qt.upper.shape[1:]
    f = lambda c: c.view(1, h, t // 16, 16, half).transpose(-1, -2).contiguous()
    return QuantizedTensor(f(qt.upper), f(qt.lower), qt.scale, qt.zero)

