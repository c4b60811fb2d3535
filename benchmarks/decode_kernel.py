"""The full-precision decode kernel (``hf_sparsekv::static_decode``) against SDPA-flash, at real GQA shapes.

What the static engine launches at every AR, draft and verify step: ``q [B, Hq, L, D]`` against preallocated
``k/v [B, Hkv, capacity, D]`` of which the first ``length`` slots of each row are read (lengths on the device, so
the launch is captured once). Per (shape, dtype, batch, queries L, context): our kernel, SDPA restricted to the flash
backend on the exact length (the strongest dense kernel a user has; its L queries attend to the whole context, same
bytes), the bytes both must read (keys + values once) and the achieved rate as a fraction of a device-to-device
copy measured in the same run. Times are CUDA-graph replays with L2 flushed before every call (``kernels.Timer``).

``--capacity-factor F`` sizes the buffers F x the context (a captured engine sized for longer sequences reads a
shorter length). ``--sweep`` first times launch settings (block, warps, stages, programs per SM, minimum split) at
a few contexts, checks each against the float32 reference, and uses the fastest for the table.

``--tree`` times tree verification's attention instead: trees of 17 and 33 queries (one random tree each) beside the
6-token chain at Llama-3-8B shape, batch 1, at each of ``--contexts``; ``--tree-sweep`` first sweeps the launch
settings on the tree cases (TREE_SWEEP) and takes the table at the fastest.

    python benchmarks/decode_kernel.py --out runs/decode-kernel [--sweep] [--quick]
    python benchmarks/decode_kernel.py --out runs/tree-kernel --contexts 16384 32768 --tree-sweep
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch

from kernel_sweep import Timer, sdpa_flash
from provenance import commit
from scale import copy_rate

SHAPES = {"llama3-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128), "qwen2.5-1.5b": (12, 2, 128),
          "bundled": (4, 2, 64)}  # the bundled pair's verifier and drafter (hf_sparsekv/zoo/pair)
CONTEXTS = (8192, 16384, 32768, 65536, 131072)
QUERIES = (1, 4, 6, 16)


def inputs(shape, batch, queries, context, capacity, dtype):
    hq, hkv, d = shape
    q = torch.randn(batch, hq, queries, d, dtype=dtype, device="cuda")
    k = torch.randn(batch, hkv, capacity, d, dtype=dtype, device="cuda")
    v = torch.randn(batch, hkv, capacity, d, dtype=dtype, device="cuda")
    length = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return q, k, v, length


def ours(q, k, v, length):
    from hf_sparsekv.kernels.chunk_attention import chunk_decode_attention

    return chunk_decode_attention(q, k, v, q.shape[-1] ** -0.5, length=length)


def relative_error(q, k, v, length) -> float:
    from hf_sparsekv.kernels.chunk_attention import chunk_decode_attention_reference

    out = ours(q, k, v, length).float()
    ref = chunk_decode_attention_reference(q.float(), k.float(), v.float(), q.shape[-1] ** -0.5, length).float()
    return float((out - ref).norm() / ref.norm())


def kv_bytes(shape, batch, context, dtype) -> int:
    _, hkv, d = shape
    return 2 * batch * hkv * context * d * torch.tensor([], dtype=dtype).element_size()


SWEEP = dict(block_n=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4), programs_per_sm=(2, 4, 8))
# Few KV heads (the bundled pair's 2): the split length decides how many programs fill the GPU, so it is swept too.
SMALL_SWEEP = dict(block_n=(32, 64), num_warps=(2, 4), num_stages=(2, 3), programs_per_sm=(2, 4, 8),
                   min_split=(64, 128, 256))


def _swept(timer, grid: dict, error, calls: list, label: str) -> tuple[dict, list]:
    """Every setting of ``grid`` (FP_CONFIG keys -> values to try): correct first (``error()`` < 2e-2 under the
    setting), then the sum of the times of ``calls``; returns the fastest setting and every row."""
    from hf_sparsekv.kernels.decode_core import fp_config

    results = []
    for values in itertools.product(*grid.values()):
        cfg = dict(zip(grid, values))
        try:
            with fp_config(**cfg):
                err = error()
                if not err < 2e-2:
                    raise ValueError(f"relative error {err:.3g}")
                times = [timer.gpu_ms(call) for call in calls]
        except Exception as e:  # a setting that does not compile (shared memory) or is wrong is reported, skipped
            results.append({"config": cfg, "error": f"{type(e).__name__}: {e}"[:200]})
            print(f"{label} {cfg}: {results[-1]['error']}", flush=True)
            continue
        results.append({"config": cfg, "ms": times, "total_ms": sum(times)})
        print(f"{label} {cfg}: " + " ".join(f"{t * 1e3:.1f}" for t in times) + f" us  total {sum(times) * 1e3:.1f}",
              flush=True)
    best = min((r for r in results if "ms" in r), key=lambda r: r["total_ms"])
    return best["config"], results


def sweep(timer, dtype, contexts, batch=1, shape_name="llama3-8b") -> tuple[dict, list]:
    """Every setting of SWEEP (min_split fixed; SMALL_SWEEP, min_split included, for a shape of at most 2 KV heads)
    at ``shape_name``, ``batch`` rows, q 1 and 6: correct first (relative error < 2e-2 against float32 at 3000
    tokens), then the sum of the times."""
    shape = SHAPES[shape_name]
    cases = [inputs(shape, batch, n, c, c, dtype) for c in contexts for n in (1, 6)]
    check = [inputs(shape, b, n, 3000, 4096, dtype) for b, n in ((1, 1), (2, 6))]
    grid = SMALL_SWEEP if shape[1] <= 2 else SWEEP
    return _swept(timer, grid, lambda: max(relative_error(*c) for c in check),
                  [lambda c=c: ours(*c) for c in cases], "sweep")


TREE_SWEEP = dict(block_m=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3), block_n=(32, 64))
TREE_QUERIES = (17, 33)  # tree verification: N = 16 / 32 draft nodes and the root


def tree_bits(queries: int, seed: int) -> torch.Tensor:
    """Ancestor bits ``[1, L]`` of a random tree of ``queries`` nodes (node 0 the root, every parent earlier)."""
    from hf_sparsekv.generation.draft_tree import ancestor_bits_of

    g = torch.Generator().manual_seed(seed)
    parents = [0] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, queries)]
    return ancestor_bits_of(torch.tensor([parents], device="cuda"), queries - 1)


def tree_cases(contexts, queries, dtype=torch.bfloat16) -> list[tuple]:
    """(name, context, L, q, k, v, length, bits) at Llama-3-8B shape, batch 1: a tree of each size in ``queries``
    and the 6-token chain it replaces, at each context."""
    cases = []
    for ctx in contexts:
        for n in (6, *queries):
            q, k, v, length = inputs(SHAPES["llama3-8b"], 1, n, ctx, ctx, dtype)
            cases.append((f"{'chain' if n == 6 else 'tree'}-{n}", ctx, n, q, k, v, length,
                          None if n == 6 else tree_bits(n, seed=n)))
    return cases


def tree_error(case) -> float:
    from hf_sparsekv.kernels.chunk_attention import chunk_decode_attention, chunk_decode_attention_reference

    _, _, _, q, k, v, length, bits = case
    n = min(int(length[0]), 3000)
    short = torch.full_like(length, n)
    out = chunk_decode_attention(q, k, v, 0.125, length=short, tree=bits).float()
    ref = chunk_decode_attention_reference(q.float(), k.float(), v.float(), 0.125, length=short, tree=bits)
    return float((out - ref).norm() / ref.norm())


def tree_rows(timer, cases, copy_gbps) -> list[dict]:
    """Each case through our kernel with the library's settings (and SDPA-flash over the same keys without a mask,
    the dense kernel's time for as many queries)."""
    from hf_sparsekv.kernels.chunk_attention import chunk_decode_attention

    rows = []
    for name, ctx, n, q, k, v, length, bits in cases:
        ms = timer.gpu_ms(lambda: chunk_decode_attention(q, k, v, 0.125, length=length, tree=bits))
        flash = timer.gpu_ms(lambda: sdpa_flash(q, k[:, :, :ctx], v[:, :, :ctx], 0.125))
        nbytes = kv_bytes(SHAPES["llama3-8b"], 1, ctx, q.dtype)
        rows.append(dict(case=name, context=ctx, queries=n, ours_ms=ms, flash_ms=flash, bytes=nbytes,
                         fraction_of_copy=nbytes / ms / 1e6 / copy_gbps,
                         error=tree_error((name, ctx, n, q, k, v, length, bits))))
        print(f"{name:8s} {ctx:6d}: ours {ms * 1e3:7.1f} us ({rows[-1]['fraction_of_copy']:.0%} of copy)  "
              f"flash (no mask) {flash * 1e3:7.1f} us  err {rows[-1]['error']:.1e}", flush=True)
    return rows


