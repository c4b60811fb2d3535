"""Writes every table of BENCHMARKS.md from the results JSON it names, so that a figure lives in one place.

Each table sits between ``<!-- table: NAME -->`` and ``<!-- end table -->`` in BENCHMARKS.md; the prose around the
markers is kept. ``TABLES`` gives each table its kind (one function below per kind), the files it reads under
``benchmarks/results/`` and a few options; the GPU, date, commit and settings printed under a table come from its
files. A kind reads only the keys it shows, so a newer run may add keys.

    python benchmarks/tables.py            # rewrite the tables in BENCHMARKS.md (make tables)
    python benchmarks/tables.py --check    # exit 1, naming each table that differs from its files
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BENCHMARKS = ROOT / "BENCHMARKS.md"

# The run each family of tables reads: a new run is a one-line change here.
RUNS = {
    "lifecycle": "lifecycle-h200-2026-12-04d",
    "lifecycle-later": "lifecycle-h200-2026-12-05",
    "e2e-16k": "e2e-h200-2026-12-03/never-slower-16k-095687a.json",
    "e2e-16k-latest": ["rope-h200-2026-12-03/e2e-16k-fused-b1d68a4.json",
                       "rope-h200-2026-12-03/e2e-16k-fused-c29746b.json", "steps-h200-2026-12-03/e2e-16k-2262244.json"],
    "drafter-prefill": "e2e-h200-2026-12-02/e2e-16k-e6b0d8e.json",
    "e2e-2k": "e2e-h200-2026-12-02/never-slower-2k-a9888b3.json",
    "controller": ["e2e-h200-2026-12-02/fixed-vs-controller-16k-3fc8340.json",
                   "e2e-h200-2026-12-02/fixed-vs-controller-4k-3fc8340.json"],
    "controller-compiled": ["adaptive-compiled-16384-2026-12-05/results.json",
                            "adaptive-compiled-16384-2026-12-05b/results.json"],
    "controller-traces": ["controller-traces-h100-2026-12-05/results.json"],
    "never-slower": [f"never-slower-h200-2026-12-05/never-slower-{k}-2832b96.json" for k in ("16k", "4k")],
    "queued-drafts": ["never-slower-h200-2026-12-05/queue-16k-2832b96.json"],
    "never-slower-h100": [f"never-slower-h100-2026-12-05b/{name}-bdb93d2.json"
                          for name in ("never-slower-16k", "int4-queue-16k", "never-slower-4k")],
    "never-slower-h100-4k-recheck": ["never-slower-h100-2026-12-06/chunk-useless-4k-9eb5a5c.json"],
    "busy-host": ["never-slower-h100-2026-12-05b/busy16-16k-bdb93d2.json"],
    "controller-h100": ["never-slower-h100-2026-12-05b/fixed-vs-controller-16k-bdb93d2.json"],
    "window-prefill": ["window-prefill-cpu-2026-12-05/results.json"],
    "quant-splits": "quant-splits-h100-2026-12-05/quant_splits.json",
    "quant-floors": "never-slower-h100-2026-12-06/quant-floors-9eb5a5c.json",
    "routed": "routed-h100-2026-11-27/results.json",
    "bundled-16k": ["tree-kernel-h100-2026-11-27/bundled-16k.json", "lookup-w4-h100-2026-11-26/graph-engine-16k.json"],
    "batches": [f"batch-int4-h100-2026-11-25/b{b}/results.json" for b in (1, 4, 16, 64)],
    "steps-8b": "scale-h200-2026-12-02/scale/scale.json",
    "steps-8b-latest": "rope-h200-2026-12-03/scale-fused-c29746b.json",
    "drop-in": "chunk-selection-cpu/observe/real-8192.json",
    "controller-cpu": [f"controller-cpu-2026-12-05-0955f3e/controller_cpu_load{n}{order}.json"
                       for n in (0, 2) for order in ("", "_grouped")],
    "acceptance": ["real-cpu-fp32/results.json", "real-chunk-selection-cpu/observe512/results-4k.json",
                   "real-chunk-selection-cpu/observe512/results-8k.json"],
}

TABLES = {
    "lifecycle": dict(kind="lifecycle", files=[f"{RUNS['lifecycle']}/loops.json"]),
    "lifecycle-later-calls": dict(kind="lifecycle_later", files=[f"{RUNS['lifecycle']}/loops.json",
                                                                 f"{RUNS['lifecycle-later']}/alternation.json"]),
    "lifecycle-growth": dict(kind="lifecycle_growth", files=[f"{RUNS['lifecycle-later']}/growth.json"]),
    "routed": dict(kind="e2e", files=[RUNS["routed"]], first_call=True),
    "e2e-16k": dict(kind="e2e", files=[RUNS["e2e-16k"]]),
    "e2e-16k-latest": dict(kind="e2e", files=RUNS["e2e-16k-latest"]),
    "drafter-prefill": dict(kind="e2e", files=[RUNS["drafter-prefill"]]),
    "e2e-2k": dict(kind="e2e", files=[RUNS["e2e-2k"]]),
    "controller": dict(kind="best_fixed", files=RUNS["controller"]),
    "controller-h100": dict(kind="best_fixed", files=RUNS["controller-h100"]),
    "controller-compiled": dict(kind="per_document", files=RUNS["controller-compiled"]),
    "controller-traces": dict(kind="per_document", files=RUNS["controller-traces"]),
    "never-slower": dict(kind="per_document", files=RUNS["never-slower"]),
    "queued-drafts": dict(kind="per_document", files=RUNS["queued-drafts"]),
    "never-slower-h100": dict(kind="per_document", files=RUNS["never-slower-h100"]),
    "never-slower-h100-4k-recheck": dict(kind="per_document", files=RUNS["never-slower-h100-4k-recheck"]),
    "busy-host": dict(kind="per_document", files=RUNS["busy-host"]),
    "window-prefill": dict(kind="window_prefill", files=RUNS["window-prefill"]),
    "quant-splits": dict(kind="quant_splits", files=[RUNS["quant-splits"]]),
    "quant-floors": dict(kind="quant_splits", files=[RUNS["quant-floors"]]),
    "controller-cpu": dict(kind="controller_cpu", files=RUNS["controller-cpu"]),
    "bundled-16k": dict(kind="e2e", files=RUNS["bundled-16k"]),
    "batches": dict(kind="e2e", files=RUNS["batches"]),
    "steps-8b": dict(kind="steps", files=[RUNS["steps-8b"]]),
    "steps-8b-latest": dict(kind="steps", files=[RUNS["steps-8b-latest"]]),
    "headline-8b": dict(kind="headline", files=[]),
    "drop-in": dict(kind="drop_in", files=[RUNS["drop-in"]]),
    "acceptance": dict(kind="acceptance", files=RUNS["acceptance"],
                       only={"real-cpu-fp32/results.json": ["full", "int4"]}),
}

# Readable names of the methods the benchmarks write; others are read from their parts (``chunk-512-g3-nocompile``:
# cache or drafter, ``-gN`` a fixed γ or ``-gA`` the controller, then suffixes); an unknown name shows as itself.
METHODS = {
    "hf-eager-ar": "HF eager AR (`generate(ids)`)",
    "hf-ar": "stock AR (`generate(ids)` without the import)",
    "hf-static-ar": "HF static-cache AR",
    "hf-assisted": "stock assisted generation, without the import",
    "graph-ar": "our graph AR",
    "graph-ar-nocompile": "our graph AR, uncompiled",
    "static-engine": "our AR (`static_engine=True`)",
    "routed": "the routed `assistant_model=` call",
    "assisted": "the routed `assistant_model=` call",
    "assisted-noqueue": "the routed `assistant_model=` call, drafts not queued",
    "full-gA-nocompile": "the routed call, uncompiled steps",
    "lookup": "prompt lookup, N = 5",
    "chunk": "chunk budget 512",
    "full": "full drafter cache",
    "int4": "int4 self-speculation",
}
PARTS = {
    r"chunk-(\d+)": "chunk budget {0}", r"window": "sink + window 1024", r"window(\d+)-(\d+)": "sink {0} + window {1}",
    r"lookup": "prompt lookup", r"hf-lookup": "stock's own prompt lookup (`hf_sparsekv.unregister()`)",
    r"int4-self": "int4 self-speculation", r"int4-self-full": 'int4 self-speculation, `draft_weights="full"`',
    r"selfchunk-(\d+)": "self-drafting, chunk {0}",
    r"useless": "a drafter that never agrees", r"full": "full drafter cache",
}
CACHES = {"observed": "chunk budget, observed selection (the default)", "window": "sink + window",
          "cumulative": "chunk budget, cumulative score (the paper's)"}
SUFFIXES = {"eagerprefill": "eager prefill", "nocompile": "uncompiled", "lookup": "with prompt lookup as a branch",
            "noqueue": "drafts not queued"}
STEPS = {
    "ar": "AR step, 8B", "verify-6": "verify step, 6 tokens, 8B", "draft-full": "1B draft step, full cache",
    "draft-chunk-1024": "1B draft step, chunk 1024", "draft-window-1024": "1B draft step, sink + window 1024",
    "int4-draft": "int4 draft step, INT4 view", "int4-verify": "int4 verify step, 6 tokens, INT8 view",
    "int4-w4-draft": "int4 draft step, 4-bit weights",
}


def method_name(key: str) -> str:
    if key in METHODS:
        return METHODS[key]
    m = re.fullmatch(r"(?P<base>.+?)(-g(?P<g>\d+|A))?(-t(?P<tree>\d+))?(?P<rest>(-[a-z]+)*)", key)
    base = next(((label.format(*b.groups()), pattern) for pattern, label in PARTS.items()
                 if (b := re.fullmatch(pattern, m["base"]))), None)
    rest = [SUFFIXES.get(r) for r in m["rest"].split("-")[1:]]
    if base is None or None in rest:
        return f"`{key}`"
    label, pattern = base
    if m["g"]:
        label += ", controller" if m["g"] == "A" else (f", N = {m['g']}" if "lookup" in pattern else f", γ {m['g']}")
    if m["tree"]:
        label += f", tree of {m['tree']}"
    return ", ".join([label, *rest])


def _k(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else f"{tokens:,}"


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _head(*cells) -> list[str]:
    return [_row(cells), _row(["---"] * len(cells))]


def _num(x, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _load(name: str, results: Path) -> dict:
    return json.loads((results / name).read_text())


def _source(name: str, data: dict, settings: str = "") -> str:
    meta = data.get("settings", {}) if "gpu" not in data and "device" not in data else data
    gpu = meta.get("gpu") or meta.get("device") or ("CPU" if meta.get("cpu") else "?")
    more = f"; {settings}" if settings else ""
    run = f"{gpu}, {meta.get('date', '?')}, commit {meta.get('commit', '?')}{more}"
    return f"Source: `benchmarks/results/{name}` ({run})."


def _run(name: str, data: dict) -> str:
    """The tree a run's file name gives (results files are named after it), else the commit its JSON records."""
    tree = re.search(r"[0-9a-f]{7}$", Path(name).stem)
    return tree.group(0) if tree else data.get("commit", "?")


