"""The engine at real model shapes (random weights of the real shapes, bf16, one CUDA GPU): every method's cost per
token against its bandwidth floor, 16K-128K, one run, methods interleaved per (pair, context, batch).

Pairs: Llama-3.1-8B verifier + Llama-3.2-1B drafter; Qwen2.5-7B + Qwen2.5-0.5B (published config shapes, random
weights: only costs are measured here, never acceptance). Per (pair, context L, batch B):

* end to end, per generated token, as the difference of a long and a short run from the same prompt (so the
  prefill cancels): ``hf-eager-ar`` (``generate()``, dynamic cache), ``hf-static-ar`` (``generate()`` on a
  ``StaticCache``: transformers compiles its decode step), ``graph-ar`` (``hf_sparsekv.graph_greedy_generate``: our
  captured AR);
* step costs of the static engine (captured CUDA graphs, compiled as ``generate()`` does unless ``--compile 0``): ``ar``
  (1 token), ``verify-4``/``verify-6`` (γ+1 tokens), ``verify-tree`` (the tree of a drafter's chain and a retrieved
  one, 2γ+1 tokens, as retrieval beside a drafter verifies it), ``verify-tree-N`` (a ``draft_tree_size=N`` tree, N + 1
  tokens), ``draft-full``/``draft-chunk-B``/``draft-window-B`` (the
  drafter, one draft round / γ), ``draft-chunk-B-tN``/``draft-window-B-tN`` (the drafter's round of a
  ``draft_tree_size=N`` tree / γ: the catch-up and the tree blocks, first budget of ``--budgets``), ``int4-draft``/``int4-verify`` (self-speculation on the quantized store),
  ``int4-w4-draft`` (its draft step on 4-bit draft weights, ``draft_weights="int4"``);
* the floor of each: the bytes the step must read once (weights, plus the keys/values it attends to: the full
  context, the budget, or the INT4/INT8 codes) over the device-to-device copy rate measured in the same run;
* peak memory of each (``max_memory_allocated`` after a reset, the models included);
* break-even τ* = (γ·t_draft + t_verify) / t_AR per speculative mode, and a PROJECTION (labelled, not measured):
  speedup over our AR ≈ τ / τ*, over HF static AR ≈ τ·t_hf_static / (γ·t_draft + t_verify), with τ the real-weight
  acceptance of the Qwen2.5-Coder pair measured on CPU (``benchmarks/results/real-cpu-fp32/results.json``, 4K/8K).

Writes ``scale.json``, ``scale.md`` and ``scale.png`` (ms per token against context, one line per method, the AR
floor drawn) under ``--out``. ``--profile L`` also writes a torch.profiler table of captured steps at L (``--profile-steps``; default the AR step).

    python benchmarks/scale.py --out runs/scale                       # the whole grid (CUDA, tens of minutes)
    python benchmarks/scale.py --pairs llama-3.1-8b+3.2-1b --contexts 16384 --batches 1 --only ar verify-6
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

import hf_sparsekv  # noqa: F401  (registers the attention implementations the models are built with)
from provenance import commit
from real_cost import build, measured_acceptance, time_graph_step
from step_kernels import replay_kernels

PAIRS = {"llama-3.1-8b+3.2-1b": ("llama-3.1-8b", "llama-3.2-1b"), "qwen2.5-7b+0.5b": ("qwen2.5-7b", "qwen2.5-0.5b")}
E2E = ("hf-eager-ar", "hf-static-ar", "graph-ar")
TREE_SIZES = (16, 32)  # verify-tree-N: a draft_tree_size=N verification (N + 1 tokens)
ACCEPTANCE = Path(__file__).parent / "results" / "real-cpu-fp32" / "results.json"


def weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads: every parameter once, except an input embedding table that is not
    tied to the output layer (a step gathers one row of it per token)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    if embedding is not model.get_output_embeddings().weight:
        total -= embedding.numel() * embedding.element_size()
    return total


def kv_bytes(model, tokens: int, bits: int = 16) -> int:
    """Keys + values of ``tokens`` tokens over all layers at ``bits`` per element (+ INT4/INT8 scales ignored)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * tokens * bits // 8


