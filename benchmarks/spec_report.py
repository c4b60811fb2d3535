"""Tables and plots of the speculative-decoding benchmark (``benchmarks/speculative.py``)."""

from __future__ import annotations

from pathlib import Path

from spec_methods import ALL_METHODS, AR_METHODS, BUDGET_METHODS, GAMMA_METHODS, LABELS, _sweep_budgets



def _ctx(c: int) -> str:
    return f"{c // 1024}K" if c % 1024 == 0 else str(c)


def _fmt(x, spec=".2f", none="–"):
    return none if x is None else format(x, spec)


def _cell_text(cell, show_gamma: bool) -> str:
    if cell is None:
        return "–"
    if not cell.get("ok"):
        return "error"
    sp = _fmt(cell.get("speedup_vs_ar")) + "×"
    acc = _fmt(100 * cell["acceptance_rate"], ".1f") if "acceptance_rate" in cell else "–"
    text = f"{sp} / {acc}"
    if show_gamma and cell.get("gamma") is not None:
        text += f" (γ={cell['gamma']})"
    if cell.get("mismatches"):
        text += " **MISMATCH**"
    elif cell.get("ties"):
        text += " (tie†)"
    return text


def _fixed_gamma(gammas) -> int:
    return 5 if 5 in gammas else sorted(gammas)[len(gammas) // 2]


def table1(cells: list[dict], args, panel: str) -> str:
    """BudgetDraft Table 1 layout: rows = methods, columns = context × budget, "speedup vs AR / acceptance %".

    panel "best": for each cell the γ with the best speedup; panel "fixed": γ = _fixed_gamma."""
    g_fixed = _fixed_gamma(args.gammas)
    cols = [(c, b) for c in args.contexts for b in args.budgets]
    head = "| method | " + " | ".join(f"{_ctx(c)} B={b}" for c, b in cols) + " |"
    lines = [head, "|---|" + "---|" * len(cols)]
    index = {(x["method"], x["context"], x["budget"], x["gamma"]): x for x in cells}
    ar_row = []
    for c, _ in cols:
        x = index.get(("ar", c, None, None))
        ar_row.append(f"{x['tokens_per_s']:.1f} tok/s" if x and x.get("ok") else "–")
    lines.append("| AR (ours), throughput | " + " | ".join(ar_row) + " |")
    for m in args.methods:
        if m == "ar":
            continue
        row = []
        for c, b in cols:
            if m in AR_METHODS:
                cand = [index.get((m, c, None, None))]
            else:
                bb = b if m in BUDGET_METHODS else None
                gs = args.gammas if panel == "best" else [g_fixed]
                cand = [index.get((m, c, bb, g)) for g in gs]
            cand = [x for x in cand if x is not None]
            good = [x for x in cand if x.get("ok") and x.get("speedup_vs_ar") is not None]
            pick = max(good, key=lambda x: x["speedup_vs_ar"]) if good else (cand[0] if cand else None)
            row.append(_cell_text(pick, panel == "best"))
        lines.append(f"| {LABELS[m]} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def detail_table(cells: list[dict], args) -> str:
    g = _fixed_gamma(args.gammas)
    lines = ["| method | ctx | B | γ | tok/s | vs AR | vs stock AR | accept % | τ | peak GB | prefill s | draft s | "
             "verify s | other s | identical |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in sorted(cells, key=lambda x: (x["context"], ALL_METHODS.index(x["method"]), x["budget"] or 0,
                                          x["gamma"] or 0)):
        if x["gamma"] not in (None, g):
            continue
        if not x.get("ok"):
            lines.append(f"| {x['method']} | {_ctx(x['context'])} | {x['budget'] or '–'} | {x['gamma'] or '–'} | "
                         f"error: {x['errors'][0][:80]} |" + " |" * 10)
            continue
        acc = _fmt(100 * x["acceptance_rate"], ".1f") if "acceptance_rate" in x else "–"
        lines.append(
            f"| {x['method']} | {_ctx(x['context'])} | {x['budget'] or '–'} | {x['gamma'] or '–'} | "
            f"{x['tokens_per_s']:.1f} | {_fmt(x.get('speedup_vs_ar'))} | {_fmt(x.get('speedup_vs_stock'))} | {acc} | "
            f"{_fmt(x.get('tau'))} | {_fmt(x.get('peak_memory_gb'), '.3f')} | {_fmt(x.get('prefill_seconds'), '.3f')} | "
            f"{_fmt(x.get('draft_seconds'), '.3f')} | {_fmt(x.get('verify_seconds'), '.3f')} | "
            f"{_fmt(x.get('other_seconds'), '.3f')} | {_identity_text(x)} |")
    return "\n".join(lines)


def _identity_text(cell: dict) -> str:
    if cell.get("mismatches"):
        return "**NO**"
    if cell.get("ties"):
        return "tie†"
    return "yes" if cell["identical"] else "**NO**"


def _where(x: dict) -> str:
    return f"{x['method']} ctx={x['context']} B={x['budget']} γ={x['gamma']}"


def failures(cells: list[dict]) -> list[str]:
    """Errors, and outputs that differ from their reference other than by a numerical tie (see :func:`tie_check`)."""
    out = []
    for x in cells:
        for e in x["errors"]:
            out.append(f"ERROR    {_where(x)}: {e}")
        for mm in x.get("mismatches", []):
            out.append(f"MISMATCH {_where(x)}: {mm}")
    return out


def ties(cells: list[dict]) -> list[str]:
    """Divergences from the reference that :func:`tie_check` found to be ties of the run's dtype."""
    out = []
    for x in cells:
        for t in x.get("ties", []):
            out.append(f"{_where(x)}, prompt {t['prompt']}, new token {t['position']}: AR {t['expected']}, "
                       f"method {t['got']}; float64 margin {t['float64_margin']:+.4f} (float64 picks the "
                       f"{'AR' if t['float64_picks'] == 'expected' else 'method' if t['float64_picks'] == 'got' else 'either'}"
                       f" token), {t['dtype']} error on these logits {t['run_dtype_error']:.4f}")
    return out


# ---------------------------------------------------------------------------------------------------- plots


def plots(cells: list[dict], args, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    colors = {m: plt.get_cmap("tab10")(i) for i, m in enumerate(ALL_METHODS)}
    ok = [x for x in cells if x.get("ok")]
    g_fixed = _fixed_gamma(args.gammas)
    budget_methods = [m for m in BUDGET_METHODS if m in args.methods]

    # Fig. 1: acceptance vs context, one line per budget, one panel per sparse method.
    if budget_methods:
        fig, axes = plt.subplots(1, len(budget_methods), figsize=(4.2 * len(budget_methods), 3.4), squeeze=False)
        for ax, m in zip(axes[0], budget_methods):
            for b in args.budgets:
                pts = sorted((x["context"], 100 * x["acceptance_rate"]) for x in ok
                             if x["method"] == m and x["budget"] == b and x["gamma"] == g_fixed and "acceptance_rate" in x)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"B={b}")
            ax.set_title(f"{m} (γ={g_fixed})", fontsize=9)
            ax.set_xlabel("context (tokens)")
            ax.set_xticks(args.contexts, [_ctx(c) for c in args.contexts])
            ax.set_ylim(0, 100)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("acceptance (%)")
        for ax in axes[0]:
            if ax.get_lines():
                ax.legend(fontsize=8)
                break
        fig.tight_layout()
        fig.savefig(out / "acceptance_vs_context.png", dpi=120)
        plt.close(fig)
        written.append("acceptance_vs_context.png")

    # Fig. 3: budget-averaged acceptance and speedup vs γ; Table 4: peak memory vs γ.
    swept = [m for m in args.methods if m in GAMMA_METHODS + BUDGET_METHODS]

    swept_budgets = _sweep_budgets(args)

    def averaged(m, c, g, key):
        vals = [x[key] for x in ok if x["method"] == m and x["context"] == c and x["gamma"] == g
                and x.get(key) is not None and (x["budget"] is None or x["budget"] in swept_budgets)]
        return sum(vals) / len(vals) if vals else None

    for name, keys in (("gamma_sweep.png", [("acceptance_rate", "acceptance (%)", 100),
                                            ("speedup_vs_ar", "speedup vs AR (×)", 1)]),
                       ("memory_vs_gamma.png", [("peak_memory_gb", "peak GPU memory (GB)", 1)])):
        if not swept:
            break
        if name == "memory_vs_gamma.png" and not any(x.get("peak_memory_gb") for x in ok):
            continue
        fig, axes = plt.subplots(len(args.contexts), len(keys), figsize=(4.8 * len(keys), 2.8 * len(args.contexts)),
                                 squeeze=False)
        for i, c in enumerate(args.contexts):
            for j, (key, label, scale) in enumerate(keys):
                ax = axes[i][j]
                for m in swept:
                    pts = [(g, averaged(m, c, g, key)) for g in sorted(args.gammas)]
                    pts = [(g, v * scale) for g, v in pts if v is not None]
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m, color=colors[m])
                if key == "speedup_vs_ar":
                    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
                ax.set_title(f"{_ctx(c)} context", fontsize=9)
                ax.set_xlabel("γ (draft length)")
                ax.set_xticks(sorted(args.gammas))
                ax.set_ylabel(label)
                ax.grid(alpha=0.3)
        handles = {}
        for ax in axes.flat:
            for line in ax.get_lines():
                if not line.get_label().startswith("_"):
                    handles.setdefault(line.get_label(), line)
        if handles:
            axes[0][-1].legend(handles.values(), handles.keys(), fontsize=7)
        fig.suptitle("budget-method curves averaged over B = " + ", ".join(map(str, swept_budgets)), fontsize=9)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        written.append(name)
    return written
