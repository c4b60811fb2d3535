"""The headline plot: decoding speed (generated tokens per second) against context at Llama-3.1-8B shape, batch 1,
one NVIDIA H100, for HF's static-cache AR, our graph AR and each speculative mode. No GPU and no model: it only
reads JSON results already committed under ``benchmarks/results/`` and writes a PNG and a table (the table is
``BENCHMARKS.md``'s "8B shape: measured and projected tokens/s", written by ``benchmarks/tables.py``; the runs are
described in ``benchmarks/results/HISTORY.md``, "Plain decoding at 8B shape" and "Speculation per mode at 8B
shape").

Weights are random bf16 tensors of the published Llama-3.1-8B verifier and Llama-3.2-1B drafter shapes: these runs
measure costs, never acceptance. Every number drawn is read from a JSON file or derived from JSON numbers as follows.

Measured end to end (solid lines). ``bench-scale``'s JSON holds ``seconds`` per generated token (a long minus a
short run from the same prompt, so the prefill cancels); tokens/s = 1 / seconds:

* ``grouped-linear-h100-2026-11-26/e2e.json`` (16K, 128K; HISTORY.md's run a, commit 4feb810) and
  ``quant-8b-h100-2026-11-27b/scale-8b-hf-static.json`` (32K; run b, 9a16edf + 8c8592d): ``hf-static-ar`` and
  ``graph-ar``. No end-to-end run of the current code was made at 64K, so the lines join 32K to 128K.

Projections (dashed lines, hollow markers; not end-to-end runs): one draft-and-verify round makes τ tokens and takes
γ·t_draft + t_verify, so tokens/s = τ / (γ·t_draft + t_verify), γ = 5, with the step costs (``seconds`` of
captured steps, H100) from bench-scale's JSON and τ from the real Qwen2.5-Coder 1.5B + 0.5B pair on CPU float32 at
its 8K prompts, pooled over both documents (Σ(new_tokens − 1) / Σ rounds of a method's cells; one τ basis for every
mode):

* int4 self-speculation (no drafter), 32K-128K: steps ``int4-w4-draft`` and ``int4-verify`` of
  ``quant-8b-h100-2026-11-27b/scale-8b-b1.json`` (run b); τ ``int4`` of ``real-cpu-fp32/results.json`` (5.73);
* 1B drafter on a chunk budget of 1024, chain, 16K: ``draft-chunk-1024`` of
  ``trees-bundled-h100-2026-11-27/call3/draft/scale.json`` (46f832a), ``verify-6`` of
  ``tree-kernel-h100-2026-11-27/scale.json`` (3318d04); τ ``chunk-1024`` of
  ``real-chunk-selection-cpu/observe512/results-8k.json`` (3.00);
* the same drafter growing a tree of 16, 16K: ``draft-chunk-1024-t16`` and ``verify-tree-16`` of the same two step
  files; τ ``chunk-1024-t16`` of ``tree-grown-real-cpu-2026-11-27/results-8k-n16.json`` (4.20). No JSON of the
  current code holds the 1B drafter's chunk step at another context, so these two are single points;
* 1B drafter on sink + window 1024 and on a full cache, chain, 16K-128K (marked †): ``draft-window-1024`` /
  ``draft-full`` and ``verify-6`` of ``scale-h100-2026-11-26/steps.json`` (2026-11-26, commit 30c49ce, before the
  grouped GEMV, which took 7-11 % off the AR step); τ ``window4-1024`` of the observe512 file (2.86) and
  ``full`` of ``real-cpu-fp32/results.json`` (3.00).

So the drafters' points use the 8K τ, where HISTORY.md's window / full rows average 4K and 8K; divided by the
captured AR step of the same step file, the int4 points give HISTORY.md's projected speedups (1.44× at 32K). Our
end-to-end AR is a few per cent slower than its captured step, so a projection's ratio to that line is a few
per cent above HISTORY.md's. Prompt lookup is not drawn: its τ is a property of the text (2.86-3.00 on the
real pair's 4K prompts, 1.34-1.66 at 8K), not of the context.

    python benchmarks/headline.py --out docs/headline.png           # make headline-plot
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAIR = "llama-3.1-8b+3.2-1b"
GAMMA = 5

E2E_RUNS = ["grouped-linear-h100-2026-11-26/e2e.json", "quant-8b-h100-2026-11-27b/scale-8b-hf-static.json"]
TAU_8K = 8192
REAL_GRID = "real-cpu-fp32/results.json"
OBSERVE512 = "real-chunk-selection-cpu/observe512/results-8k.json"
TREES = "tree-grown-real-cpu-2026-11-27/results-8k-n16.json"
INT4_STEPS = "quant-8b-h100-2026-11-27b/scale-8b-b1.json"
DRAFT_STEPS = "trees-bundled-h100-2026-11-27/call3/draft/scale.json"
VERIFY_STEPS = "tree-kernel-h100-2026-11-27/scale.json"
OLD_STEPS = "scale-h100-2026-11-26/steps.json"

# label, τ (file, method), step files (draft, verify), step keys (draft, verify), drawn with a †
PROJECTIONS = [
    ("int4 self-speculation, no drafter", (REAL_GRID, "int4"), (INT4_STEPS, INT4_STEPS),
     ("int4-w4-draft", "int4-verify"), False),
    ("1B drafter, chunk budget 1024", (OBSERVE512, "chunk-1024"), (DRAFT_STEPS, VERIFY_STEPS),
     ("draft-chunk-1024", "verify-6"), False),
    ("1B drafter, chunk 1024, tree of 16", (TREES, "chunk-1024-t16"), (DRAFT_STEPS, VERIFY_STEPS),
     ("draft-chunk-1024-t16", "verify-tree-16"), False),
    ("1B drafter, sink + window 1024", (OBSERVE512, "window4-1024"), (OLD_STEPS, OLD_STEPS),
     ("draft-window-1024", "verify-6"), True),
    ("1B drafter, full cache", (REAL_GRID, "full"), (OLD_STEPS, OLD_STEPS), ("draft-full", "verify-6"), True),
]
DAGGER = "† steps of 2026-11-26 (30c49ce), before the grouped GEMV"


def _load(results: Path, name: str) -> dict:
    return json.loads((results / name).read_text())


def _steps(results: Path, name: str) -> dict[int, dict[str, float]]:
    """Seconds of each step (or per token, end to end) of the 8B pair at batch 1 in a bench-scale JSON, by context."""
    data = _load(results, name)
    return {r["context"]: r["seconds"] for r in data["rows"] if r["pair"] == PAIR and r["batch"] == 1}


def pooled_tau(results: Path, name: str, method: str, context: int = TAU_8K) -> float:
    """τ over every cell of a method at a context: all tokens made by rounds (each cell's first token comes from the
    prefill) over all rounds."""
    cells = [c for c in _load(results, name)["cells"] if c["method"] == method and c["context"] == context]
    assert cells, (name, method, context)
    return sum(c["new_tokens"] - 1 for c in cells) / sum(c["rounds"] for c in cells)


def series(results: Path = RESULTS) -> list[dict]:
    """Each line of the plot: label, whether it is a projection, {context: tokens/s}, τ where projected, sources."""
    e2e: dict[str, dict[int, float]] = {"hf-static-ar": {}, "graph-ar": {}}
    for name in E2E_RUNS:  # a later file replaces an earlier one at the same context (run b's 32K over run a's)
        for ctx, seconds in _steps(results, name).items():
            for key in e2e:
                if key in seconds:
                    e2e[key][ctx] = 1.0 / seconds[key]
    out = [{"label": "HF static-cache AR", "projection": False, "tokens_per_s": e2e["hf-static-ar"],
            "sources": E2E_RUNS},
           {"label": "our graph AR", "projection": False, "tokens_per_s": e2e["graph-ar"], "sources": E2E_RUNS}]
    for label, (tau_file, method), (draft_file, verify_file), (draft_key, verify_key), dagger in PROJECTIONS:
        tau = pooled_tau(results, tau_file, method)
        drafts, verifies = _steps(results, draft_file), _steps(results, verify_file)
        points = {ctx: tau / (GAMMA * drafts[ctx][draft_key] + verifies[ctx][verify_key])
                  for ctx in sorted(drafts) if draft_key in drafts[ctx] and verify_key in verifies.get(ctx, {})}
        out.append({"label": label + (" †" if dagger else ""), "projection": True, "tokens_per_s": points,
                    "tau": tau, "sources": list(dict.fromkeys([tau_file, draft_file, verify_file]))})
    return out


def _k(ctx: int) -> str:
    return f"{ctx // 1024}K"


def table(lines: list[dict]) -> str:
    contexts = sorted({c for s in lines for c in s["tokens_per_s"]})
    head = "| tokens/s, batch 1 | τ | " + " | ".join(_k(c) for c in contexts) + " |"
    rows = [head, "| --- | --- |" + " --- |" * len(contexts)]
    for s in lines:
        label = s["label"] + (" (projection)" if s["projection"] else " (measured)")
        cells = [f"{s['tokens_per_s'][c]:.0f}" if c in s["tokens_per_s"] else "–" for c in contexts]
        tau = f"{s['tau']:.2f}" if "tau" in s else "–"
        rows.append(f"| {label} | {tau} | " + " | ".join(cells) + " |")
    return "\n".join(rows + ["", DAGGER + "; τ: the real pair at 8K, pooled; γ = 5"])


def plot(lines: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6.4))
    contexts = sorted({c for s in lines for c in s["tokens_per_s"]})
    single = iter(["*", "D", "s", "^"])  # a projection of one context: a marker of its own, no line
    for s in lines:
        pts = sorted(s["tokens_per_s"].items())
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        label = s["label"] + (f", τ {s['tau']:.2f} (projection)" if s["projection"] else " (measured)")
        if not s["projection"]:
            ax.plot(xs, ys, linestyle="-", marker="o", linewidth=2.4, label=label)
        elif len(pts) == 1:
            ax.plot(xs, ys, linestyle="none", marker=next(single), markerfacecolor="none", markersize=11,
                    markeredgewidth=1.6, label=label + f", {_k(xs[0])} only")
        else:
            ax.plot(xs, ys, linestyle="--", marker="o", markerfacecolor="none", markersize=7, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [_k(c) for c in contexts])
    ax.minorticks_off()
    ax.set_xlim(contexts[0] / 1.25, contexts[-1] * 1.25)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("context (prompt tokens)")
    ax.set_ylabel("generated tokens / s (batch 1)")
    ax.set_title("Decoding at Llama-3.1-8B / Llama-3.2-1B shapes, RANDOM bf16 weights (costs only), one H100\n"
                 "solid: measured end to end; dashed / hollow: projection = τ / (γ·t_draft + t_verify), γ = 5,\n"
                 "H100 step costs × τ of the real Qwen2.5-Coder 1.5B + 0.5B pair at 8K (CPU)", fontsize=9.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.11), ncol=2, frameon=False)
    fig.text(0.01, 0.005, DAGGER + ". Data: benchmarks/results/ (benchmarks/headline.py's docstring); "
             "BENCHMARKS.md", fontsize=7, color="0.35")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the benchmarks/results folder to read")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "headline.png", help="the PNG to write")
    args = parser.parse_args(argv)
    lines = series(args.results)
    plot(lines, args.out)
    print(table(lines))
    print(f"\nwrote {args.out}")
    return lines


if __name__ == "__main__":
    main()
