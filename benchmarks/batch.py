"""Throughput over a batch of long prompts: HF's batched static-cache AR against our speculative modes (issue 16).

Methods, interleaved within each repeat, for each batch size B:

  hf-static-ar     verifier.generate(batch, cache_implementation="static")     transformers' compiled AR, batched
  graph-ar         hf_sparsekv.graph_greedy_generate(verifier, batch)          our AR on the batched static engine
  chunk-256-g3     generate(batch, assistant_model=drafter, kv_budget=256, num_assistant_tokens=3)
  window-g3        generate(batch, ..., draft_cache="window", kv_budget=1024, num_assistant_tokens=3)
  full-g3          generate(batch, assistant_model=drafter, draft_cache="full", num_assistant_tokens=3)
  int4-self-g5     generate(batch, assistant_model=verifier, draft_cache="int4", num_assistant_tokens=5)

Prompts: B windows of ``--context`` tokens cut from the held-out documents (different documents and offsets), so
every row has the same length (no padding); rows repeat only once every window is taken. Reported: generated tokens
per second over the whole batch (B × new tokens / seconds, prefill included), median of ``--repeats`` after one
warm-up per method and batch size (compilation and capture happen there), peak memory, and for the speculative modes
τ (tokens per verifier forward, median over repeats; each call's counters are kept in the JSON). Prints a table,
writes ``results.json`` and a PNG plot.

    python benchmarks/batch.py --context 16384 --batches 1,4,16,64 --new-tokens 128 --out runs/batch

``--finished``: also time one captured round (draft + verify) of the chunk and window engines with every row live
against only row 0 live (the others finished), median of 20 replays between CUDA events: what a finished row still
costs the batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

import hf_sparsekv
from hf_sparsekv.generation import engine as static_engine
from hf_sparsekv.zoo import eval_documents, load_pair
from provenance import commit

METHODS = ("hf-static-ar", "graph-ar", "chunk-256-g3", "window-g3", "full-g3", "int4-self-g5")


def prompts(context: int, n: int) -> torch.Tensor:
    """``[n, context]`` token windows: each long-enough document in turn, at offsets stepping by 512 tokens."""
    docs = [d for d in eval_documents() if d.numel() >= context]
    if not docs:
        raise SystemExit(f"no held-out document has {context} tokens")
    rows, offset = [], 0
    while len(rows) < n:
        for d in docs:
            if offset + context <= d.numel() and len(rows) < n:
                rows.append(d[offset : offset + context])
        offset += 512
        if offset + context > max(d.numel() for d in docs):
            offset = 0  # reuse windows once every offset is taken
    return torch.stack(rows)


def runner(name: str, verifier, drafter, ids: torch.Tensor, new_tokens: int):
    common = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if name == "hf-static-ar":
        mask = torch.ones_like(ids)
        return lambda: verifier.generate(ids, attention_mask=mask, cache_implementation="static", **common)
    if name == "graph-ar":  # no EOS: every row runs new_tokens, as min_new_tokens makes the others do
        return lambda: hf_sparsekv.graph_greedy_generate(verifier, ids, new_tokens, eos_token_id=[])
    spec = {
        "chunk-256-g3": dict(assistant_model=drafter, kv_budget=256, num_assistant_tokens=3),
        "window-g3": dict(assistant_model=drafter, draft_cache="window", kv_budget=1024, num_assistant_tokens=3),
        "full-g3": dict(assistant_model=drafter, draft_cache="full", num_assistant_tokens=3),
        "int4-self-g5": dict(assistant_model=verifier, draft_cache="int4", num_assistant_tokens=5),
    }[name]
    return lambda: verifier.generate(ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True, **spec,
                                     **common)


def timed(fn, verifier) -> tuple[float, torch.Tensor, dict | None, int]:
    """Seconds, sequences ``[B, L + new]``, the speculative counters (``SpecStats.to_dict()``; None for AR) and peak
    bytes of one call of ``fn``."""
    static_engine.forget_sequences(verifier)  # a repeat at B=1 prefills its whole prompt, as HF static does
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    seconds, peak = time.perf_counter() - start, torch.cuda.max_memory_allocated()
    if isinstance(out, torch.Tensor):
        return seconds, out, None, peak
    return seconds, out.sequences, out.spec_stats.to_dict(), peak


def finished_rows_cost(verifier, drafter, ids: torch.Tensor, new_tokens: int, repeats: int = 20) -> list[dict]:
    """ms per captured round with all rows live and with only row 0 live, for each greedy drafter mode."""
    out = []
    for name in ("chunk-256-g3", "window-g3"):
        runner(name, verifier, drafter, ids, new_tokens)()  # this configuration's engine becomes the current one
        engine = static_engine.current_engine(verifier)
        n0 = engine.n.clone()
        ms = {}
        for label, live in (("all live", [1] * ids.shape[0]), ("row 0 live", [1] + [0] * (ids.shape[0] - 1))):
            engine.live.copy_(torch.tensor(live))
            times = []
            for _ in range(repeats):
                engine.n.copy_(n0)  # every replay starts from the same lengths
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                engine.run_step("draft")
                engine.run_step("verify")
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            ms[label] = statistics.median(times)
        engine.live.zero_()
        out.append(dict(batch=ids.shape[0], method=name, all_live_ms=ms["all live"], one_live_ms=ms["row 0 live"]))
        print(f"B={ids.shape[0]} {name}: round {ms['all live']:.3f} ms with every row live, "
              f"{ms['row 0 live']:.3f} ms with only row 0 live", flush=True)
    return out


def summarize(records: list[dict]) -> list[dict]:
    rows = []
    for b in sorted({r["batch"] for r in records}):
        for name in METHODS:
            rs = [r for r in records if r["batch"] == b and r["method"] == name]
            if rs:
                taus = [r["stats"]["mean_accepted_length"] for r in rs if r["stats"]]
                rows.append(dict(batch=b, method=name, tokens_per_s=statistics.median(r["tokens_per_s"] for r in rs),
                                 tau=statistics.median(taus) if taus else None,
                                 peak_gib=max(r["peak_bytes"] for r in rs) / 2**30, runs=len(rs)))
    for row in rows:
        for base_name, key in (("hf-static-ar", "vs_hf_static"), ("graph-ar", "vs_graph_ar")):
            base = [r for r in rows if r["batch"] == row["batch"] and r["method"] == base_name]
            row[key] = row["tokens_per_s"] / base[0]["tokens_per_s"] if base else None
    return rows


def table(rows: list[dict]) -> str:
    def ratio(x):
        return "-" if x is None else f"{x:.2f}"

    lines = ["| batch | method | tokens/s (batch) | × HF static AR | × our graph AR | τ | peak GiB | runs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['batch']} | {r['method']} | {r['tokens_per_s']:.0f} | {ratio(r['vs_hf_static'])} | "
              f"{ratio(r['vs_graph_ar'])} | {ratio(r['tau'])} | {r['peak_gib']:.2f} | {r['runs']} |" for r in rows]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in METHODS:
        pts = [(r["batch"], r["tokens_per_s"]) for r in rows if r["method"] == name]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("generated tokens/s over the batch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated methods (default: all)")
    p.add_argument("--finished", action="store_true", help="also time a round with finished rows (see above)")
    p.add_argument("--out", default="runs/batch")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    static_engine.MAX_ENGINES_PER_MODEL = 32
    verifier, drafter, _ = load_pair(device="cuda")
    names = [n for n in METHODS if not args.only or n in args.only.split(",")]
    records, first_call, finished = [], {}, []
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = prompts(args.context, batch).cuda()
        for name in tqdm(names, desc=f"warm-up B={batch}"):
            first_call[f"{name}@{batch}"] = timed(runner(name, verifier, drafter, ids, args.new_tokens), verifier)[0]
        for rep in range(args.repeats):
            for name in tqdm(names, desc=f"B={batch} rep {rep}", leave=False):
                seconds, seq, stats, peak = timed(runner(name, verifier, drafter, ids, args.new_tokens), verifier)
                generated = batch * (seq.shape[1] - ids.shape[1])
                if stats:
                    stats.pop("rows")  # each row's counters: the totals suffice here
                records.append(dict(batch=batch, rep=rep, method=name, seconds=seconds, tokens=generated,
                                    tokens_per_s=generated / seconds, stats=stats, peak_bytes=peak))
        if args.finished and batch > 1:
            finished += finished_rows_cost(verifier, drafter, ids, args.new_tokens)
        summary = summarize(records)
        payload = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), commit=commit(),
                       torch=torch.__version__, settings=vars(args), summary=summary, first_call_s=first_call,
                       finished_rows=finished, records=records)
        (out / "results.json").write_text(json.dumps(payload, indent=1))  # after each batch size
        print(table([r for r in summary if r["batch"] == batch]), flush=True)
    plot(summarize(records), out / "tokens_per_second.png")
    print("first call (compile + capture + run), s:", json.dumps({k: round(v, 1) for k, v in first_call.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