def _free():
    from hf_sparsekv.generation import engine as static_engine

    static_engine.release_engines()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def per_token_e2e(method: str, verifier, ids: torch.Tensor, short: int, long: int, repeats: int,
                  cache_len: int | None = None) -> tuple[float, int]:
    """Seconds per decoded token of ``method`` (median over repeats of (t_long − t_short) / (long − short)) and its
    peak memory. ``cache_len``: hf-static-ar's cache length (default: the prompt + ``long``; one length for several
    prompts compiles transformers' step once)."""
    from transformers import StaticCache

    import hf_sparsekv

    def run(new):
        if method == "graph-ar":
            return hf_sparsekv.graph_greedy_generate(verifier, ids, max_new_tokens=new, eos_token_id=[])
        kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        if method == "hf-static-ar":  # one cache length for both runs: transformers compiles its step once
            cache = StaticCache(config=verifier.config, max_cache_len=cache_len or ids.shape[1] + long)
            kwargs["past_key_values"] = cache
        return verifier.generate(ids, **kwargs)

    def clock(new):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = run(new)
        torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + new, (method, out.shape)
        return time.perf_counter() - t0

    clock(short)  # warm-up: compilation, capture (once per engine: a smaller context reuses a larger engine)
    clock(long)
    torch.cuda.reset_peak_memory_stats()
    costs = []
    for _ in range(repeats):
        costs.append((clock(long) - clock(short)) / (long - short))
    return statistics.median(costs), torch.cuda.max_memory_allocated()


def step_costs(verifier, drafter, prompts: dict, args, only,
               partial: Path | None = None) -> dict[int, dict[str, tuple[float, int, float]]]:
    """context -> name -> (seconds per step, peak bytes, kernels per step) of the static engine's captured steps (a
    draft round's time and kernels divided by γ; kernels: one profiled replay's CUDA kernels). ``partial``: a JSON
    file rewritten after each engine, so that a run cut short keeps what it measured. One engine per mode, sized for
    the longest context and re-prefilled for each shorter one (its steps are compiled and captured once; the kernels
    read each row's current length from the device), as a user's engine serving several lengths is."""
    from hf_sparsekv.generation import engine as static_engine
    from hf_sparsekv.generation.graph_steps import static_attention_for

    g, longest, out = args.gamma, max(prompts), {L: {} for L in prompts}
    plan = [("ar", "ar", None, None, 1, ["ar_step"]), ("verify-4", "full", None, drafter, 3, ["verify"]),
            ("verify-6", "full", None, drafter, g, ["draft", "verify"]),
            ("verify-tree", "full", None, drafter, g, ["verify_tree"])]
    plan += [(f"verify-tree-{n}", "full", None, drafter, g, ["verify_tree"]) for n in TREE_SIZES]
    plan += [(f"chunk-{b}", "chunk", b, drafter, g, ["draft"]) for b in args.budgets]
    plan += [(f"chunk-{args.budgets[0]}-t{n}", "chunk", args.budgets[0], drafter, g, ["draft"]) for n in TREE_SIZES]
    plan += [(f"window-{args.window}-t{n}", "window", args.window, drafter, g, ["draft"]) for n in TREE_SIZES]
    plan += [(f"window-{args.window}", "window", args.window, drafter, g, ["draft"]),
             ("int4", "int4", args.group_size, verifier, g, ["draft", "verify"]),
             ("int4-w4", "int4", args.group_size, verifier, g, ["draft"])]  # QuantSpec's 4-bit draft weights
    for label, mode, budget, draft_model, gamma, names in plan:
        wanted = [n for n in names if _step_name(label, n) in only]
        if not wanted:
            continue
        _free()
        with torch.no_grad(), static_attention_for(verifier, *([draft_model] if draft_model is not None else [])):
            engine = static_engine.engine_for(verifier, draft_model, mode, budget, gamma, longest + 64, 64, True,
                                              batch=prompts[longest].shape[0],
                                              draft_weights="int4" if label == "int4-w4" else "full",
                                              retrieval=2 if label == "verify-tree" else 0, tree_size=_tree_of(label))
            for L in sorted(prompts, reverse=True):
                ids = prompts[L]
                torch.cuda.reset_peak_memory_stats()
                engine.prefill([ids[b : b + 1] for b in range(ids.shape[0])])
                for name in wanted:
                    t = time_graph_step(engine, name, torch.device("cuda"), args.step_repeats, 2)
                    per = gamma if name == "draft" else 1
                    out[L][_step_name(label, name)] = (t / per, torch.cuda.max_memory_allocated(),
                                                       len(replay_kernels(engine, name, None)) / per)
                print(f"  {label} {L}: " + " ".join(f"{k}={v[0] * 1e3:.2f}ms/{v[2]:.0f}k" for k, v in out[L].items()),
                      flush=True)
        if partial is not None:
            partial.write_text(json.dumps({L: {k: list(v) for k, v in s.items()} for L, s in out.items()}, indent=1))
        del engine  # else its caches stay alive while the next engine allocates its own (and count in its peak)
    _free()
    return out


