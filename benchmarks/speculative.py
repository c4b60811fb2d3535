"""End-to-end speculative decoding benchmark on the bundled pair (issue 7): every method on the same verifier and
the same held-out prompts, speedup vs autoregressive decoding, acceptance, τ, peak GPU memory, time split, and a
check that every output is token-for-token the greedy AR output.

    python benchmarks/speculative.py --quick --projection --profile --out runs/speculative-quick   # ~5 min, 1 H100
    python benchmarks/speculative.py --out runs/speculative                                       # the full grid
    python benchmarks/speculative.py --contexts 512 1024 --budgets 64 128 --gammas 2 --new-tokens 16   # CPU smoke

Methods (all greedy, batch size 1, verifier = the bundled 12-layer Llama, full DynamicCache, SDPA):

    ar              verifier.generate() greedy with hf_sparsekv imported (DynamicCache, SDPA): baseline (1) and the
                    reference every output is checked against
    ar-static       the same on a static cache (--static-cache; no torch.compile); baseline (1) is the faster of the two
    ar-stock        stock transformers generate() (hf_sparsekv.unregister()): baseline (2)
    assisted-stock  stock assisted generation, full-cache drafter (--stock-drafter), constant γ
    sd-base         sparse/full: untrained drafter on the chunk-budget cache (draft_cache="chunk", kv_budget=B)
    budgetdraft     sparse/full: BudgetDraft-trained drafter on the chunk-budget cache
    window0         window/full: SinkWindowCache(sink=0, window=B) drafter cache (--window-drafter)
    window4         window/full: draft_cache="window", kv_budget=B (4 sink tokens + B-4 window)
    ar-int8         greedy AR on HierarchicalQuantCache (the INT8 view): the reference of int4
    int4            QuantSpec self-speculation: assistant_model=verifier, draft_cache="int4"

Per cell: warm-up run(s) discarded, median of --repeats, the same prompts for every method; tokens/s is end to end
(prefill + decode) over new tokens; speedup = AR seconds / method seconds summed over prompts. A token mismatch
against the reference is a failure: recorded in the JSON (with its position) and printed loudly. A method that
raises is recorded and the rest still runs.

--projection: per-forward costs of a 7B-shaped verifier and a 68M-shaped drafter (random weights, CUDA only)
combined with the acceptance measured on the trained pair: a projection, not a measurement.
--profile: one speculative setting broken down by timers (drafter / verifier / cache rollback / Python) and by
torch.profiler (top operators).

Outputs under --out: results.json, table.md, acceptance_vs_context.png, gamma_sweep.png, memory_vs_gamma.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
from tqdm import tqdm

import hf_sparsekv
from hf_sparsekv import HierarchicalQuantCache, SinkWindowCache
from hf_sparsekv.generation.stats import SyncedTimer
from hf_sparsekv.zoo import PAIR_DIR, eval_documents, load_pair

AR_METHODS = ("ar", "ar-static", "ar-stock", "ar-int8")  # one cell per context (no budget, no γ)
GAMMA_METHODS = ("assisted-stock", "int4")  # one cell per context × γ
BUDGET_METHODS = ("sd-base", "budgetdraft", "window0", "window4")  # one cell per context × budget × γ
ALL_METHODS = AR_METHODS + GAMMA_METHODS + BUDGET_METHODS
DEFAULT_METHODS = ("ar", "ar-stock", "assisted-stock", "sd-base", "budgetdraft", "window0", "window4", "ar-int8", "int4")
QUICK_METHODS = ("ar", "ar-stock", "assisted-stock", "sd-base", "budgetdraft", "window0", "ar-int8", "int4")
LABELS = {
    "ar": "AR (ours: generate, DynamicCache, SDPA)",
    "ar-static": "AR (ours: generate, static cache)",
    "ar-stock": "AR (stock transformers generate)",
    "ar-int8": "AR on INT8 HierarchicalQuantCache (int4 reference)",
    "assisted-stock": "stock assisted generation (full-cache drafter)",
    "int4": "self-speculative INT4/INT8 (QuantSpec)",
    "sd-base": "SD sparse/full, untrained drafter",
    "budgetdraft": "SD sparse/full, BudgetDraft drafter",
    "window0": "window/full (sink 0, window B)",
    "window4": "window/full (sink 4, window B-4)",
}
PROJECTION_FORMULA = (
    "E = (1 - a^(g+1)) / (1 - a)  [tokens per round, = tau];  time per round = g*t_draft + t_verify(g+1);  "
    "decode speedup = E * t_AR_step / (g*t_draft + t_verify(g+1));  end-to-end speedup for n new tokens = "
    "(t_prefill + n*t_AR_step) / (t_prefill + t_draft_prefill + (n/E)*(g*t_draft + t_verify(g+1)))"
)
GB = 1024**3


# ---------------------------------------------------------------------------------------------------- set-up


def _load_models(args, device):
    """``{"verifier", "budgetdraft", "base", "notes"}``; a drafter that cannot be loaded is None with a note."""
    dtype = getattr(torch, args.dtype) if args.dtype else None
    notes = {}
    try:
        verifier, budgetdraft, _ = load_pair(pair=args.pair, device=device, dtype=dtype, drafter="budgetdraft")
        _, base, _ = load_pair(pair=args.pair, device=device, dtype=dtype, drafter="base")
    except TypeError:  # load_pair without the drafter argument: its one drafter is the plain pretrained one
        verifier, base, _ = load_pair(pair=args.pair, device=device, dtype=dtype)
        budgetdraft = None
        notes["budgetdraft"] = "load_pair() has no drafter= argument: no BudgetDraft drafter available"
    except Exception as exc:  # noqa: BLE001 - e.g. the budgetdraft weights are missing
        verifier, base, _ = load_pair(pair=args.pair, device=device, dtype=dtype)
        budgetdraft = None
        notes["budgetdraft"] = f"BudgetDraft drafter could not be loaded: {exc!r}"
    return {"verifier": verifier, "budgetdraft": budgetdraft, "base": base, "notes": notes}


def _commit() -> str:
    if os.environ.get("GIT_COMMIT"):  # a copy of the tree without its history (the GPU machine)
        return os.environ["GIT_COMMIT"]
    try:
        root = Path(__file__).resolve().parent.parent
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout
        return sha.strip() + ("-dirty" if dirty.strip() else "")
    except Exception:  # noqa: BLE001
        return "unknown"


class _Stock:
    """Stock ``generate()`` for the duration of the block (our generate() arguments unavailable)."""

    def __enter__(self):
        hf_sparsekv.unregister()

    def __exit__(self, *exc):
        hf_sparsekv.register()


# ---------------------------------------------------------------------------------------------------- methods


def _generate_fn(method: str, models: dict, ids: torch.Tensor, budget, gamma, args, new_tokens: int | None = None):
    """A zero-argument callable running one generation of ``new_tokens`` (default ``args.new_tokens``) tokens
    -> (sequences [1, N], spec_stats dict or None)."""
    verifier = models["verifier"]
    n = args.new_tokens if new_tokens is None else new_tokens
    common = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n)  # min_new_tokens: every method makes n tokens

    def spec(drafter_name, **kw):
        drafter = models[drafter_name]
        if drafter is None:
            raise RuntimeError(models["notes"].get(drafter_name, f"no {drafter_name} drafter"))

        def run():
            extra = {k: (v() if callable(v) else v) for k, v in kw.items()}  # fresh cache instances per call
            out = verifier.generate(ids, assistant_model=drafter, num_assistant_tokens=gamma,
                                    return_dict_in_generate=True, **common, **extra)
            return out.sequences, out.spec_stats.to_dict()

        return run

    if method == "ar":
        return lambda: (verifier.generate(ids, **common), None)
    if method == "ar-static":
        return lambda: (verifier.generate(ids, cache_implementation="static", **common), None)
    if method == "ar-stock":
        def run():
            with _Stock():
                return verifier.generate(ids, **common), None
        return run
    if method == "ar-int8":
        return lambda: (verifier.generate(ids, past_key_values=HierarchicalQuantCache(), **common), None)
    if method == "assisted-stock":
        drafter = models[args.stock_drafter]
        if drafter is None:
            raise RuntimeError(models["notes"].get(args.stock_drafter, "drafter unavailable"))

        def run():
            with _Stock():
                out = verifier.generate(ids, assistant_model=drafter, num_assistant_tokens=gamma,
                                        num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0,
                                        **common)
            return out, None
        return run
    if method == "int4":
        def run():
            out = verifier.generate(ids, assistant_model=verifier, draft_cache="int4", num_assistant_tokens=gamma,
                                    return_dict_in_generate=True, **common)
            return out.sequences, out.spec_stats.to_dict()
        return run
    if method == "sd-base":
        return spec("base", draft_cache="chunk", kv_budget=budget)
    if method == "budgetdraft":
        return spec("budgetdraft", draft_cache="chunk", kv_budget=budget)
    if method == "window0":
        return spec(args.window_drafter, draft_cache=lambda: SinkWindowCache(sink=0, window=budget,
                                                                             max_rollback=gamma + 1))
    if method == "window4":
        return spec(args.window_drafter, draft_cache="window", kv_budget=budget)
    raise ValueError(f"unknown method {method!r}")


def _measure(fn, device, warmup: int, repeats: int, warmup_fn=None) -> dict:
    """``warmup`` discarded runs of ``warmup_fn`` (default ``fn``), then the median of ``repeats`` timed runs."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        (warmup_fn or fn)()
    runs = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with SyncedTimer(device) as clock:
            sequences, stats = fn()
        runs.append(dict(seconds=clock.seconds, sequences=sequences.detach().cpu(), stats=stats,
                         peak=torch.cuda.max_memory_allocated() if cuda else None))
    median = sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]
    return dict(median, seconds_all=[r["seconds"] for r in runs], all_sequences=[r["sequences"] for r in runs])


