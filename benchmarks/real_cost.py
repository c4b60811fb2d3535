"""The cost side of the real pairs (issue 14): per-forward times with random weights of the real shapes.

Real weights cannot travel to the GPU machine, so this times models of exactly the shapes of
Qwen2.5-Coder-1.5B-Instruct / -0.5B-Instruct (and Llama-3.1-8B / Llama-3.2-1B) with random bf16 weights, on the
path `generate()` takes on CUDA: the static engine of ``hf_sparsekv.generation.engine`` (preallocated caches,
steps captured as CUDA graphs; ``--compile`` compiles them first, as ``generate()`` does by default), prefilled with
``L`` random tokens in each of ``B`` rows (``--batches``: the batched engine of a left-padded batch, every mode);
every timed run starts again at the prompt's end.

Steps per (pair, context L, batch B), milliseconds per step of all B rows:
    ar            verifier, 1 token (the captured AR step)
    verify        verifier, γ+1 tokens, full static cache
    draft-full    drafter, one draft round on a full static cache, divided by γ
    draft-chunk-B drafter, one draft round on the chunk-budget cache (B) selected at the prefill, divided by γ
    draft-window  drafter, one draft round on the sink (4) + window cache, divided by γ
    int4-draft    verifier, one draft round on the INT4 view of its quantized store, divided by γ (self-speculation)
    int4-verify   verifier, γ+1 tokens on the INT8 view

Projection (labelled so; decode phase only, prefill excluded): a round drafts γ tokens and verifies once, and
yields τ tokens on average (τ measured on the real pair on CPU, ``--acceptance runs/real/results.json``), so
    speedup ≈ τ · T_ar / (γ · T_draft + T_verify)
and, from the measured α alone (drafts accepted independently), τ_α = (1 − α^(γ+1)) / (1 − α) in place of τ;
the break-even τ* = (γ · T_draft + T_verify) / T_ar is printed for every mode (what τ a drafter must reach).

    python benchmarks/real_models.py cost --out runs/real-cost --acceptance runs/real/results.json   # CUDA, bf16
    python benchmarks/real_models.py cost --tiny --out /tmp/cost                                   # CPU smoke test
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

from provenance import commit

# Published config.json shapes (hidden, intermediate, layers, q heads, kv heads, head_dim, vocab, rope theta, tied).
SHAPES = {
    "qwen2.5-coder-1.5b": dict(arch="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                               num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, rope_theta=1e6,
                               tie_word_embeddings=True, max_position_embeddings=32768),
    "qwen2.5-coder-0.5b": dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, rope_theta=1e6,
                               tie_word_embeddings=True, max_position_embeddings=32768),
    "llama-3.1-8b": dict(arch="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=5e5,
                         tie_word_embeddings=False, max_position_embeddings=131072),
    "llama-3.1-70b": dict(arch="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, rope_theta=5e5,
                          tie_word_embeddings=False, max_position_embeddings=131072),
    "llama-3.2-1b": dict(arch="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=5e5,
                         tie_word_embeddings=True, max_position_embeddings=131072, head_dim=64),
    "qwen2.5-7b": dict(arch="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=1e6,
                       tie_word_embeddings=False, max_position_embeddings=131072),
    "qwen2.5-0.5b": dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, rope_theta=1e6,
                         tie_word_embeddings=True, max_position_embeddings=131072),
}
PAIRS = {"qwen2.5-coder": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"), "llama-3.1-8b+3.2-1b": ("llama-3.1-8b", "llama-3.2-1b")}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512)


def add_cost_args(p) -> None:
    p.add_argument("--out", default="runs/real-cost")
    p.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--batches", type=int, nargs="+", default=[1], help="rows decoded together")
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--window-budget", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--group-size", type=int, default=128, help="HierarchicalQuantCache group size G")
    p.add_argument("--acceptance", default=None, help="results.json of `real_models.py grid` (τ for the projection)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes, contexts 64/128, budgets 16/32, G=16, float32, CPU allowed: the same code path as a smoke test")
    p.add_argument("--device", default=None, help="default cuda (cpu only with --tiny)")
    p.add_argument("--compile", action="store_true",
                   help="compile the steps before capture, as generate() does by default (adds 10-60 s per "
                        "configuration); default: captured uncompiled steps")


def model_config(name: str, tiny: bool = False):
    from transformers import LlamaConfig, Qwen2Config

    shape = dict(SHAPES[name])
    arch = shape.pop("arch")
    if tiny:  # same family, heads and GQA ratio scaled down; head_dim follows hidden / heads
        heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
        shape.update(TINY, num_attention_heads=4, num_key_value_heads=max(1, 4 * kv // heads))
        shape.pop("head_dim", None)
    config = (Qwen2Config if arch == "qwen2" else LlamaConfig)(**shape)
    config._attn_implementation = "sparsekv"
    return config


def build(name: str, device: torch.device, dtype: torch.dtype, tiny: bool, **overrides):
    """Random weights, created on ``device`` directly (no CPU copy of an 8B model); ``overrides``: config fields."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    config = model_config(name, tiny)
    for key, value in overrides.items():
        setattr(config, key, value)
    cls = Qwen2ForCausalLM if config.model_type == "qwen2" else LlamaForCausalLM
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_graph_step(engine, name: str, device, repeats: int, warmup: int) -> float:
    """Median seconds of one run of the engine's step ``name`` (captured as a CUDA graph on first use, which the
    warm-up absorbs), the sequence length put back after each run so that every run starts at the prompt's end."""
    n0, seq0 = engine.n.clone(), engine.seq.clone()
    times = []
    for i in range(max(warmup, 1) + repeats):
        _sync(device)
        t0 = time.perf_counter()
        engine.run_step(name)
        _sync(device)
        if i >= max(warmup, 1):
            times.append(time.perf_counter() - t0)
        engine.n.copy_(n0)
        engine.seq.copy_(seq0)
    return statistics.median(times)