def _e2e_settings(data: dict) -> str:
    s = data.get("settings", {})
    keys = ("contexts", "docs", "repeats", "new_tokens", "compile", "busy")
    opts = " ".join(f"--{k.replace('_', '-')} {s[k]}" for k in keys if s.get(k) not in (None, 0))
    return f"`{s.get('script', 'graph_engine.py')} {opts}`, prefill included, median"


def quant_splits(spec: dict, results: Path) -> str:
    """A quant_splits.py run: µs of a step's 12 captured quantized-store launches under each split/merge setting (one
    column each), by context and step kind."""
    name = spec["files"][0]
    d = _load(name, results)
    if "floor_us" in d["rows"][0]:  # a run with floors: one row a launch setting, µs against the floor
        lines = _head("context", "step", "setting", "µs (12 launches)", "floor (µs)", "× floor")
        for r in d["rows"]:
            lines.append(_row([_k(r["context"]), r["step"], f"`{r['setting']}`", _num(r["us_12_launches"], 1),
                               _num(r["floor_us"], 1), _num(r["us_12_launches"] / r["floor_us"], 1)]))
        rate = d["copy_rate"] / 1e12
        settings = f"`quant_splits.py`, median of 300 replays of 12 launches; copy rate {rate:.2f} TB/s"
        return "\n".join(lines + ["", _source(name, d, settings)])
    settings = list(dict.fromkeys(r["setting"] for r in d["rows"]))
    us = {(r["context"], r["step"], r["setting"]): r["us_12_launches"] for r in d["rows"]}
    lines = _head("context", "step", *[f"`{s}` (µs)" for s in settings])
    for context, step in dict.fromkeys((r["context"], r["step"]) for r in d["rows"]):
        lines.append(_row([_k(context), step, *[_num(us.get((context, step, s)), 1) for s in settings]]))
    return "\n".join(lines + ["", _source(name, d, "`quant_splits.py`, median of 300 replays of 12 launches")])