def _first_mismatch(got: torch.Tensor, ref: torch.Tensor, prompt_length: int):
    """None if identical, else {position (index among new tokens), expected, got}."""
    got, ref = got[0, prompt_length:], ref[0, prompt_length:]
    n = min(len(got), len(ref))
    diff = (got[:n] != ref[:n]).nonzero()
    if len(diff):
        i = int(diff[0])
        return {"position": i, "expected": int(ref[i]), "got": int(got[i])}
    if len(got) != len(ref):
        return {"position": n, "expected_length": len(ref), "got_length": len(got)}
    return None


def _sweep_budgets(args) -> list[int]:
    """The budgets at which every γ of ``--gammas`` runs: ``--sweep-budget`` when ``--table-gammas`` restricts the
    others, else all of them."""
    return [args.sweep_budget] if args.table_gammas else list(args.budgets)


def _cell_gammas(args, budget: int) -> list[int]:
    """The γ values run at a budget: all of them at a sweep budget, ``--table-gammas`` at the others."""
    if budget in _sweep_budgets(args):
        return list(args.gammas)
    return [g for g in args.gammas if g in args.table_gammas]


def _jobs(args) -> list[dict]:
    """AR references of every context first, then the fixed γ, then the rest of the γ sweep: a --time-limit cut
    loses γ-sweep points before it loses a context."""
    g_fixed = _fixed_gamma(args.gammas)
    jobs = []
    for context in args.contexts:
        for p in range(args.prompts):
            for m in AR_METHODS:
                if m in args.methods:
                    jobs.append(dict(method=m, context=context, prompt=p, budget=None, gamma=None))
    for gamma in [g_fixed] + [g for g in args.gammas if g != g_fixed]:
        for context in args.contexts:
            for p in range(args.prompts):
                for m in GAMMA_METHODS:
                    if m in args.methods:
                        jobs.append(dict(method=m, context=context, prompt=p, budget=None, gamma=gamma))
                for budget in args.budgets:
                    if gamma not in _cell_gammas(args, budget):
                        continue
                    for m in BUDGET_METHODS:
                        if m in args.methods:
                            jobs.append(dict(method=m, context=context, prompt=p, budget=budget, gamma=gamma))
    return jobs