def engine_step_seconds(verifier, drafter, mode: str, budget, gamma: int, prompts: list, device, repeats: int,
                        warmup: int, *names: str) -> list[float]:
    """A fresh engine of ``mode`` (the previous one released with its caches), prefilled with ``prompts`` (one row
    each, room for 64 more tokens): the median seconds of each step of ``names`` (:func:`time_graph_step`)."""
    from hf_sparsekv.generation import engine as static_engine

    static_engine.release_engines()  # free the previous configuration's caches (they hold the whole batch)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    length = max(p.shape[1] for p in prompts)
    engine = static_engine.engine_for(verifier, drafter, mode, budget, 1 if mode == "ar" else gamma, length + 64, 64,
                                      device.type == "cuda", batch=len(prompts))
    engine.prefill(prompts)
    return [time_graph_step(engine, n, device, repeats, warmup) for n in names]


def measure_pair(pair: str, args, device, dtype) -> list[dict]:
    """Per-step seconds on the path ``generate()`` takes on CUDA: the static engine's steps (captured as CUDA graphs
    on CUDA; on CPU run as they are). ``draft-*`` is one draft round divided by γ."""
    from hf_sparsekv.generation import engine as static_engine
    from hf_sparsekv.generation.graph_steps import static_attention_for

    v_name, d_name = PAIRS[pair]
    verifier, drafter = build(v_name, device, dtype, args.tiny), build(d_name, device, dtype, args.tiny)
    vocab = verifier.config.vocab_size
    g = args.gamma
    rows = []
    for L, batch in ((L, B) for L in args.contexts for B in args.batches):
        prompts = [torch.randint(0, vocab, (1, L), device=device)] * batch
        steps = {}

        def timed(mode, budget, draft_model, *names):
            return engine_step_seconds(verifier, draft_model, mode, budget, g, prompts, device, args.repeats,
                                       args.warmup, *names)

        with torch.no_grad(), static_attention_for(verifier, drafter):
            (steps["ar"],) = timed("ar", None, None, "ar_step")
            draft_round, steps["verify"] = timed("full", None, drafter, "draft", "verify")
            steps["draft-full"] = draft_round / g
            for b in args.budgets:
                (draft_round,) = timed("chunk", b, drafter, "draft")
                steps[f"draft-chunk-{b}"] = draft_round / g
            (draft_round,) = timed("window", args.window_budget, drafter, "draft")
            steps[f"draft-window-{args.window_budget}"] = draft_round / g
            draft_round, steps["int4-verify"] = timed("int4", args.group_size, verifier, "draft", "verify")
            steps["int4-draft"] = draft_round / g
        static_engine.release_engines()
        rows.append({"pair": pair, "verifier": v_name, "drafter": d_name, "context": L, "batch": batch,
                     "seconds": steps})
        print(f"[{pair} {L} B={batch}] " + " ".join(f"{k}={v * 1e3:.2f}ms" for k, v in steps.items()), flush=True)
    verifier = drafter = None  # free the models before the next pair
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def modes(steps: dict) -> dict[str, tuple[float, float]]:
    """mode -> (draft step seconds, verify step seconds)."""
    out = {"full/full": (steps["draft-full"], steps["verify"])}
    for k, v in steps.items():
        if k.startswith("draft-chunk-"):
            out[f"sparse/full B={k.rsplit('-', 1)[1]}"] = (v, steps["verify"])
        elif k.startswith("draft-window-"):
            out[f"window/full B={k.rsplit('-', 1)[1]}"] = (v, steps["verify"])
    if "int4-draft" in steps:
        out["int4 self-spec"] = (steps["int4-draft"], steps["int4-verify"])
    return out