def _tree_of(label: str) -> int | None:
    """``draft_tree_size`` of a step label: ``verify-tree-N`` (the verifier's side) or ``<drafter>-tN`` (the
    drafter's tree step: γ drafter forwards, the catch-up and the tree blocks)."""
    if label.startswith("verify-tree-"):
        return int(label[12:])
    base, _, n = label.rpartition("-t")
    return int(n) if base and n.isdigit() else None


def _step_name(label: str, step: str) -> str:
    if label == "ar":
        return "ar"
    if label in ("int4", "int4-w4"):
        return f"{label}-{'draft' if step == 'draft' else 'verify'}"
    if step in ("verify", "verify_tree"):
        return label
    return "draft-full" if label == "verify-6" else f"draft-{label}"


def floors(verifier, drafter, L: int, batch: int, args, bandwidth: float) -> dict[str, float]:
    """Seconds each step must take at least: bytes read once / measured copy rate (bytes read + written)."""
    wv, wd = weight_bytes(verifier), weight_bytes(drafter)
    full = wv + batch * kv_bytes(verifier, L)
    f = {"ar": full, "verify-4": full, "verify-6": full, "verify-tree": full,
         **{f"verify-tree-{n}": full for n in TREE_SIZES}, "draft-full": wd + batch * kv_bytes(drafter, L),
         "int4-draft": wv + batch * kv_bytes(verifier, L, 4), "int4-verify": wv + batch * kv_bytes(verifier, L, 8),
         # 4 bits a weight plus a bfloat16 scale and zero per 128 (the embedding row and norms stay: ~wv / 4)
         "int4-w4-draft": wv * (4 + 32 / 128) / 16 + batch * kv_bytes(verifier, L, 4)}
    for b in args.budgets:
        f[f"draft-chunk-{b}"] = wd + batch * kv_bytes(drafter, b)
    f[f"draft-window-{args.window}"] = wd + batch * kv_bytes(drafter, args.window)
    for n in TREE_SIZES:  # a tree's draft step reads what the chain's does (per drafter forward)
        f[f"draft-chunk-{args.budgets[0]}-t{n}"] = f[f"draft-chunk-{args.budgets[0]}"]
        f[f"draft-window-{args.window}-t{n}"] = f[f"draft-window-{args.window}"]
    f.update({m: full for m in E2E})
    return {k: v / bandwidth for k, v in f.items()}