# --- one function per kind: (spec, results folder) -> markdown -------------------------------------------------


def lifecycle(spec: dict, results: Path) -> str:
    """Each method's first call and loop of prompts from its first call, its warm call at the longest prompt, and the
    second (longer) loop, × HF static-cache AR's loop."""
    name = spec["files"][0]
    d = _load(name, results)
    long_loop = d.get("long_loop", {})
    n_long = len(d.get("long_loop_lengths", []))
    base = sum(d["loop"].get("hf-static-ar", [float("nan")]))
    long_base = sum(long_loop.get("hf-static-ar", [float("nan")]))
    lines = _head("method", "first call (s)", f"{len(d['lengths'])}-prompt loop (s)", "× HF static",
                  f"warm call at {_k(max(d['lengths']))} (s)", f"{n_long}-prompt loop (s)", "× HF static")
    for key, times in d["loop"].items():
        longer = long_loop.get(key)
        lines.append(_row([method_name(key), _num(times[0], 1), _num(sum(times), 1), _num(base / sum(times)),
                           _num(d.get("warm", {}).get(key), 3), _num(sum(longer), 1) if longer else "–",
                           _num(long_base / sum(longer)) if longer else "–"]))
    lengths = ", ".join(f"{n:,}" for n in d["lengths"])
    settings = (f"{d.get('models', '')}, {d.get('new_tokens')} new tokens, `HF_SPARSEKV_COMPILE={d.get('compile')}`; "
                f"first loop {lengths} tokens; second loop {n_long} prompts of "
                f"{min(d.get('long_loop_lengths', [0]))}-{max(d.get('long_loop_lengths', [0]))} tokens"
                + (f"; {d['long_loop_note']}" if "long_loop_note" in d else ""))
    return "\n".join(lines + ["", _source(name, d, settings)])


