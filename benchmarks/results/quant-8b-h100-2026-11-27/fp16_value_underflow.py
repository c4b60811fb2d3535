"""CPU float64 emulation: the fp16 value operand p·s_v·CF rounded to float16 (as both quantized kernels do in float16) against
the exact weighted sum, by value scale s_v (≈ a token's value range / 15). Output: fp16_value_underflow.log."""
import torch
torch.manual_seed(0)
T = 4096
for view in ("int4", "int8"):
    CF = 1/14 if view == "int8" else 1.0
    cmax = 225 if view == "int8" else 15
    for s in (1e-1, 1e-2, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5):
        errs = []
        for _ in range(5):
            logits = torch.randn(T, dtype=torch.float64) * 3
            p = torch.exp(logits - logits.max())  # unnormalized probabilities <= 1, as the kernel has them
            sv = torch.full((T,), s, dtype=torch.float64) * (0.5 + torch.rand(T, dtype=torch.float64))
            C = torch.randint(0, cmax + 1, (T,), dtype=torch.float64)
            exact = (p * sv * CF * C).sum() / p.sum()
            w16 = (p * sv * CF).to(torch.float16).double()  # rounded to fp16 before the MMA
            approx = (w16 * C).sum() / p.sum()
            errs.append(abs(approx - exact).item() / abs(exact).item())
        print(view, f"s_v={s:g}", f"value range ~{15*s:g}", f"rel err {max(errs):.2e}")