def _job_key(job: dict) -> tuple:
    return job["method"], job["context"], job["prompt"], job["budget"], job["gamma"]


def _reference_name(method: str) -> str:
    return "ar-int8" if method in ("int4", "ar-int8") else "ar"


def tie_check(verifier, ids: torch.Tensor, reference: torch.Tensor, mismatch: dict) -> dict:
    """Is a first divergence from the AR reference a numerical tie of the run's dtype, or a real failure?

    ``ids`` [1, P] is the prompt, ``reference`` [1, P + n] the AR output, ``mismatch`` the first differing new token
    (``position``, ``expected`` = AR's token, ``got`` = the method's). Both outputs share the prefix before
    ``position``; the verifier scores that prefix once in float64 and once in its own dtype by plain chunked
    prefill. The divergence is a tie when the float64 logits of the two tokens differ by less than twice the
    run dtype's own error on them (its logits cannot order the two), and a failure otherwise. Returns the evidence:
    the float64 margin (expected - got), that error, which token float64 picks, and ``tie``."""
    import copy

    from transformers.cache_utils import DynamicCache

    from hf_sparsekv.training.views import chunked_prefill

    def last_logits(model):  # chunks of 1024 tokens bound the attention memory of a long prefix
        return chunked_prefill(model, prefix, 1024, DynamicCache())[0]

    prefix = reference[:, : ids.shape[1] + mismatch["position"]].to(ids.device)
    exact = copy.deepcopy(verifier).to(torch.float64)
    try:
        l64 = last_logits(exact)
    finally:
        del exact
    lrun = last_logits(verifier).to(torch.float64)
    e, g = mismatch["expected"], mismatch["got"]
    margin = float(l64[e] - l64[g])
    error = float(max(abs(lrun[e] - l64[e]), abs(lrun[g] - l64[g])))
    return dict(float64_margin=margin, run_dtype_error=error, float64_argmax=int(l64.argmax()),
                float64_picks=("expected" if margin > 0 else "got" if margin < 0 else "either"),
                tie=abs(margin) <= 2 * error, dtype=str(verifier.dtype).replace("torch.", ""))


def run_job(job: dict, models: dict, prompts: list[torch.Tensor], references: dict, args, device) -> dict:
    """One cell on one prompt; never raises (an error is recorded in the returned record).

    A record keeps the new tokens of its median run (``tokens``), so a resumed grid can rebuild its references.
    A method whose output differs from the reference gets ``identical=False``, the first differing position and,
    for references on the plain full cache, a :func:`tie_check`."""
    record = dict(job, status="ok")
    try:
        ids = prompts[job["prompt"]][None, : job["context"]].to(device)
        if ids.shape[1] < job["context"]:
            raise ValueError(f"prompt {job['prompt']} has only {ids.shape[1]} tokens < context {job['context']}")
        fn = _generate_fn(job["method"], models, ids, job["budget"], job["gamma"], args)
        warm = _generate_fn(job["method"], models, ids, job["budget"], job["gamma"], args,
                            new_tokens=min(args.new_tokens, args.warmup_tokens))
        m = _measure(fn, device, args.warmup, args.repeats, warmup_fn=warm)
        new = m["sequences"].shape[1] - ids.shape[1]
        record.update(seconds=m["seconds"], seconds_all=m["seconds_all"], new_tokens=new,
                      tokens_per_s=new / m["seconds"], peak_memory_bytes=m["peak"], spec_stats=m["stats"],
                      tokens=m["sequences"][0, ids.shape[1]:].tolist())
        ref_name = _reference_name(job["method"])
        key = (ref_name, job["context"], job["prompt"])
        if job["method"] == ref_name:
            references[key] = m["sequences"]
        if key not in references:
            record["identical"] = None
            record["mismatch"] = f"no reference ({ref_name} did not run)"
        else:
            mismatches = [_first_mismatch(s, references[key], ids.shape[1]) for s in m["all_sequences"]]
            bad = [x for x in mismatches if x is not None]
            record["identical"] = not bad
            record["mismatch"] = bad[0] if bad else None
            record["reference"] = ref_name
            if bad and ref_name == "ar" and "got" in bad[0]:
                try:
                    record["tie_check"] = tie_check(models["verifier"], ids, references[key], bad[0])
                except Exception as exc:  # noqa: BLE001 - the mismatch then stands as a failure
                    record["tie_check"] = {"error": f"{type(exc).__name__}: {exc}", "tie": False}
    except Exception as exc:  # noqa: BLE001 - recorded, the grid goes on
        record.update(status="error", error=f"{type(exc).__name__}: {exc}",
                      traceback=traceback.format_exc(limit=6)[-2000:])
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return record


# ---------------------------------------------------------------------------------------------------- aggregation


