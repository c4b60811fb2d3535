"""The chunk selection's own cost (issue 36): the engine's prefill with and without a self-drafting chunk-budget cache
filled from it, at real model shapes (random bf16 weights of the published shapes; costs only), on one CUDA GPU.

For each context L: the verifier's prefill alone (mode ``"ar"``) against the same prefill feeding a
``ChunkBudgetCache``-style companion (self-drafting, mode ``"chunk"``, budget B): the difference is what scoring the
chunks from the observation window's queries, selecting and copying the kept chunks costs. Peak memory of each
(``max_memory_allocated`` after a reset; the model and both engines' caches included). Median of ``--repeats``.

    python benchmarks/selection_cost.py --contexts 16384 65536 --out runs/selection-cost
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import hf_sparsekv  # noqa: F401  (registers the static attention)
from provenance import commit
from real_cost import build


def prefill_seconds(engine, ids: torch.Tensor, repeats: int) -> tuple[float, int]:
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats + 1):  # the first is a warm-up
        engine.holds_sequence = False  # a repeat prefills its whole prompt (else the engine reuses the one it holds)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.prefill([ids])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), torch.cuda.max_memory_allocated()


def main(argv=None) -> int:
    from hf_sparsekv.generation import engine as static_engine
    from hf_sparsekv.generation.graph_steps import static_attention_for

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--contexts", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="runs/selection-cost")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("selection_cost.py times CUDA prefills: run it on a CUDA GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build(args.model, torch.device("cuda"), torch.bfloat16, False)
    rows = []
    for L in args.contexts:
        ids = torch.randint(0, model.config.vocab_size, (1, L), device="cuda")
        row = {"context": L, "budget": args.budget}
        for label, mode, drafter, budget in (("prefill alone", "ar", None, None),
                                             ("prefill + chunk selection", "chunk", model, args.budget)):
            static_engine.release_engines()
            torch.cuda.empty_cache()
            with torch.no_grad(), static_attention_for(model):
                engine = static_engine.engine_for(model, drafter, mode, budget, 5, L + 64, 64, False)
                seconds, peak = prefill_seconds(engine, ids, args.repeats)
            del engine  # else its caches stay alive while the next engine allocates (and count in its peak)
            row[label] = {"seconds": seconds, "peak_gib": peak / 2**30}
            print(f"{L}: {label}: {seconds * 1e3:.1f} ms, peak {peak / 2**30:.1f} GiB", flush=True)
        alone, chunk = row["prefill alone"]["seconds"], row["prefill + chunk selection"]["seconds"]
        row["selection_ms"], row["selection_share"] = (chunk - alone) * 1e3, (chunk - alone) / alone
        rows.append(row)
    static_engine.release_engines()
    lines = ["| context | prefill alone ms | with chunk selection ms | selection ms | share | peak GiB alone / with |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        a, c = r["prefill alone"], r["prefill + chunk selection"]
        lines.append(f"| {r['context']} | {a['seconds'] * 1e3:.1f} | {c['seconds'] * 1e3:.1f} | "
                     f"{r['selection_ms']:.1f} | {r['selection_share']:.1%} | {a['peak_gib']:.1f} / {c['peak_gib']:.1f} |")
    table = "\n".join(lines)
    print(table)
    (out / "selection_cost.json").write_text(json.dumps(
        {"commit": commit(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
         "settings": vars(args), "rows": rows}, indent=1))
    (out / "selection_cost.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