def _grid_method(mode: str) -> str:
    """The grid's method name for a projection mode."""
    if mode == "full/full":
        return "full"
    if mode == "int4 self-spec":
        return "int4"
    b = mode.split("B=")[1]
    return f"chunk-{b}" if mode.startswith("sparse") else f"window4-{b}"


def measured_acceptance(path: str | None) -> dict[tuple[str, int], tuple[float, float]]:
    """(grid method, context) -> (α, τ) pooled over documents: α = accepted / drafted, τ = tokens after the
    prefill's first / rounds."""
    if not path:
        return {}
    cells = [c for c in json.loads(Path(path).read_text())["cells"] if "error" not in c]
    acc: dict = {}
    for c in cells:
        key = (c["method"], c["context"])
        a, d, n, r = acc.get(key, (0, 0, 0, 0))
        acc[key] = (a + c["accepted"], d + c["drafted"], n + c["new_tokens"] - 1, r + c["rounds"])
    return {k: (a / d if d else 0.0, n / r) for k, (a, d, n, r) in acc.items() if r}


def tokens_per_round(alpha: float, gamma: int) -> float:
    """Expected tokens per round if each draft is accepted independently with probability α:
    (1 − α^(γ+1)) / (1 − α)."""
    return gamma + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def project(rows: list[dict], gamma: int, measured: dict) -> list[dict]:
    """Break-even τ and, where the Qwen pair has a measured (α, τ) at that context, the projected decode speedup:
    from the measured τ, and from the measured α through :func:`tokens_per_round`."""
    out = []
    for row in rows:
        t_ar = row["seconds"]["ar"]
        for mode, (t_draft, t_verify) in modes(row["seconds"]).items():
            round_cost = gamma * t_draft + t_verify
            entry = {"pair": row["pair"], "context": row["context"], "batch": row.get("batch", 1), "mode": mode,
                     "break_even_tau": round_cost / t_ar}
            found = measured.get((_grid_method(mode), row["context"])) if row["pair"] == "qwen2.5-coder" else None
            if found is not None:
                alpha, tau = found
                entry.update(measured_alpha=alpha, measured_tau=tau, projected_speedup=tau * t_ar / round_cost,
                             projected_speedup_from_alpha=tokens_per_round(alpha, gamma) * t_ar / round_cost)
            out.append(entry)
    return out