def copy_rate() -> float:
    """Device-to-device copy, bytes read + written per second (1 GiB, median of 10)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * src.numel() / statistics.median(times[2:])


def speculative_modes(seconds: dict, args) -> dict[str, tuple[str, str, int]]:
    """mode -> (draft step, verify step, γ) for the modes measured."""
    g, modes = args.gamma, {"full/full": ("draft-full", "verify-6", args.gamma)}
    for b in args.budgets:
        modes[f"sparse/full chunk {b}"] = (f"draft-chunk-{b}", "verify-6", g)
    modes[f"window/full {args.window}"] = (f"draft-window-{args.window}", "verify-6", g)
    modes["int4 self-spec"] = ("int4-draft", "int4-verify", g)
    modes["int4 self-spec, 4-bit draft weights"] = ("int4-w4-draft", "int4-verify", g)
    return {m: v for m, v in modes.items() if v[0] in seconds and v[1] in seconds}


def _grid_method(mode: str) -> str:
    if mode == "full/full":
        return "full"
    if mode.startswith("int4 self-spec"):
        return "int4"
    b = mode.rsplit(" ", 1)[1]
    return f"chunk-{b}" if mode.startswith("sparse") else f"window4-{b}"


def project(row: dict, args, measured: dict) -> list[dict]:
    s, out = row["seconds"], []
    if "ar" not in s:
        return out
    for mode, (draft, verify, g) in speculative_modes(s, args).items():
        round_cost = g * s[draft] + s[verify]
        entry = dict(mode=mode, break_even_tau=round_cost / s["ar"])
        taus = [measured[(_grid_method(mode), c)][1] for c in (4096, 8192) if (_grid_method(mode), c) in measured]
        if taus:
            tau = statistics.mean(taus)
            entry.update(tau=tau, projected_vs_graph_ar=tau * s["ar"] / round_cost)
            if "hf-static-ar" in s:
                entry["projected_vs_hf_static"] = tau * s["hf-static-ar"] / round_cost
        out.append(entry)
    return out


PROFILED = {"ar": ("ar", "ar_step", "full"), "int4-draft": ("int4", "draft", "full"),
            "int4-w4-draft": ("int4", "draft", "int4"), "int4-verify": ("int4", "verify", "full"),
            **{f"verify-tree-{n}": ("full", "verify_tree", "full") for n in TREE_SIZES}}


def profile_step(verifier, name: str, L: int, args, path: Path) -> str:
    """torch.profiler table (CUDA time by kernel) of 5 replays of the captured step ``name`` (a key of
    :data:`PROFILED`) at context L."""
    from torch.profiler import ProfilerActivity, profile

    from hf_sparsekv.generation import engine as static_engine
    from hf_sparsekv.generation.graph_steps import static_attention_for

    mode, step, weights = PROFILED[name]
    _free()
    ids = torch.randint(0, verifier.config.vocab_size, (1, L), device="cuda")
    gamma, budget, drafter = (1, None, None) if mode == "ar" else (args.gamma, args.group_size, verifier)
    with torch.no_grad(), static_attention_for(verifier):
        engine = static_engine.engine_for(verifier, drafter, mode, budget, gamma, L + 64, 64, True,
                                          draft_weights=weights,
                                          tree_size=int(name[12:]) if name.startswith("verify-tree-") else None)
        engine.prefill([ids])
        time_graph_step(engine, step, torch.device("cuda"), 3, 2)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.run_step(step)
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90)
    path.write_text(f"captured {name} step, context {L}, 5 replays\n{table}\n")
    return table


def markdown(rows: list[dict], args) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r["seconds"]))
    lines = ["ms per token (end to end: e2e methods; per step: the rest) / its floor:", "",
             "| pair | context | batch | method | ms | floor ms | × floor | kernels a step | peak GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for k in keys:
            if k in r["seconds"]:
                t, fl, peak = r["seconds"][k], r["floors"].get(k), r["peak_bytes"].get(k)
                n = r.get("kernels", {}).get(k)
                lines.append(f"| {r['pair']} | {r['context']} | {r['batch']} | {k} | {t * 1e3:.2f} | "
                             + (f"{fl * 1e3:.2f} | {t / fl:.2f}" if fl else "— | —")
                             + (f" | {n:.0f}" if n else " | —")
                             + (f" | {peak / 2**30:.1f} |" if peak else " | — |"))
    lines += ["", "Our graph AR against HF AR (same run):", "",
              "| pair | context | batch | graph-ar ms | hf-static-ar ms | hf-eager-ar ms | × HF static | × HF eager |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        s = r["seconds"]
        if "graph-ar" in s:
            hs, he = s.get("hf-static-ar"), s.get("hf-eager-ar")
            lines.append(f"| {r['pair']} | {r['context']} | {r['batch']} | {s['graph-ar'] * 1e3:.2f} | "
                         + (f"{hs * 1e3:.2f}" if hs else "—") + " | " + (f"{he * 1e3:.2f}" if he else "—") + " | "
                         + (f"{hs / s['graph-ar']:.2f}" if hs else "—") + " | "
                         + (f"{he / s['graph-ar']:.2f}" if he else "—") + " |")
    lines += ["", "PROJECTION (not a measurement; τ of the real Qwen2.5-Coder pair on CPU at 4K/8K): speedup ≈ τ · t_AR "
              f"/ (γ·t_draft + t_verify), γ = {args.gamma}; break-even τ* = (γ·t_draft + t_verify) / t_AR (our graph "
              "AR step)", "", "| pair | context | batch | mode | τ* | τ | projected × graph AR | projected × HF static |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for p in r["projection"]:
            f = lambda k: f"{p[k]:.2f}" if k in p else "—"  # noqa: E731
            lines.append(f"| {r['pair']} | {r['context']} | {r['batch']} | {p['mode']} | {p['break_even_tau']:.2f} | "
                         f"{f('tau')} | {f('projected_vs_graph_ar')} | {f('projected_vs_hf_static')} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["pair"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, (pair, batch) in zip(axes[0], groups):
        mine = sorted((r for r in rows if (r["pair"], r["batch"]) == (pair, batch)), key=lambda r: r["context"])
        keys = list(dict.fromkeys(k for r in mine for k in r["seconds"]))
        for k in keys:
            pts = [(r["context"], r["seconds"][k] * 1e3) for r in mine if k in r["seconds"]]
            ax.plot(*zip(*pts), marker="o", label=k)
        pts = [(r["context"], r["floors"]["ar"] * 1e3) for r in mine if "ar" in r["floors"]]
        if pts:
            ax.plot(*zip(*pts), "k--", label="AR floor")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per token / per step")
        ax.set_title(f"{pair}, batch {batch} (random weights)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def merge(paths: list[str], args) -> list[dict]:
    """Rows of several scale.json files (runs of different methods at the same cells) combined per (pair, context,
    batch); projections recomputed."""
    cells: dict = {}
    for path in paths:
        for r in json.loads(Path(path).read_text())["rows"]:
            cell = cells.setdefault((r["pair"], r["context"], r["batch"]),
                                    dict(r, seconds={}, peak_bytes={}, floors={}, kernels={}))
            for key in ("seconds", "peak_bytes", "floors", "kernels"):
                cell[key].update(r.get(key, {}))
    measured = measured_acceptance(str(ACCEPTANCE)) if ACCEPTANCE.exists() else {}
    rows = [cells[k] for k in sorted(cells)]
    for row in rows:
        row["projection"] = project(row, args, measured)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/scale")
    p.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    p.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--budgets", type=int, nargs="+", default=[1024])
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--only", nargs="+", default=None, help="methods/steps to run (default: all)")
    p.add_argument("--short", type=int, default=8)
    p.add_argument("--long", type=int, default=72)
    p.add_argument("--repeats", type=int, default=2, help="e2e repeats (median)")
    p.add_argument("--step-repeats", type=int, default=10)
    p.add_argument("--compile", choices=["default", "0", "1"], default="default",
                   help="our steps compiled before capture: as generate() decides (default), never, always")
    p.add_argument("--max-kv-gib", type=float, default=40.0, help="skip (context, batch) whose verifier KV exceeds this")
    p.add_argument("--profile", type=int, default=None, help="also profile captured steps at this context")
    p.add_argument("--profile-steps", nargs="+", default=["ar"], choices=list(PROFILED), help="the steps --profile takes")
    p.add_argument("--merge", nargs="+", default=None, help="only combine these scale.json files into --out")
    args = p.parse_args(argv)
    if args.merge:
        rows = merge(args.merge, args)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "scale.json").write_text(json.dumps(dict(merged_from=args.merge, rows=rows), indent=1))
        (out / "scale.md").write_text(markdown(rows, args) + "\n")
        plot(rows, out / "scale.png")
        print(markdown(rows, args))
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("scale.py times CUDA steps: run it on a CUDA GPU")
    if args.compile != "default":
        os.environ["HF_SPARSEKV_COMPILE"] = args.compile
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = list(E2E) + ["ar", "verify-4", "verify-6", "verify-tree"] + [f"verify-tree-{n}" for n in TREE_SIZES]
    names += ["draft-full"] + [f"draft-chunk-{b}" for b in args.budgets]
    names += [f"draft-window-{args.window}", "int4-draft", "int4-verify", "int4-w4-draft"]
    names += [f"draft-{c}-t{n}" for c in (f"chunk-{args.budgets[0]}", f"window-{args.window}") for n in TREE_SIZES]
    only = set(args.only or names)
    bandwidth = copy_rate()
    print(f"copy rate {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    measured = measured_acceptance(str(ACCEPTANCE)) if ACCEPTANCE.exists() else {}
    rows = []
    for pair in args.pairs:
        v_name, d_name = PAIRS[pair]
        verifier = build(v_name, torch.device("cuda"), torch.bfloat16, False)
        drafter = build(d_name, torch.device("cuda"), torch.bfloat16, False)
        for m in (verifier, drafter):  # HF's own methods run on SDPA (the strongest attention a user has)
            m.generation_config.pad_token_id = 0
            m.set_attn_implementation("sdpa")
        for name in args.profile_steps if args.profile else ():
            print(profile_step(verifier, name, args.profile, args, out / f"profile-{name}-{pair}-{args.profile}.txt"),
                  flush=True)
        for B in args.batches:
            contexts = sorted(L for L in args.contexts if B * kv_bytes(verifier, L) / 2**30 <= args.max_kv_gib)
            skipped = sorted(set(args.contexts) - set(contexts))
            if skipped:
                print(f"[{pair} B={B}] skipped contexts {skipped}: verifier KV over {args.max_kv_gib} GiB", flush=True)
            if not contexts:
                continue
            full = torch.randint(0, verifier.config.vocab_size, (B, max(contexts)), device="cuda")
            prompts = {L: full[:, :L] for L in contexts}
            seconds, peaks, kernels = ({L: {} for L in contexts} for _ in range(3))
            for method in (m for m in E2E if m in only):  # longest first: graph-ar's engine then serves them all
                for L in tqdm(sorted(contexts, reverse=True), desc=f"{pair} B={B} {method}"):
                    try:
                        seconds[L][method], peaks[L][method] = per_token_e2e(method, verifier, prompts[L], args.short,
                                                                             args.long, args.repeats)
                    except torch.OutOfMemoryError:
                        print(f"[{pair} {L} B={B}] {method}: out of memory", flush=True)
                    if method != "graph-ar":
                        _free()
                    print(f"  {method} {L}: {seconds[L].get(method, float('nan')) * 1e3:.2f} ms/token", flush=True)
                _free()
            # (what a run cut short measured: {context: {step: [seconds, peak bytes, kernels]}}, for reading by hand)
            partial = out / f"steps-{pair.replace('+', '_')}-b{B}.partial.json"
            for L, steps in step_costs(verifier, drafter, prompts, args, only, partial).items():
                for k, (t, peak, n) in steps.items():
                    seconds[L][k], peaks[L][k], kernels[L][k] = t, peak, n
            for L in contexts:
                row = dict(pair=pair, verifier=v_name, drafter=d_name, context=L, batch=B, seconds=seconds[L],
                           peak_bytes=peaks[L], kernels=kernels[L],
                           floors=floors(verifier, drafter, L, B, args, bandwidth))
                row["projection"] = project(row, args, measured)
                rows.append(row)
                (out / "scale.json").write_text(json.dumps(dict(rows=rows), indent=1))
                print(f"[{pair} {L} B={B}] " + " ".join(f"{k}={v * 1e3:.2f}ms({v / row['floors'][k]:.2f}x)"
                                                       for k, v in seconds[L].items()), flush=True)
        verifier = drafter = None
        _free()
    result = dict(settings=dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                                commit=commit(), torch=torch.__version__, weights="random, bf16, real shapes",
                                copy_rate_bytes_per_s=bandwidth, gamma=args.gamma, short=args.short, long=args.long,
                                compile=os.environ.get("HF_SPARSEKV_COMPILE", "auto"),
                                acceptance_from=str(ACCEPTANCE) if measured else None),
                  rows=rows)
    (out / "scale.json").write_text(json.dumps(result, indent=1))
    md = markdown(rows, args)
    (out / "scale.md").write_text(md + "\n")
    plot(rows, out / "scale.png")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
