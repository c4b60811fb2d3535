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

Split by job: the methods and their timing (``spec_methods.py``), tables and plots (``spec_report.py``), the
projection and the profile (``spec_projection.py``); this file runs the grid (jobs, identity checks, aggregation).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from tqdm import tqdm

from hf_sparsekv.zoo import PAIR_DIR, eval_documents
from provenance import commit
from spec_methods import (
    ALL_METHODS, AR_METHODS, BUDGET_METHODS, DEFAULT_METHODS, GAMMA_METHODS, GB, QUICK_METHODS, _cell_gammas,
    _first_mismatch, _generate_fn, _load_models, _measure,
)
from spec_projection import PROJECTION_SHAPES, profile, profile_text, projection, projection_tables
from spec_report import _ctx, _fixed_gamma, detail_table, failures, plots, table1, ties


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
        m = _measure(fn, device, args.warmup, args.repeats, warmup_fn=warm, verifier=models["verifier"])
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
                    skipped=sum(r["status"] == "skipped" for r in rs),  # --time-limit: not a failure, run again
                    errors=sorted({r["error"] for r in rs if r["status"] not in ("ok", "skipped")}))
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
        "commit": commit(), "torch": torch.__version__,
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
    skipped = sum(x.get("skipped", 0) for x in payload["cells"])
    if skipped:
        print(f"{skipped} job(s) skipped by --time-limit: the same command with --resume runs them")
    print(f"wrote {out}/ ({payload['seconds']:.0f} s)")
    return 1 if payload["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