def aggregate(records: list[dict], args) -> list[dict]:
    """Pool the per-prompt records of each (method, context, budget, γ) cell; add speedups."""
    cells: dict = {}
    for r in records:
        cells.setdefault((r["method"], r["context"], r["budget"], r["gamma"]), []).append(r)
    ar_seconds = {}  # (name, context) -> {prompt: seconds}
    for (m, c, _, _), rs in cells.items():
        if m in AR_METHODS:
            ar_seconds[(m, c)] = {r["prompt"]: r["seconds"] for r in rs if r["status"] == "ok"}
    out = []
    for (m, c, b, g), rs in cells.items():
        ok = [r for r in rs if r["status"] == "ok"]
        cell = dict(method=m, context=c, budget=b, gamma=g, prompts=len(rs), ok=len(ok),
                    errors=sorted({r["error"] for r in rs if r["status"] != "ok"}))
        if ok:
            seconds = sum(r["seconds"] for r in ok)
            tokens = sum(r["new_tokens"] for r in ok)
            cell.update(seconds=seconds, new_tokens=tokens, tokens_per_s=tokens / seconds,
                        identical=all(r.get("identical") is True for r in ok))
            for r in ok:
                if r.get("identical") is True:
                    continue
                entry = dict(prompt=r["prompt"], **(r["mismatch"] if isinstance(r["mismatch"], dict)
                                                    else {"note": r["mismatch"]}))
                if r.get("tie_check", {}).get("tie"):
                    cell.setdefault("ties", []).append(dict(entry, **r["tie_check"]))
                else:
                    cell.setdefault("mismatches", []).append(dict(entry, **r.get("tie_check", {})))
            peaks = [r["peak_memory_bytes"] for r in ok if r["peak_memory_bytes"] is not None]
            cell["peak_memory_gb"] = max(peaks) / GB if peaks else None

            def speedup(base_names):
                best = None
                for name in base_names:
                    base = ar_seconds.get((name, c), {})
                    if all(r["prompt"] in base for r in ok):
                        t = sum(base[r["prompt"]] for r in ok)
                        best = t if best is None else min(best, t)
                return None if best is None else best / seconds

            cell["speedup_vs_ar"] = speedup(["ar", "ar-static"])  # baseline (1): the fastest AR of our stack
            cell["speedup_vs_stock"] = speedup(["ar-stock"])  # baseline (2)
            if m == "int4":
                cell["speedup_vs_int8_ar"] = speedup(["ar-int8"])
            stats = [r["spec_stats"] for r in ok if r.get("spec_stats")]
            if stats:
                tot = {k: sum(s[k] for s in stats) for k in ("rounds", "drafted", "accepted", "new_tokens",
                                                             "prefill_seconds", "draft_seconds", "verify_seconds")}
                cell.update(
                    acceptance_rate=tot["accepted"] / tot["drafted"] if tot["drafted"] else 0.0,
                    tau=(tot["new_tokens"] - len(stats)) / tot["rounds"] if tot["rounds"] else 0.0,
                    rounds=tot["rounds"], drafted=tot["drafted"], accepted=tot["accepted"],
                    prefill_seconds=tot["prefill_seconds"], draft_seconds=tot["draft_seconds"],
                    verify_seconds=tot["verify_seconds"],
                    other_seconds=seconds - tot["prefill_seconds"] - tot["draft_seconds"] - tot["verify_seconds"],
                )
        out.append(cell)
    return out


# ---------------------------------------------------------------------------------------------------- tables


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


# ---------------------------------------------------------------------------------------------------- projection