def lifecycle_growth(spec: dict, results: Path) -> str:
    """A prompt that outgrows a traced engine (``lifecycle.py --growth``, a fresh process each): the growth call
    against the warm calls after it, and what it compiled."""
    name = spec["files"][0]
    d = _load(name, results)
    lines = _head("method", "positions", "the growing call (s)", "warm call after it (s)", "more than warm (s)",
                  "dynamo graphs compiled", "Triton kernels compiled")
    for key, g in d.get("growth", {}).items():
        warm = statistics.median(g["warm"])
        lines.append(_row([method_name(key), f"{g['positions'][0]:,} → {g['positions'][1]:,}", _num(g["growth_s"], 3),
                           _num(warm, 3), _num(g["growth_s"] - warm, 3), g["dynamo_graphs"],
                           len(g["triton_kernels"])]))
    settings = ("`HF_SPARSEKV_COMPILE=light` (steps traced from the first call); three calls at 3,000 tokens, then "
                "one at 12,000, then three warm")
    return "\n".join(lines + ["", _source(name, d, settings)])


def lifecycle_later(spec: dict, results: Path) -> str:
    """The calls after the first: a chat whose turns extend the previous output (each turn against a warm call of
    the same length on another prompt, and on its own prompt with nothing held), and configurations alternated on one
    model (each round against warm; from the last file where two are named)."""
    name, alt_name = spec["files"][0], spec["files"][-1]
    d, a = _load(name, results), _load(alt_name, results)
    chat, alt = d.get("chat", {}), a.get("alternation", {})
    lines = _head("method", "chat: first turn (s)", "chat: later turns (s)",
                  "worst later turn / warm call, unrelated prompt", "/ warm call, its own prompt",
                  "alternation: first round (s)", "later rounds / warm call on the same prompt")
    for key in list(chat) + [k for k in alt if k not in chat]:
        turns, later = chat.get(key, []), chat.get(key, [])[1:]
        cells = [method_name(key)]
        if later:
            same = max(t["s"] / t["same_s"] for t in later) if all("same_s" in t for t in later) else None
            cells += [_num(turns[0]["s"]), f"{min(t['s'] for t in later):.3f}-{max(t['s'] for t in later):.3f}",
                      _num(max(t["s"] / t["single_s"] for t in later)), _num(same)]
        else:
            cells += ["–"] * 4
        if len(alt.get(key, {}).get("rounds", [])) > 1:
            rounds = alt[key]["rounds"]
            warm = alt[key].get("warm_same", [alt[key]["warm"]] * len(rounds))  # (older runs: one warm time)
            ratios = [t / w for t, w in zip(rounds[1:], warm[1:])]
            cells += [_num(rounds[0], 3), f"{min(ratios):.2f}-{max(ratios):.2f}"]
        else:
            cells += ["–"] * 2
        lines.append(_row(cells))
    first = next(iter(chat.values()), [{}])
    alternation = (f"alternation on a {_k(a['lengths'][1]) if len(a['lengths']) > 1 else '?'}-token prompt"
                   + (f", `HF_SPARSEKV_COMPILE={a['alternation_compile']}`" if "alternation_compile" in a else ""))
    chat_settings = f"chat of {len(first)} turns from {first[0].get('length')} tokens" if chat else ""
    if alt_name == name:
        sources = [_source(name, d, "; ".join(part for part in (chat_settings, alternation) if part))]
    else:
        sources = [_source(name, d, chat_settings), _source(alt_name, a, alternation)]
    return "\n".join(lines + [""] + sources)