def markdown(rows: list[dict], projection: list[dict], gamma: int) -> str:
    lines = [f"Per-forward milliseconds (median), γ = {gamma}:", ""]
    keys = list(dict.fromkeys(k for r in rows for k in r["seconds"]))
    lines += ["| pair | context | batch | " + " | ".join(keys) + " |", "| --- | --- | --- |" + " --- |" * len(keys)]
    for r in rows:
        cells = (f"{r['seconds'][k] * 1e3:.2f}" if k in r["seconds"] else "—" for k in keys)
        lines.append(f"| {r['pair']} | {r['context']} | {r.get('batch', 1)} | " + " | ".join(cells) + " |")
    lines += ["", "PROJECTION (not a measurement): speedup ≈ τ · T_ar / (γ · T_draft + T_verify); "
              "break-even τ* = (γ · T_draft + T_verify) / T_ar", "",
              "| pair | context | batch | mode | break-even τ* | measured α / τ (CPU, real weights) | "
              "projected speedup (τ) | projected speedup (α, i.i.d.) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in projection:
        at = f"{p['measured_alpha']:.3f} / {p['measured_tau']:.2f}" if "measured_tau" in p else "—"
        sp = f"{p['projected_speedup']:.2f}×" if "projected_speedup" in p else "—"
        spa = f"{p['projected_speedup_from_alpha']:.2f}×" if "projected_speedup_from_alpha" in p else "—"
        lines.append(f"| {p['pair']} | {p['context']} | {p['batch']} | {p['mode']} | {p['break_even_tau']:.2f} | {at} | "
                     f"{sp} | {spa} |")
    return "\n".join(lines)


def run_cost(args) -> dict:
    if args.tiny:
        if args.contexts == [4096, 8192, 16384, 32768]:
            args.contexts = [64, 128]
        if args.budgets == [256, 1024, 2048]:
            args.budgets = [16, 32]
        if args.window_budget == 1024:
            args.window_budget = 32
        if args.group_size == 128:
            args.group_size = 16
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.tiny:
        raise ValueError("the cost benchmark times CUDA kernels: run it on a CUDA GPU (or pass --tiny for a CPU smoke test)")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    rows = []
    previous = os.environ.get("HF_SPARSEKV_COMPILE")
    os.environ["HF_SPARSEKV_COMPILE"] = "1" if args.compile else "0"
    try:
        for pair in args.pairs:
            rows += measure_pair(pair, args, device, dtype)
    finally:
        os.environ.pop("HF_SPARSEKV_COMPILE") if previous is None else os.environ.update(HF_SPARSEKV_COMPILE=previous)
    projection = project(rows, args.gamma, measured_acceptance(args.acceptance))
    result = {
        "settings": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "dtype": str(dtype).removeprefix("torch."), "gamma": args.gamma, "tiny": args.tiny,
                     "path": "static engine steps of generate()'s CUDA path (CUDA graphs on CUDA), "
                             + ("compiled" if args.compile else "uncompiled"),
                     "group_size": args.group_size, "repeats": args.repeats, "warmup": args.warmup, "commit": commit(),
                     "date": datetime.date.today().isoformat(), "torch": torch.__version__,
                     "acceptance_from": args.acceptance},
        "rows": rows,
        "projection": projection,
        "formula": "speedup ≈ τ · T_ar / (γ · T_draft + T_verify), τ measured, or τ_α = (1 − α^(γ+1)) / (1 − α) from the "
                   "measured α (decode only, prefill excluded; a projection)",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cost.json").write_text(json.dumps(result, indent=1))
    md = markdown(rows, projection, args.gamma)
    (out / "cost.md").write_text(md + "\n")
    print(md)
    return result