def _time(fn, device, warmup: int = 2, reps: int = 5) -> float:
    """Median seconds of ``fn()`` (CUDA events on CUDA, perf_counter elsewhere)."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


# (hidden, layers, heads, intermediate, vocab); "tiny" only exercises the code path (CPU test)
PROJECTION_SHAPES = {
    "7b": {"verifier": (4096, 32, 32, 11008, 32000), "drafter": (768, 2, 12, 3072, 32000)},
    "tiny": {"verifier": (64, 2, 4, 128, 256), "drafter": (32, 1, 2, 64, 256)},
}


def _random_llama(shape, positions, dtype, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, intermediate, vocab = shape
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, intermediate_size=intermediate, vocab_size=vocab,
                         max_position_embeddings=positions, attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build directly in the target dtype on the device (7B: 13.5 GB in fp16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def projection(args, cells: list[dict]) -> dict:
    """Per-forward costs at 7B/68M shape (random weights) × acceptance measured on the trained pair."""
    device = torch.device(args.device)
    if args.projection_shape == "7b" and device.type != "cuda":
        return {"skipped": "--projection needs a CUDA GPU (7B-shaped verifier in fp16)"}
    from transformers.cache_utils import DynamicCache

    from hf_sparsekv import ChunkBudgetCache, attention

    t0 = time.perf_counter()
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    shapes = PROJECTION_SHAPES[args.projection_shape]
    vocab = shapes["verifier"][4]
    contexts = args.projection_contexts
    ks = sorted({1, *(g + 1 for g in args.gammas)})
    result = {"label": "PROJECTION (not a measurement of a 7B model): per-forward costs of random-weight 7B/68M-shaped "
                       "Llamas timed on this GPU, combined with acceptance measured on the bundled trained pair",
              "formula": PROJECTION_FORMULA, "dtype": str(dtype).replace("torch.", ""),
              "n_new_tokens": args.projection_new_tokens, "shape": args.projection_shape,
              "verifier_shape": "Llama-2-7B: hidden 4096, 32 layers, 32 heads, intermediate 11008, vocab 32000",
              "drafter_shape": "68M: hidden 768, 2 layers, 12 heads, intermediate 3072, vocab 32000",
              "timing": "verifier: prefill of c tokens (logits of the last), forward of k = γ+1 tokens on a DynamicCache "
                        "of c tokens (cropped back after each); drafter: one-token forward on a ChunkBudgetCache of "
                        "budget B after a c-token prefill, sparsekv attention; medians of CUDA-event timings",
              "costs": {}, "rows": []}
    if args.projection_shape != "7b":
        result["verifier_shape"], result["drafter_shape"] = str(shapes["verifier"]), str(shapes["drafter"])
    gen = torch.Generator(device=device).manual_seed(0)
    verifier = _random_llama(shapes["verifier"], max(contexts) + 64, dtype, device)
    costs = result["costs"]
    with torch.no_grad():
        for c in contexts:
            ids = torch.randint(0, vocab, (1, c + max(ks)), device=device, generator=gen)
            row = costs.setdefault(str(c), {})
            holder = {}

            def prefill():
                holder.clear()  # free the previous cache first
                holder["cache"] = DynamicCache()
                verifier(input_ids=ids[:, :c], past_key_values=holder["cache"], use_cache=True, logits_to_keep=1)

            row["verifier_prefill_s"] = _time(prefill, device, warmup=1, reps=1 if c >= 8192 else 2)
            for k in ks:
                def step(k=k):
                    verifier(input_ids=ids[:, c:c + k], past_key_values=holder["cache"], use_cache=True,
                             logits_to_keep=k)
                    holder["cache"].crop(-k)
                row[f"verifier_forward_{k}_s"] = _time(step, device)
            holder.clear()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        verifier = None  # frees the 7B weights before the drafter is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
        drafter = _random_llama(shapes["drafter"], max(contexts) + 64, dtype, device)
        drafter.set_attn_implementation(attention.NAME)
        for c in contexts:
            ids = torch.randint(0, vocab, (1, c + 1), device=device, generator=gen)
            for b in args.budgets:
                try:
                    cache = ChunkBudgetCache(b)
                    with SyncedTimer(device) as clock:
                        drafter(input_ids=ids[:, :c], past_key_values=cache, use_cache=True, logits_to_keep=1)
                    prompt = ids[:, :c]
                except Exception as exc:  # noqa: BLE001 - time an equivalent B-token DynamicCache instead
                    result.setdefault("drafter_cache_fallbacks", []).append(
                        f"ctx {c} B {b}: ChunkBudgetCache failed ({type(exc).__name__}: {exc}); timed a "
                        f"DynamicCache of {b} tokens instead")
                    drafter.set_attn_implementation("sdpa")
                    cache = DynamicCache()
                    with SyncedTimer(device) as clock:
                        drafter(input_ids=ids[:, :c], use_cache=False, logits_to_keep=1)  # prefill cost of c tokens
                        drafter(input_ids=ids[:, :b], past_key_values=cache, use_cache=True, logits_to_keep=1)
                    prompt = ids[:, :b]
                    drafter.set_attn_implementation(attention.NAME)
                start = prompt.shape[1]

                def dstep(cache=cache, start=start):
                    drafter(input_ids=ids[:, c:c + 1], past_key_values=cache, use_cache=True, logits_to_keep=1,
                            position_ids=torch.tensor([[start]], device=device))
                    cache.crop(-1)
                costs[str(c)][f"drafter_prefill_B{b}_s"] = clock.seconds
                costs[str(c)][f"drafter_step_B{b}_s"] = _time(dstep, device, warmup=3, reps=10)
        drafter = None
        if device.type == "cuda":
            torch.cuda.empty_cache()

    index = {(x["method"], x["context"], x["budget"], x["gamma"]): x for x in cells if x.get("ok")}
    n = args.projection_new_tokens
    for c in contexts:
        cost = costs[str(c)]
        t_ar, t_pre = cost["verifier_forward_1_s"], cost["verifier_prefill_s"]
        for m in ("budgetdraft", "sd-base"):
            for b in args.budgets:
                for g in args.gammas:
                    x = index.get((m, c, b, g))
                    if x is None or "acceptance_rate" not in x:
                        continue
                    a = x["acceptance_rate"]
                    e = g + 1 if a >= 1 else (1 - a ** (g + 1)) / (1 - a)
                    t_d, t_v = cost[f"drafter_step_B{b}_s"], cost[f"verifier_forward_{g + 1}_s"]
                    per_round = g * t_d + t_v
                    ar_total = t_pre + n * t_ar
                    sd_total = t_pre + cost[f"drafter_prefill_B{b}_s"] + (n / e) * per_round
                    result["rows"].append(dict(
                        method=m, context=c, budget=b, gamma=g, alpha=a, E=e, tau_measured=x.get("tau"),
                        t_draft_s=t_d, t_verify_s=t_v, t_ar_step_s=t_ar, decode_speedup=e * t_ar / per_round,
                        decode_speedup_with_measured_tau=(x["tau"] * t_ar / per_round) if x.get("tau") else None,
                        end_to_end_speedup=ar_total / sd_total))
    result["seconds"] = time.perf_counter() - t0
    return result


def projection_tables(p: dict) -> str:
    if "skipped" in p:
        return f"Projection skipped: {p['skipped']}"
    if "error" in p:
        return f"Projection failed: {p['error']}"
    lines = [f"**{p['label']}**", "", f"Formula: `{p['formula']}`", "",
             f"Verifier: {p['verifier_shape']}; drafter: {p['drafter_shape']}; {p['dtype']}.", "",
             "| context | verifier prefill s | AR step ms | verify(γ+1) ms for γ+1 = " +
             ", ".join(k.split("_")[2] for k in next(iter(p["costs"].values())) if k.startswith("verifier_forward"))
             + " | drafter step ms per B |", "|---|---|---|---|---|"]
    for c, cost in p["costs"].items():
        verify = ", ".join(f"{1000 * v:.1f}" for k, v in cost.items() if k.startswith("verifier_forward"))
        draft = ", ".join(f"B{k.split('_B')[1][:-2]}: {1000 * v:.2f}" for k, v in cost.items()
                          if k.startswith("drafter_step"))
        lines.append(f"| {_ctx(int(c))} | {cost['verifier_prefill_s']:.3f} | "
                     f"{1000 * cost['verifier_forward_1_s']:.1f} | {verify} | {draft} |")
    if p["rows"]:
        lines += ["", f"Projected speedup (best γ per cell; n = {p['n_new_tokens']} new tokens end to end):", "",
                  "| method | context | B | γ | α (measured) | E | decode speedup | e2e speedup |",
                  "|---|---|---|---|---|---|---|---|"]
        best = {}
        for r in p["rows"]:
            key = (r["method"], r["context"], r["budget"])
            if key not in best or r["end_to_end_speedup"] > best[key]["end_to_end_speedup"]:
                best[key] = r
        for r in best.values():
            lines.append(f"| {r['method']} | {_ctx(r['context'])} | {r['budget']} | {r['gamma']} | {r['alpha']:.3f} | "
                         f"{r['E']:.2f} | {r['decode_speedup']:.2f}× | {r['end_to_end_speedup']:.2f}× |")
    else:
        lines += ["", "No acceptance measured on the pair at these contexts (run the grid with sd-base/budgetdraft "
                      "at the projection contexts): costs only."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- profile


def profile(args, models: dict, prompts, device) -> dict:
    """One speculative setting: wall time split by synchronized timers, then torch.profiler's top operators."""
    from transformers.cache_utils import DynamicCache

    from hf_sparsekv.generation import drafters as drafters_mod
    from hf_sparsekv.generation import speculative as spec_mod

    method, context, budget, gamma = args.profile_method, max(args.contexts), min(args.budgets), _fixed_gamma(args.gammas)
    ids = prompts[0][None, :context].to(device)
    fn = _generate_fn(method, models, ids, budget, gamma, args)
    fn()  # warm-up
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    cuda = torch.device(device).type == "cuda"

    def timed(name, f):
        def wrapper(*a, **kw):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                if cuda:
                    torch.cuda.synchronize()
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - t
                counts[name] = counts.get(name, 0) + 1
        return wrapper

    patches = [
        (spec_mod, "forward", timed("verifier forward (prefill + verify)", spec_mod.forward)),
        (drafters_mod, "forward", timed("drafter forward (prefill + draft steps)", drafters_mod.forward)),
        (drafters_mod.ModelDrafter, "rollback", timed("drafter cache rollback", drafters_mod.ModelDrafter.rollback)),
        (DynamicCache, "crop", timed("verifier cache crop", DynamicCache.crop)),
        (spec_mod.GreedyRules, "process", timed("logits rules + argmax", spec_mod.GreedyRules.process)),
    ]
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    try:
        with SyncedTimer(device) as clock:
            _, stats = fn()
    finally:
        for obj, name, old in originals:
            setattr(obj, name, old)
    wall = clock.seconds
    items = dict(totals)  # disjoint: nothing timed here calls another timed item
    items["Python loop + other (wall - timed)"] = wall - sum(items.values())
    ranked = sorted(items.items(), key=lambda kv: -kv[1])
    result = {"setting": dict(method=method, context=context, budget=budget, gamma=gamma, new_tokens=args.new_tokens),
              "wall_seconds": wall, "spec_stats": stats,
              "timers": [dict(item=k, seconds=v, share=v / wall, calls=counts.get(k)) for k, v in ranked],
              "note": "timers synchronize CUDA around every call (so their sum is slightly above an unprofiled run); "
                      "'drafter forward' is the verifier's own INT4-view forward for int4"}
    try:
        from torch.profiler import ProfilerActivity, profile as tprofile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with tprofile(activities=activities) as prof:
            fn()
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        events = sorted(prof.key_averages(), key=lambda e: -getattr(e, key.replace("cuda", "device"), 0)
                        if cuda else -e.self_cpu_time_total)
        top = []
        for e in events[:15]:
            top.append(dict(name=e.key, calls=e.count, self_cpu_ms=e.self_cpu_time_total / 1000,
                            self_device_ms=getattr(e, "self_device_time_total", 0) / 1000 if cuda else None))
        result["torch_profiler_top"] = top
        result["torch_profiler_sort"] = "self device time" if cuda else "self CPU time"
    except Exception as exc:  # noqa: BLE001
        result["torch_profiler_error"] = repr(exc)
    return result