def tree_sweep(timer, cases) -> tuple[dict, list]:
    """Every setting of TREE_SWEEP over the tree cases: correct first (relative error < 2e-2 at 3000 tokens), then
    the sum of the times."""
    from hf_sparsekv.kernels.chunk_attention import chunk_decode_attention

    trees = [c for c in cases if c[7] is not None]
    calls = [lambda c=c: chunk_decode_attention(c[3], c[4], c[5], 0.125, length=c[6], tree=c[7]) for c in trees]
    return _swept(timer, TREE_SWEEP, lambda: max(tree_error(c) for c in trees), calls, "tree sweep")


def tree_main(args, timer, copy_gbps) -> int:
    """``--tree``: tree verification's attention (17 and 33 queries) beside the 6-token chain at 16K/32K; with
    ``--tree-sweep``, the launch settings swept first (over tree cases only) and the table taken at the winner."""
    cases = tree_cases(args.contexts, TREE_QUERIES)
    chosen, sweep_rows = {}, []
    if args.tree_sweep:
        chosen, sweep_rows = tree_sweep(timer, cases)
        print(f"tree sweep winner: {chosen}", flush=True)
    from hf_sparsekv.kernels.decode_core import fp_config

    with fp_config(**chosen):  # no settings: the library's
        rows = tree_rows(timer, cases, copy_gbps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tree_kernel.json").write_text(json.dumps(dict(
        settings=dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), commit=commit(),
                      torch=torch.__version__, copy_gbps=copy_gbps, shape="llama3-8b", dtype="bfloat16",
                      chosen=chosen, timing="CUDA-graph replay, L2 flushed before every call"),
        rows=rows, sweep=sweep_rows), indent=1))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/decode-kernel")
    p.add_argument("--shapes", nargs="+", default=["llama3-8b"], choices=list(SHAPES))
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    p.add_argument("--queries", type=int, nargs="+", default=list(QUERIES))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16"])
    p.add_argument("--capacity-factor", type=float, default=1.0)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    p.add_argument("--sweep-batch", type=int, default=1, help="--sweep: rows of the swept launches")
    p.add_argument("--sweep-contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--sweep-shape", default="llama3-8b", choices=list(SHAPES), help="--sweep: the shape swept")
    p.add_argument("--tree", action="store_true", help="tree verification's attention instead of the grid")
    p.add_argument("--tree-sweep", action="store_true", help="--tree: sweep the launch settings on the tree cases first")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_kernel.py times CUDA kernels: run it on a CUDA GPU", file=sys.stderr)
        return 2
    from hf_sparsekv.kernels.decode_core import FP_BATCH_CONFIG, FP_CONFIG, fp_config

    timer = Timer(5 if args.quick else 20)
    copy_gbps = copy_rate() / 1e9
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s", flush=True)
    if args.tree or args.tree_sweep:
        return tree_main(args, timer, copy_gbps)
    config, sweep_rows = {}, []  # the library's settings (batch-1 and batched launches), unless a sweep chose
    if args.sweep:
        chosen, sweep_rows = sweep(timer, torch.bfloat16, args.sweep_contexts, args.sweep_batch, args.sweep_shape)
        config.update(chosen)
        print(f"sweep winner: {chosen}", flush=True)
    rows = []
    with fp_config(**config):
        used = dict(fp_config=dict(FP_CONFIG), fp_batch_config=[dict(e) for e in FP_BATCH_CONFIG])
        for name, dt, batch, n, ctx in itertools.product(args.shapes, args.dtypes, args.batches, args.queries,
                                                          args.contexts):
            shape, dtype = SHAPES[name], getattr(torch, dt)
            capacity = int(ctx * args.capacity_factor)
            try:
                q, k, v, length = inputs(shape, batch, n, ctx, capacity, dtype)
                err = relative_error(q, k, v, length) if ctx <= 16384 else None
                ms = timer.gpu_ms(lambda: ours(q, k, v, length))
                ke, ve = k[:, :, :ctx], v[:, :, :ctx]
                flash = timer.gpu_ms(lambda: sdpa_flash(q, ke, ve, q.shape[-1] ** -0.5))
            except torch.OutOfMemoryError:
                print(f"{name} {dt} B={batch} L={n} {ctx}: out of memory, skipped", flush=True)
                continue
            finally:
                q = k = v = ke = ve = None
                torch.cuda.empty_cache()
            nbytes = kv_bytes(shape, batch, ctx, dtype)
            row = dict(shape=name, dtype=dt, batch=batch, queries=n, context=ctx, capacity=capacity, ours_ms=ms,
                       flash_ms=flash, bytes=nbytes, ours_gbps=nbytes / ms / 1e6, flash_gbps=nbytes / flash / 1e6,
                       fraction_of_copy=nbytes / ms / 1e6 / copy_gbps, vs_flash=flash / ms, rel_error=err)
            rows.append(row)
            print(f"{name} {dt} B={batch} L={n:2d} {ctx:6d}: ours {ms * 1e3:7.1f} us ({row['ours_gbps']:5.0f} GB/s, "
                  f"{row['fraction_of_copy']:.0%} of copy)  flash {flash * 1e3:7.1f} us  flash/ours "
                  f"{row['vs_flash']:.2f}" + (f"  err {err:.1e}" if err is not None else ""), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(settings=dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                                commit=commit(), torch=torch.__version__, copy_gbps=copy_gbps, **used,
                                capacity_factor=args.capacity_factor,
                                timing="CUDA-graph replay, L2 flushed before every call"),
                  rows=rows, sweep=sweep_rows)
    (out / "decode_kernel.json").write_text(json.dumps(result, indent=1))
    lines = ["| shape | dtype | B | L | context | ours µs | GB/s | of copy | flash µs | flash/ours |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['dtype']} | {r['batch']} | {r['queries']} | {r['context']} | "
                     f"{r['ours_ms'] * 1e3:.1f} | {r['ours_gbps']:.0f} | {r['fraction_of_copy']:.0%} | "
                     f"{r['flash_ms'] * 1e3:.1f} | {r['vs_flash']:.2f} |")
    (out / "decode_kernel.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
