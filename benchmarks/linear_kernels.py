"""The decode step's linear layers (issue 30): cuBLAS (one ``F.linear`` per weight, as the model calls them) against
the grouped kernel (``hf_sparsekv::grouped_linear``: the weights that share an input in one launch), at the
projection shapes of real models, for the few rows of a decode / verify step; for gate/up also the gated kernel
(``hf_sparsekv::gated_linear``: both projections and ``silu(gate) * up`` in one launch, which the grouped kernel's
time does not include). Random weights (costs only).

Each method is captured as one CUDA graph over ``--layers`` copies of the group's weights (as a step reads each
layer's weights once: more bytes than L2 holds), replayed ``--repeats`` times interleaved with the other method;
median per group. Bandwidth = weight bytes / time, beside the device copy rate of the same run.

    python benchmarks/linear_kernels.py --out runs/linear-kernels
    python benchmarks/linear_kernels.py --sweep --models llama-3.1-8b --rows 1 6   # launch configurations (both kernels)

Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_sparsekv.kernels import gated_linear
from hf_sparsekv.kernels import grouped_linear as gl
from provenance import commit

# hidden, q heads · head dim, kv heads · head dim, intermediate, vocab
MODELS = {
    "llama-3.1-8b": (4096, 4096, 1024, 14336, 128256),
    "llama-3.2-1b": (2048, 2048, 512, 8192, 128256),
    "qwen2.5-7b": (3584, 3584, 512, 18944, 152064),
    "qwen2.5-0.5b": (896, 896, 128, 4864, 151936),
    "bundled": (256, 256, 128, 768, 8192),  # the bundled pair's verifier (hf_sparsekv/zoo/pair)
}


def groups(model: str) -> dict[str, list[tuple[int, int]]]:
    """name -> the weights ``(N, K)`` of one group."""
    hidden, q, kv, inter, vocab = MODELS[model]
    return {"qkv": [(q, hidden), (kv, hidden), (kv, hidden)], "o": [(hidden, q)],
            "gate/up": [(inter, hidden), (inter, hidden)], "down": [(hidden, inter)], "lm_head": [(vocab, hidden)]}


def copy_rate() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (time.perf_counter() - t)


def captured(fn) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graphs(graphs: dict, repeats: int) -> dict[str, float]:
    """Median milliseconds per replay, the graphs interleaved."""
    times = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        for name, graph in graphs.items():
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(v) for name, v in times.items()}


def _capture_each(graphs: dict, kernel: str, launch, configs: list | None) -> None:
    """``graphs[name]``: ``launch(config)`` captured for each of ``configs`` (``None``: the kernel's own settings, named
    ``kernel``; the others ``kernel`` + the config); a configuration that does not fit (shared memory, registers) is
    reported and skipped."""
    for cfg in configs or [None]:
        name = kernel if cfg is None else kernel + "-".join(map(str, cfg))
        try:
            graphs[name] = captured(lambda cfg=cfg: launch(cfg))
        except Exception as err:
            if cfg is None:
                raise
            print(f"  {name}: {type(err).__name__}", flush=True)


def measure(shapes, rows: int, layers: int, dtype, repeats: int, configs: list | None) -> dict:
    x = torch.randn(rows, shapes[0][1], device="cuda", dtype=dtype)
    stacks = [[torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for n, k in shapes] for _ in range(layers)]
    ref = [F.linear(x, w) for w in stacks[0]]
    got = torch.ops.hf_sparsekv.grouped_linear(x, stacks[0], [])
    error = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))
    graphs = {"cublas": captured(lambda: [F.linear(x, w) for ws in stacks for w in ws])}
    _capture_each(graphs, "grouped", lambda cfg: [gl.launch(x, ws, [], config=cfg) for ws in stacks], configs)
    if len(shapes) == 2 and shapes[0] == shapes[1]:  # gate/up: the gated kernel too, at the same configurations
        _capture_each(graphs, "gated", lambda cfg: [gated_linear.launch(x, *ws, config=cfg) for ws in stacks], configs)
    ms = {name: t / layers for name, t in time_graphs(graphs, repeats).items()}
    nbytes = sum(n * k for n, k in shapes) * x.element_size()
    del stacks, graphs
    torch.cuda.empty_cache()
    return dict(ms=ms, bytes=nbytes, max_abs_error=error)


def _fits(config, rows: int, k: int) -> bool:
    block_n, block_k, warps, _ = config
    if block_k > max(128, 1 << (k - 1).bit_length()):  # a K tile past the inputs only masks
        return False
    if rows > 1:
        return block_n >= 16  # tensor-core tiles
    return block_n * block_k <= 64 * 32 * warps  # the one-row accumulator: at most 64 floats per thread


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 6, 16, 24, 32])
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--layer-bytes", type=float, default=0.4e9, help="weight bytes each graph reads (> L2)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--groups", nargs="+", default=None, help="only these groups (qkv, o, gate/up, down, lm_head)")
    p.add_argument("--sweep", action="store_true", help="also time a grid of launch configurations")
    p.add_argument("--out", default="runs/linear-kernels")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_rate()
    print(f"copy rate {bandwidth / 1e12:.2f} TB/s (read + write)")
    configs = None
    if args.sweep:
        configs = [None] + [(bn, bk, w, s) for bn in (4, 8, 16, 32, 64) for bk in (128, 256, 512, 1024)
                            for w in (4, 8) for s in (2, 3, 4)]
    rows_out = []
    for model in args.models:
        for group, shapes in groups(model).items():
            if args.groups and group not in args.groups:
                continue
            nbytes = sum(n * k for n, k in shapes) * 2
            layers = max(1, min(64, int(args.layer_bytes // nbytes)))
            for rows in args.rows:
                r = measure(shapes, rows, layers, dtype, args.repeats,
                            [c for c in configs if c is None or _fits(c, rows, shapes[0][1])] if configs else None)
                best = min((v, k) for k, v in r["ms"].items() if k.startswith("grouped"))
                gated = [(v, k) for k, v in r["ms"].items() if k.startswith("gated")]
                row = dict(model=model, group=group, rows=rows, layers=layers, **r, best=best[1],
                           best_gated=min(gated)[1] if gated else None)
                rows_out.append(row)
                gbs = {k: r["bytes"] / v / 1e6 for k, v in r["ms"].items()}
                print(f"{model:13s} {group:8s} rows={rows:2d}  cublas {r['ms']['cublas'] * 1e3:8.1f} us "
                      f"({gbs['cublas']:5.0f} GB/s)  grouped {r['ms']['grouped'] * 1e3:8.1f} us "
                      f"({gbs['grouped']:5.0f} GB/s)  best {best[1]} {best[0] * 1e3:.1f} us  err {r['max_abs_error']:.3g}"
                      + (f"  gated {r['ms']['gated'] * 1e3:.1f} us, best {min(gated)[1]} {min(gated)[0] * 1e3:.1f} us"
                         if gated else ""), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), commit=commit(), torch=torch.__version__, dtype=args.dtype,
                copy_rate=bandwidth, date=time.strftime("%Y-%m-%d"))
    (out / "linear_kernels.json").write_text(json.dumps(dict(meta=meta, rows=rows_out), indent=1))
    print("\n| model | group | rows | cuBLAS µs (GB/s) | grouped µs (GB/s) | ratio | gated µs (with the activation) |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows_out:
        c, g = r["ms"]["cublas"], r["ms"]["grouped"]
        gated = f"{r['ms']['gated'] * 1e3:.1f}" if "gated" in r["ms"] else "–"
        print(f"| {r['model']} | {r['group']} | {r['rows']} | {c * 1e3:.1f} ({r['bytes'] / c / 1e6:.0f}) | "
              f"{g * 1e3:.1f} ({r['bytes'] / g / 1e6:.0f}) | {c / g:.2f}× | {gated} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
