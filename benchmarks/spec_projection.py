"""The projection (7B/68M-shaped random-weight models timed on the GPU, combined with the measured acceptance) and
the profile (one speculative setting broken down by timers and torch.profiler) of ``benchmarks/speculative.py``."""

from __future__ import annotations

import statistics
import time

import torch

from hf_sparsekv.cache_keyword import cache_keyword
from hf_sparsekv.generation.stats import SyncedTimer
from spec_methods import PROJECTION_FORMULA, _generate_fn
from spec_report import _ctx, _fixed_gamma, _fmt



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
                verifier(input_ids=ids[:, :c], **{cache_keyword(verifier): holder["cache"]}, use_cache=True, logits_to_keep=1)

            row["verifier_prefill_s"] = _time(prefill, device, warmup=1, reps=1 if c >= 8192 else 2)
            for k in ks:
                def step(k=k):
                    verifier(input_ids=ids[:, c:c + k], **{cache_keyword(verifier): holder["cache"]}, use_cache=True,
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
                        drafter(input_ids=ids[:, :c], **{cache_keyword(drafter): cache}, use_cache=True, logits_to_keep=1)
                    prompt = ids[:, :c]
                except Exception as exc:  # noqa: BLE001 - time an equivalent B-token DynamicCache instead
                    result.setdefault("drafter_cache_fallbacks", []).append(
                        f"ctx {c} B {b}: ChunkBudgetCache failed ({type(exc).__name__}: {exc}); timed a "
                        f"DynamicCache of {b} tokens instead")
                    drafter.set_attn_implementation("sdpa")
                    cache = DynamicCache()
                    with SyncedTimer(device) as clock:
                        drafter(input_ids=ids[:, :c], use_cache=False, logits_to_keep=1)  # prefill cost of c tokens
                        drafter(input_ids=ids[:, :b], **{cache_keyword(drafter): cache}, use_cache=True, logits_to_keep=1)
                    prompt = ids[:, :b]
                    drafter.set_attn_implementation(attention.NAME)
                start = prompt.shape[1]

                def dstep(cache=cache, start=start):
                    drafter(input_ids=ids[:, c:c + 1], **{cache_keyword(drafter): cache}, use_cache=True, logits_to_keep=1,
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
    from hf_sparsekv.generation import engine as static_engine

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

    engine_cls = static_engine.StaticEngine
    run_step = engine_cls.run_step

    def stepped(self, name, *args, **kwargs):  # each step (draft, verify, catch_up, ...) under its own name
        return timed(f"engine step: {name}", run_step)(self, name, *args, **kwargs)

    patches = [(engine_cls, "prefill", timed("prefill (both models)", engine_cls.prefill)), (engine_cls, "run_step", stepped)]
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    static_engine.forget_sequences(models["verifier"])  # the profiled call prefills its whole prompt, as AR does
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
        static_engine.forget_sequences(models["verifier"])
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
