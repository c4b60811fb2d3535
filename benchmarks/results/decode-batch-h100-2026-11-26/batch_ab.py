import torch, sys
sys.path.insert(0, "benchmarks")
from kernels import Timer, sdpa_flash
from decode_kernel import inputs, ours, SHAPES
from hf_sparsekv.kernels import decode_core
t = Timer(20)
for ctx in (32768, 131072):
    for n in (1, 6):
        q, k, v, length = inputs(SHAPES["llama3-8b"], 4, n, ctx, ctx, torch.bfloat16)
        res = {"batch-cfg": [], "b1-cfg": [], "flash": []}
        for rep in range(3):
            res["batch-cfg"].append(t.gpu_ms(lambda: ours(q, k, v, length)))
            saved = dict(decode_core.FP_BATCH_CONFIG); decode_core.FP_BATCH_CONFIG.clear()
            res["b1-cfg"].append(t.gpu_ms(lambda: ours(q, k, v, length)))
            decode_core.FP_BATCH_CONFIG.update(saved)
            ke, ve = k[:, :, :ctx], v[:, :, :ctx]
            res["flash"].append(t.gpu_ms(lambda: sdpa_flash(q, ke, ve, q.shape[-1] ** -0.5)))
        print(ctx, n, {k2: " ".join(f"{x*1e3:.1f}" for x in vals) for k2, vals in res.items()}, flush=True)
        del q, k, v; torch.cuda.empty_cache()