def e2e(spec: dict, results: Path) -> str:
    """graph_engine.py or batch.py runs' summaries: tokens/s of each method, × HF static-cache AR and × our graph AR
    of the same run, τ, peak memory, identity (``only``: the methods shown, in the run's order)."""
    first = spec.get("first_call")
    lines, sources = [], []
    for name in spec["files"]:
        d = _load(name, results)
        rows = [s for s in d["summary"] if s["method"] in spec.get("only", [s["method"]])]
        by_batch = "batch" in rows[0]  # batch.py: one context, rows by batch size, no identity column
        several = len(spec["files"]) > 1 and not by_batch  # rows of several runs: a column names each run
        if not lines:
            cols = ["run"] * several + ["batch" if by_batch else "context", "method", "tokens/s", "× HF static",
                                        "× our graph AR", "τ", "peak GiB"]
            lines = _head(*cols, *["identical"] * (not by_batch), *["first call (s)"] * bool(first))
        for s in rows:
            cells = [_run(name, d)] * several + [
                s["batch"] if by_batch else _k(s["context"]), method_name(s["method"]), _num(s["tokens_per_s"], 0),
                _num(s.get("vs_hf_static")), _num(s.get("vs_graph_ar")), _num(s.get("tau")), _num(s.get("peak_gib"))]
            if not by_batch:
                cells.append(s.get("identical", "–"))
            if first:
                cells.append(_num(d.get("first_call_s", {}).get(f"{s['method']}@{s['context']}"), 1))
            lines.append(_row(cells))
        settings = (f"`batch.py --context {d['settings'].get('context')} --new-tokens "
                    f"{d['settings'].get('new_tokens')}`, prefill included" if by_batch else _e2e_settings(d))
        sources.append(_source(name, d, settings))
    return "\n".join(lines + [""] + sources)


def per_document(spec: dict, results: Path) -> str:
    """A graph_engine.py run by document: each method's median seconds a call × our graph AR's on the same document
    (the never-slower criterion is per document), its τ there, and its first call (compilation included)."""
    lines, sources = [], []
    for name in spec["files"]:
        d = _load(name, results)
        calls: dict = {}
        for r in d["records"]:
            calls.setdefault((r["context"], r["method"], r["doc"]), []).append(r)
        docs = sorted({doc for _, _, doc in calls})
        several = len(spec["files"]) > 1  # rows of several runs: a column names each run's commit
        if not lines:
            lines = _head(*["run"] * several, "context", "method", *[f"doc {doc}: × our graph AR" for doc in docs],
                          *[f"doc {doc}: τ" for doc in docs], "first call (s)")
        for context, method in dict.fromkeys((c, m) for c, m, _ in calls):
            ratios, taus = [], []
            for doc in docs:
                base = calls.get((context, "graph-ar", doc))
                mine = calls.get((context, method, doc), [])
                ratios.append(_num(statistics.median(r["seconds"] for r in base)
                                   / statistics.median(r["seconds"] for r in mine)) if base and mine else "–")
                tau = [r["tau"] for r in mine if r.get("tau") is not None]
                taus.append(_num(statistics.median(tau)) if tau else "–")
            lines.append(_row([*[_run(name, d)] * several, _k(context), method_name(method), *ratios, *taus,
                               _num(d.get("first_call_s", {}).get(f"{method}@{context}"), 1)]))
        sources.append(_source(name, d, _e2e_settings(d)))
    return "\n".join(lines + [""] + sources)