def profile_text(p: dict) -> str:
    if "error" in p:
        return f"Profile failed: {p['error']}"
    s = p["setting"]
    lines = [f"Profile: {s['method']} ctx={_ctx(s['context'])} B={s['budget']} γ={s['gamma']} "
             f"({s['new_tokens']} new tokens), wall {p['wall_seconds']:.3f} s", "",
             "| item | seconds | share | calls |", "|---|---|---|---|"]
    for t in p["timers"]:
        lines.append(f"| {t['item']} | {t['seconds']:.4f} | {100 * t['share']:.1f}% | {t['calls'] or ''} |")
    if p.get("torch_profiler_top"):
        lines += ["", f"torch.profiler top operators by {p['torch_profiler_sort']}:", "",
                  "| operator | calls | self CPU ms | self device ms |", "|---|---|---|---|"]
        for e in p["torch_profiler_top"]:
            lines.append(f"| {e['name'][:60]} | {e['calls']} | {e['self_cpu_ms']:.2f} | {_fmt(e['self_device_ms'])} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/speculative"))
    p.add_argument("--quick", action="store_true",
                   help="~3-4 min on one H100: 1 prompt, contexts 4K/16K, budgets 256/1024, γ 3/5, 64 new tokens, "
                        "1 warm-up + 1 repeat, no window4 (explicit flags override)")
    p.add_argument("--contexts", type=int, nargs="+")
    p.add_argument("--budgets", type=int, nargs="+")
    p.add_argument("--gammas", type=int, nargs="+")
    p.add_argument("--new-tokens", type=int)
    p.add_argument("--prompts", type=int, help="held-out documents of the pair (at most 50)")
    p.add_argument("--repeats", type=int, help="timed repeats per cell (median reported)")
    p.add_argument("--warmup", type=int, help="discarded runs per cell")
    p.add_argument("--warmup-tokens", type=int, default=32, help="new tokens of a warm-up run (compiles, caches)")
    p.add_argument("--table-gammas", type=int, nargs="*",
                   help="γ values run at budgets other than --sweep-budget (nothing given: every γ at every budget)")
    p.add_argument("--sweep-budget", type=int, help="the budget at which every γ of --gammas runs (Fig. 3, Table 4)")
    p.add_argument("--resume", action="store_true",
                   help="keep the records of --out/results.json made with the same settings and run only the rest")
    p.add_argument("--methods", nargs="+", choices=ALL_METHODS)
    p.add_argument("--static-cache", action="store_true", help="also time AR on a static cache (ar-static)")
    p.add_argument("--stock-drafter", choices=("base", "budgetdraft"), default="base",
                   help="drafter of stock assisted generation (full cache)")
    p.add_argument("--window-drafter", choices=("base", "budgetdraft"), default="base",
                   help="drafter of the window/full methods")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                   help="default: the pair's bf16 on CUDA, float32 on CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--pair", type=Path, default=PAIR_DIR)
    p.add_argument("--time-limit", type=float, help="seconds for the grid; later cells are recorded as skipped")
    p.add_argument("--no-grid", action="store_true", help="skip the grid (e.g. projection/profile only)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--projection", action="store_true", help="7B/68M-shaped projection (CUDA only)")
    p.add_argument("--projection-contexts", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--projection-new-tokens", type=int, default=256)
    p.add_argument("--projection-shape", choices=tuple(PROJECTION_SHAPES), default="7b", help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help="break one speculative setting down (timers + profiler)")
    p.add_argument("--profile-method", default="budgetdraft", choices=BUDGET_METHODS + ("int4",))
    args = p.parse_args(argv)
    quick = dict(contexts=[4096, 16384], budgets=[256, 1024], gammas=[3, 5], new_tokens=64, prompts=1, repeats=1,
                 warmup=1, methods=list(QUICK_METHODS), time_limit=210.0, table_gammas=None, sweep_budget=None)
    # The full grid: Table 1 (every context × budget) at γ ∈ {3, 5, 7}, the γ sweep 1..10 at B = 1024.
    full = dict(contexts=[4096, 8192, 16384], budgets=[256, 512, 1024, 2048], gammas=list(range(1, 11)),
                new_tokens=256, prompts=2, repeats=3, warmup=1, methods=list(DEFAULT_METHODS), time_limit=None,
                table_gammas=[3, 5, 7], sweep_budget=None)
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.static_cache and "ar-static" not in args.methods:
        args.methods.append("ar-static")
    # The references are always run: every output is checked against them.
    if "ar" not in args.methods:
        args.methods.insert(0, "ar")
    if "int4" in args.methods and "ar-int8" not in args.methods:
        args.methods.append("ar-int8")
    args.methods = [m for m in ALL_METHODS if m in args.methods]
    if args.table_gammas:
        if args.sweep_budget is None:
            args.sweep_budget = 1024 if 1024 in args.budgets else max(args.budgets)
        if args.sweep_budget not in args.budgets:
            p.error(f"--sweep-budget {args.sweep_budget} is not one of --budgets {args.budgets}")
    return args


RESUME_KEYS = ("device", "dtype", "attention", "commit", "models", "new_tokens", "repeats", "warmup", "warmup_tokens",
               "stock_drafter", "window_drafter")


def _resume(path: Path, settings: dict, prompts: list[torch.Tensor]) -> tuple[list[dict], dict]:
    """The finished records of an earlier run with the same ``RESUME_KEYS`` settings, and the references rebuilt
    from them; errors and skipped jobs are dropped (run again)."""
    old = json.loads(path.read_text())
    differ = {k: (old["settings"].get(k), settings[k]) for k in RESUME_KEYS if old["settings"].get(k) != settings[k]}
    if differ:
        raise SystemExit(f"--resume: {path} was made with other settings (earlier, now): {differ}; use another --out")
    records = [r for r in old["records"] if r["status"] == "ok" and r["prompt"] < len(prompts)]
    references = {}
    for r in records:
        if r["method"] == _reference_name(r["method"]):
            ids = prompts[r["prompt"]][None, : r["context"]]
            references[(r["method"], r["context"], r["prompt"])] = torch.cat([ids, torch.tensor([r["tokens"]])], 1)
    return records, references


def _write(out: Path, payload: dict) -> None:
    (out / "results.json").write_text(json.dumps(payload, indent=1, default=str))


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    start = time.perf_counter()
    models = _load_models(args, device)
    verifier = models["verifier"]
    documents = eval_documents(args.pair)
    prompts = [documents[i % len(documents)] for i in range(args.prompts)]
    settings = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "models": "bundled pair (hf_sparsekv.zoo): 12-layer Llama verifier (16K), 2-layer 2K drafter; drafters "
                  "'base' (plain pretrained) and 'budgetdraft' (BudgetDraft-trained)",
        "model_notes": models["notes"], "dtype": str(verifier.dtype).replace("torch.", ""),
        "attention": verifier.config._attn_implementation,
        "dataset": f"held-out documents of the pair (Python source), first {args.prompts}, cut to each context",
        **{k: getattr(args, k) for k in ("contexts", "budgets", "gammas", "table_gammas", "sweep_budget",
                                          "new_tokens", "prompts", "repeats", "warmup", "warmup_tokens", "methods",
                                          "stock_drafter", "window_drafter", "quick")},
        "speedup_definition": "end-to-end seconds (prefill + decode) of baseline / method, summed over prompts; "
                              "'vs AR' = baseline (1), the fastest AR of our stack; 'vs stock' = baseline (2)",
        "note": "ar and ar-stock run the same transformers code path (the hf_sparsekv patch forwards calls without "
                "its arguments untouched); their difference is timing noise",
    }
    payload = {"settings": settings, "records": [], "cells": [], "failures": [], "ties": []}
    records, references = [], {}
    if args.resume and (out / "results.json").exists():
        records, references = _resume(out / "results.json", settings, prompts)
        print(f"--resume: kept {len(records)} finished records of {out / 'results.json'}")
    if not args.no_grid:
        done = {_job_key(r) for r in records}
        jobs = [j for j in _jobs(args) if _job_key(j) not in done]
        grid_start = time.perf_counter()
        bar = tqdm(jobs, desc="grid", unit="run", file=sys.stdout, mininterval=2.0)
        for job in bar:
            bar.set_postfix_str(f"{job['method']} {_ctx(job['context'])} B={job['budget']} γ={job['gamma']}")
            if args.time_limit is not None and time.perf_counter() - grid_start > args.time_limit:
                records.append(dict(job, status="skipped", error=f"skipped: --time-limit {args.time_limit:.0f} s"))
                continue
            record = run_job(job, models, prompts, references, args, device)
            if record["status"] == "error":
                tqdm.write(f"!! ERROR {job['method']} ctx={job['context']} B={job['budget']} γ={job['gamma']}: "
                           f"{record['error']}")
            elif record.get("identical") is False:
                verdict = "numerical tie" if record.get("tie_check", {}).get("tie") else "MISMATCH"
                tqdm.write(f"!!!!!! {verdict} vs {record['reference']}: {job} first differing new token "
                           f"{record['mismatch']} {record.get('tie_check', '')}")
            records.append(record)
            payload["records"] = records
            _write(out, payload)
        bar.close()
    cells = aggregate(records, args)
    payload.update(cells=cells, failures=failures(cells), ties=ties(cells))
    _write(out, payload)

    md = [f"# Speculative decoding benchmark ({'quick' if args.quick else 'grid'})", "",
          f"{settings['device']}, {settings['date']}, commit {settings['commit']}, {settings['dtype']}, attention "
          f"{settings['attention']}; {settings['models']}; {settings['dataset']}; {args.new_tokens} new tokens "
          f"(greedy, min_new_tokens = max_new_tokens); warm-up {args.warmup}, median of {args.repeats}; "
          f"budgets {args.budgets}, γ {args.gammas}.", ""]
    if models["notes"]:
        md += [f"Model notes: {models['notes']}", ""]
    if cells:
        md += ["## Table 1 layout, panel A: best γ per cell — speedup vs AR (ours) / acceptance %", "",
               table1(cells, args, "best"), "",
               f"## Panel B: γ = {_fixed_gamma(args.gammas)}", "", table1(cells, args, "fixed"), "",
               f"## All methods at γ = {_fixed_gamma(args.gammas)} (and AR baselines)", "", detail_table(cells, args),
               ""]
    if payload["failures"]:
        md += ["## FAILURES (errors and outputs that differ from the AR reference)", ""]
        md += [f"- {f}" for f in payload["failures"]] + [""]
    elif cells and not payload["ties"]:
        md += ["All outputs identical to their greedy AR reference.", ""]
    if payload["ties"]:
        md += [f"## † Numerical ties ({settings['dtype']}): outputs that leave the AR reference where the verifier's "
               "two candidate tokens are closer in float64 than its own error in the run dtype", ""]
        md += [f"- {t}" for t in payload["ties"]] + [""]
    if not args.no_plots and cells:
        try:
            payload["plots"] = plots(cells, args, out)
        except Exception as exc:  # noqa: BLE001
            payload["plots_error"] = repr(exc)
    if args.profile:
        try:
            payload["profile"] = profile(args, models, prompts, device)
        except Exception as exc:  # noqa: BLE001
            payload["profile"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
        md += ["## Profile", "", profile_text(payload["profile"]), ""]
        _write(out, payload)
    if args.projection:
        del models
        if cuda:
            torch.cuda.empty_cache()
        try:
            payload["projection"] = projection(args, cells)
        except Exception as exc:  # noqa: BLE001
            payload["projection"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
        md += ["## Projection to 7B / 68M scale (a projection, not a measurement)", "",
               projection_tables(payload["projection"]), ""]
    payload["seconds"] = time.perf_counter() - start
    _write(out, payload)
    text = "\n".join(md)
    (out / "table.md").write_text(text)
    print(text)
    if payload["failures"]:
        print("\n" + "!" * 100)
        print(f"!!! {len(payload['failures'])} FAILURE(S): see above and {out / 'results.json'} ('failures')")
        print("!" * 100)
    print(f"wrote {out}/ ({payload['seconds']:.0f} s)")
    return 1 if payload["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
