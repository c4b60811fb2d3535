"""The methods of the speculative-decoding benchmark (``benchmarks/speculative.py``): their names and labels, loading
the bundled pair, one ``generate()`` call per method, timing a call, and the cells of the grid."""

from __future__ import annotations


import torch

import hf_sparsekv
from hf_sparsekv import HierarchicalQuantCache, SinkWindowCache
from hf_sparsekv.cache_keyword import cache_keyword
from hf_sparsekv.generation.engine import forget_sequences
from hf_sparsekv.generation.stats import SyncedTimer
from hf_sparsekv.zoo import load_pair

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
        return lambda: (verifier.generate(ids, **{cache_keyword(verifier): HierarchicalQuantCache()}, **common), None)
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


def _measure(fn, device, warmup: int, repeats: int, warmup_fn=None, verifier=None) -> dict:
    """``warmup`` discarded runs of ``warmup_fn`` (default ``fn``), then the median of ``repeats`` timed runs; before
    each, the engines kept on ``verifier`` (the model whose ``generate`` ``fn`` calls) forget the sequence they hold."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        (warmup_fn or fn)()
    runs = []
    for _ in range(repeats):
        if verifier is not None:
            forget_sequences(verifier)  # a repeat prefills its whole prompt, as the AR baselines do
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