def best_fixed(spec: dict, results: Path) -> str:
    """The controller (method ``...-gA...``) against the best of the fixed γ of the same cell (``...-gN...``),
    chosen in hindsight, and against our uncompiled graph AR of the same run."""
    lines = _head("context", "cell", "best fixed γ (tokens/s)", "controller (tokens/s)", "controller / best",
                  "controller / our AR uncompiled", "τ (controller)")
    sources = []
    for name in spec["files"]:
        d = _load(name, results)
        by = {s["method"]: s for s in d["summary"]}
        base = by.get("graph-ar-nocompile", {}).get("tokens_per_s")
        for key, s in by.items():
            m = re.fullmatch(r"(.+)-gA(-.*)?", key)
            if not m:
                continue
            fixed = {int(g.group(1)): v for k, v in by.items()
                     if (g := re.fullmatch(re.escape(m.group(1)) + r"-g(\d+)" + re.escape(m.group(2) or ""), k))}
            if not fixed:
                continue
            gamma, best = max(fixed.items(), key=lambda kv: kv[1]["tokens_per_s"])
            lines.append(_row([_k(s["context"]), f"`{m.group(1)}`", f"{best['tokens_per_s']:.0f} (γ {gamma})",
                               _num(s["tokens_per_s"], 0), _num(s["tokens_per_s"] / best["tokens_per_s"]),
                               _num(s["tokens_per_s"] / base) if base else "–", _num(s.get("tau"))]))
        sources.append(_source(name, d, _e2e_settings(d) + ", speculative steps uncompiled"))
    return "\n".join(lines + [""] + sources)


def steps(spec: dict, results: Path) -> str:
    """A scale.py run: ms of each captured step (× its floor) [kernels a step], by context, batch 1."""
    name = spec["files"][0]
    d = _load(name, results)
    rows = [r for r in d["rows"] if r.get("batch", 1) == 1]
    contexts = sorted({r["context"] for r in rows})
    keys = list(dict.fromkeys(k for r in rows for k in r["seconds"]))
    lines = _head("ms a step (× floor) [kernels]", *(_k(c) for c in contexts))
    for key in keys:
        cells = [STEPS.get(key, f"`{key}`")]
        for c in contexts:
            r = next((r for r in rows if r["context"] == c and key in r["seconds"]), None)
            if r is None:
                cells.append("–")
                continue
            ms, floor = 1e3 * r["seconds"][key], r.get("floors", {}).get(key)
            kernels = r.get("kernels", {}).get(key)
            cells.append(f"{ms:.2f}" + (f" ({ms / 1e3 / floor:.2f})" if floor else "")
                         + (f" [{kernels:.0f}]" if kernels else ""))
        lines.append(_row(cells))
    s = d.get("settings", {})
    settings = (f"{rows[0]['pair'] if rows else '?'}, {s.get('weights', '')}, a draft step is a round of "
                f"γ = {s.get('gamma')} divided by γ")
    return "\n".join(lines + ["", _source(name, d, settings)])


def headline(spec: dict, results: Path) -> str:
    """The headline plot's table (benchmarks/headline.py): tokens/s at 8B shape, measured and projected."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import headline as plot  # noqa: E402 (the plot's own reading of its files)

    lines = plot.series(results)
    files = list(dict.fromkeys(f for s in lines for f in s["sources"]))
    named = ", ".join(f"`benchmarks/results/{f}`" for f in files)
    source = f"Sources: {named} (one H100; `headline.py` names each)."
    return plot.table(lines) + "\n\n" + source


def acceptance(spec: dict, results: Path) -> str:
    """bench-real runs: τ (tokens per verifier forward) of each drafter and cache, per prompt length, pooled over the
    documents (all tokens made by rounds over all rounds); whether every cell equals greedy AR."""
    lines = _head("drafter and cache", "prompt", "τ per document", "τ pooled", "identical to greedy AR", "run")
    sources = []
    for name in spec["files"]:
        d = _load(name, results)
        groups: dict = {}
        for c in d["cells"]:
            if c["method"] not in spec.get("only", {}).get(name, [c["method"]]):
                continue
            groups.setdefault((c["method"], c["context"]), []).append(c)
        for (method, context), cells in groups.items():
            pooled = sum(c["new_tokens"] - 1 for c in cells) / sum(c["rounds"] for c in cells)
            lines.append(_row([method_name(method), _k(context), " / ".join(f"{c['tau']:.2f}" for c in cells),
                               _num(pooled), f"{sum(bool(c['identical']) for c in cells)}/{len(cells)}",
                               d["settings"].get("commit", "?")]))
        s = d["settings"]
        sources.append(_source(name, d, f"{s.get('device')} {s.get('dtype')}, γ = {s.get('gamma')}, "
                                         f"{s.get('new_tokens')} new tokens"))
    return "\n".join(lines + [""] + sources)


def drop_in(spec: dict, results: Path) -> str:
    """chunk_selection.py's drop-in runs: teacher-forced top-1 agreement with the full cache of the verifier on each
    cache (``ChunkBudgetCache`` with a selection, or the sink + window), mean over the documents, by budget."""
    lines, sources = [], []
    for name in spec["files"]:
        d = _load(name, results)
        cells: dict = {}
        for key, value in d["drop_in"].items():
            length, budget, cache = key.split("/")
            cells.setdefault((int(length), cache), {})[int(budget)] = sum(value["top1"]) / len(value["top1"])
        budgets = sorted({b for row in cells.values() for b in row})
        if not lines:
            lines = _head("prompt", "cache", *(f"B = {b}" for b in budgets))
        for (length, cache), row in cells.items():
            lines.append(_row([_k(length), CACHES.get(cache, f"`{cache}`"), *(_num(row.get(b), 3) for b in budgets)]))
        s = d["settings"]
        sources.append(_source(name, d, f"{s.get('pair')} pair, {s.get('dtype')}, documents {s.get('document_names')}, "
                                         f"{s.get('new_tokens')} tokens teacher-forced"))
    return "\n".join(lines + [""] + sources)


def controller_cpu(spec: dict, results: Path) -> str:
    """``benchmarks/controller_cpu.py`` runs: per case, plain decoding, the best constant γ in hindsight and the
    controller (median seconds a call), the controller × plain and × that γ, and the widths of its last call."""
    lines, sources = _head("busy processes", "order", "case", "plain (s)", "best constant γ (s)", "controller (s)",
                           "× plain", "× best γ", "controller's widths (last call)"), []
    for name in spec["files"]:
        d = _load(name, results)
        for case, methods in d["results"].items():
            fixed = {k: v for k, v in methods.items() if k.startswith("gamma")}
            best = min(fixed, key=lambda k: fixed[k]["median_s"])
            ctl, top = methods["controller"]["median_s"], fixed[best]["median_s"]
            plain = methods["controller"].get("plain_adjacent_s", methods["plain"]["median_s"])  # (grouped order)
            widths = methods["controller"].get("width_rounds") or {}
            lines.append(_row([d["settings"].get("load", 0), d["settings"].get("order", "interleaved"), case,
                               _num(plain, 3),
                               f"{_num(top, 3)} (γ {best.split()[-1]})", _num(ctl, 3), _num(plain / ctl),
                               _num(top / ctl), ", ".join(f"{w}: {n}" for w, n in widths.items()) or "–"]))
        s = d["settings"]
        date = re.search(r"\d{4}-\d{2}-\d{2}", name)  # (these runs record no date or commit: the folder's date)
        meta = {"device": f"CPU, {d.get('cpus')} cores, torch {d.get('torch')}", "date": date and date.group(0),
                "commit": d.get("commit", "not recorded")}
        sources.append(_source(name, meta, f"{s.get('new_tokens')} new tokens, median of {s.get('repeats')} calls, "
                                           f"load average {d.get('loadavg_before', [float('nan')])[0]:.1f} before"))
    return "\n".join(lines + [""] + sources)


def window_prefill_lines(cells: list[dict]) -> list[str]:
    """The table of ``benchmarks/window_prefill.py``'s cells: per prompt length and prefill, the tokens the
    drafter's prefill read, its median time alone, α and τ pooled over the documents (all accepted over all drafted;
    all tokens made by rounds over all rounds) and how many outputs equal greedy AR."""
    lines = _head("prompt", "the drafter's prefill", "tokens it reads", "its time (ms)", "α per document", "α pooled",
                  "τ pooled", "identical to greedy AR")
    groups: dict = {}
    for c in cells:
        groups.setdefault((c["context"], c["method"]), []).append(c)
    for (context, method), group in groups.items():
        alpha = sum(c["accepted"] for c in group) / max(sum(c["drafted"] for c in group), 1)
        tau = sum(c["new_tokens"] - 1 for c in group) / sum(c["rounds"] for c in group)
        lines.append(_row([_k(context), WINDOW_PREFILLS.get(method, f"`{method}`"),
                           "/".join(sorted({str(c["drafter_prefill_tokens"]) for c in group})),
                           _num(statistics.median(c["drafter_prefill_ms"] for c in group), 1),
                           " / ".join(_num(c["alpha"]) for c in group), _num(alpha, 3), _num(tau),
                           f"{sum(bool(c['identical']) for c in group)}/{len(group)}"]))
    return lines


WINDOW_PREFILLS = {"window-whole-prefill": "the whole prompt", "window-kept-prefill": "the kept positions (sinks + ring)"}


def window_prefill(spec: dict, results: Path) -> str:
    """``benchmarks/window_prefill.py`` runs (:func:`window_prefill_lines`)."""
    lines, sources = [], []
    for name in spec["files"]:
        d = _load(name, results)
        lines = lines or window_prefill_lines([])[:2]
        lines += window_prefill_lines(d["cells"])[2:]
        s = d["settings"]
        sources.append(_source(name, d, f"bundled pair, {s.get('dtype')}, {s.get('docs')} documents, constant "
                                         f"γ {s.get('gamma')}, {s.get('new_tokens')} new tokens, drafter prefill time "
                                         f"median of {s.get('timing_repeats')}, torch threads: {s.get('torch_threads')}"))
    return "\n".join(lines + [""] + sources)


KINDS = dict(controller_cpu=controller_cpu, window_prefill=window_prefill, lifecycle=lifecycle, lifecycle_later=lifecycle_later,
             lifecycle_growth=lifecycle_growth, e2e=e2e, best_fixed=best_fixed, steps=steps,
             headline=headline, acceptance=acceptance, drop_in=drop_in, per_document=per_document,
             quant_splits=quant_splits)
MARKED = re.compile(r"<!-- table: (?P<name>[\w-]+) -->\n(?P<body>.*?)\n?<!-- end table -->", re.S)


def marked_names(text: str) -> list[str]:
    return [m["name"] for m in MARKED.finditer(text)]


def render(name: str, results: Path = RESULTS) -> str:
    spec = TABLES[name]
    return KINDS[spec["kind"]](spec, results)


def update(text: str, results: Path = RESULTS) -> tuple[str, list[str]]:
    """The document with each marked table regenerated, and the names of the tables that changed."""
    changed = []

    def one(m: re.Match) -> str:
        body = render(m["name"], results)
        if body.strip() != m["body"].strip():
            changed.append(m["name"])
        return f"<!-- table: {m['name']} -->\n{body}\n<!-- end table -->"

    return MARKED.sub(one, text), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 naming the tables that differ")
    parser.add_argument("--file", type=Path, default=BENCHMARKS)
    args = parser.parse_args(argv)
    text = args.file.read_text()
    missing = sorted(set(TABLES) - set(marked_names(text)))
    new, changed = update(text)
    if args.check:
        for name in changed:
            print(f"table {name!r} differs from its results files (make tables)")
        for name in missing:
            print(f"table {name!r} has no markers in {args.file.name}")
        return 1 if changed or missing else 0
    args.file.write_text(new)
    print(f"{len(changed)} table(s) rewritten: {', '.join(changed) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
