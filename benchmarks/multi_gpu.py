"""A verifier split over two GPUs (``device_map``, pipeline: the first half of the layers on cuda:0, the rest on
cuda:1) against the same verifier on one GPU, random bf16 weights of real shapes, one run, methods interleaved per
(placement, context).

Per placement (``one``: everything on cuda:0; ``split``) and context L, batch 1:

* ``hf-static-ar``: transformers' ``generate()`` on a ``StaticCache`` (its decode step compiled; on a split model
  transformers captures no CUDA graph), ms per token as the difference of a long and a short run from one prompt;
* our static engine's captured steps (compiled unless ``--compile 0``): ``ar`` (one token), ``verify`` (γ+1 tokens)
  and ``draft-chunk-B`` (one draft round / γ, the drafter on cuda:0 with a chunk budget B); ms per step, median;
* tokens/s of HF static AR and of our AR, and the break-even τ* = (γ·t_draft + t_verify) / t_ar of speculation;
* the per-step cost of crossing devices: split − one, for each step.

The drafter (Llama-3.2-1B shape) always sits on cuda:0. A placement whose weights and caches do not fit is skipped
(``--placements split`` alone for a 70B verifier). Writes ``multi_gpu.json`` and ``multi_gpu.md`` under ``--out``.

    python benchmarks/multi_gpu.py --verifier llama-3.1-8b --contexts 32768 65536 --out runs/multi-gpu-8b
    python benchmarks/multi_gpu.py --verifier llama-3.1-70b --placements split --contexts 32768 65536
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

import hf_sparsekv  # noqa: F401  (registers the attention implementations the models are built with)
from provenance import commit
from real_cost import model_config, time_graph_step
from scale import _free, per_token_e2e


def build_placed(name: str, devices: list[int], dtype=torch.bfloat16, layers: int | None = None):
    """Random weights of ``name``'s shape (``layers`` overrides the depth), the decoder layers split evenly over
    ``devices`` in order (the embedding on the first, the final norm and the head on the last), created on their
    devices directly; dispatched with accelerate's hooks when there are several devices."""
    from accelerate import dispatch_model
    from transformers import AutoModelForCausalLM

    config = model_config(name)
    config._attn_implementation = "sdpa"  # transformers' own attention for its generate(); ours switches per step
    if layers is not None:
        config.num_hidden_layers = layers
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    n = config.num_hidden_layers
    device_map = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0], "model.norm": devices[-1],
                  "lm_head": devices[-1]}
    device_map.update({f"model.layers.{i}": devices[i * len(devices) // n] for i in range(n)})
    torch.manual_seed(0)
    for module_name, device in device_map.items():
        module = model.get_submodule(module_name)
        if module_name == "model.rotary_emb":  # buffers computed from the config, not parameters
            model.model.rotary_emb = type(module)(config=config, device=f"cuda:{device}")
            continue
        module.to_empty(device=f"cuda:{device}")
        with torch.no_grad():
            for pname, p in module.named_parameters():
                p.fill_(1.0) if "norm" in f"{module_name}.{pname}" else p.normal_(0.0, 0.02)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    if len(set(devices)) > 1:
        model = dispatch_model(model, device_map=device_map)
    return model


def step_times(verifier, drafter, contexts: list[int], args) -> dict[int, dict[str, float]]:
    """context -> seconds of the captured ``ar``, ``verify`` and ``draft`` (per token) steps. One engine per mode,
    sized for the longest context and re-prefilled for the others (compiled and captured once)."""
    from hf_sparsekv.generation import engine as static_engine
    from hf_sparsekv.generation.graph_steps import static_attention_for

    out = {L: {} for L in contexts}
    for label, mode, budget, draft_model, names in (("ar", "ar", None, None, ["ar_step"]),
                                                    (f"chunk-{args.budget}", "chunk", args.budget, drafter,
                                                     ["draft", "verify"])):
        _free()
        with torch.no_grad(), static_attention_for(verifier, *([draft_model] if draft_model is not None else [])):
            engine = static_engine.engine_for(verifier, draft_model, mode, budget, args.gamma if draft_model else 1,
                                           max(contexts) + 64, 64, True)
            for L in sorted(contexts, reverse=True):
                engine.prefill([torch.randint(0, verifier.config.vocab_size, (1, L), device=verifier.device)])
                for name in names:
                    t = time_graph_step(engine, name, verifier.device, args.repeats, 2)
                    key = {"ar_step": "ar", "verify": "verify", "draft": f"draft-{label}"}[name]
                    out[L][key] = t / args.gamma if name == "draft" else t
            assert engine.use_graphs and all(s.graph is not None for s in engine.steps.values())
            if len(engine.devices) != len({p.device for p in verifier.parameters()}):
                raise RuntimeError(f"the engine spans devices {engine.devices}")
            del engine  # freed before the next engine allocates
    _free()
    return out


def markdown(rows: list[dict], args) -> str:
    lines = [f"verifier {args.verifier} shape{f' ({args.layers} layers)' if args.layers else ''}, drafter "
             f"{args.drafter} shape on cuda:0, random bf16 weights, batch 1, γ={args.gamma}, chunk budget "
             f"{args.budget}, steps {'compiled and ' if args.compile else ''}captured", "",
             "| placement | context | HF static AR ms/token | our AR ms | × HF static | verify ms | draft ms/token | τ* |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        s = r["seconds"]
        hf = s.get("hf-static-ar")
        tau = (args.gamma * s[f"draft-chunk-{args.budget}"] + s["verify"]) / s["ar"]
        lines.append(f"| {r['placement']} | {r['context']} | {hf * 1e3 if hf else float('nan'):.2f} | "
                     f"{s['ar'] * 1e3:.2f} | {hf / s['ar'] if hf else float('nan'):.2f} | {s['verify'] * 1e3:.2f} | "
                     f"{s[f'draft-chunk-{args.budget}'] * 1e3:.2f} | {tau:.2f} |")
    by = {(r["placement"], r["context"]): r["seconds"] for r in rows}
    crossing = [(L, {k: by[("split", L)][k] - v for k, v in by[("one", L)].items() if k in by[("split", L)]})
                for L in args.contexts if ("one", L) in by and ("split", L) in by]
    if crossing:
        lines += ["", "Cost of crossing devices (split − one), ms per step:", "",
                  "| context | " + " | ".join(crossing[0][1]) + " |", "| --- |" + " --- |" * len(crossing[0][1])]
        lines += [f"| {L} | " + " | ".join(f"{v * 1e3:+.3f}" for v in d.values()) + " |" for L, d in crossing]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifier", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, help="override the verifier's depth (the largest model that fits)")
    p.add_argument("--drafter", default="llama-3.2-1b")
    p.add_argument("--placements", nargs="+", default=["one", "split"], choices=["one", "split"])
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536])
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--e2e-tokens", type=int, nargs=2, default=[8, 32], help="short and long run of hf-static-ar")
    p.add_argument("--hf-contexts", type=int, nargs="*", help="contexts of the HF static AR baseline (default: all; "
                   "its cache is sized for the longest of them, and transformers' step reads the whole cache)")
    p.add_argument("--compile", type=int, default=1, help="0: capture our steps uncompiled")
    p.add_argument("--out", default="runs/multi-gpu")
    args = p.parse_args(argv)
    if torch.cuda.device_count() < 2 and "split" in args.placements:
        p.error("the split placement needs two CUDA GPUs")
    os.environ["HF_SPARSEKV_COMPILE"] = str(args.compile)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    hf_contexts = args.contexts if args.hf_contexts is None else args.hf_contexts
    drafter = build_placed(args.drafter, [0])
    for placement in tqdm(args.placements, desc="placements"):
        verifier = build_placed(args.verifier, [0] if placement == "one" else [0, 1], layers=args.layers)
        t0 = time.perf_counter()
        steps = step_times(verifier, drafter, args.contexts, args)
        for L in sorted(args.contexts, reverse=True):
            seconds = steps[L]
            rows.append(dict(placement=placement, context=L, seconds=seconds))
            (out / "multi_gpu.json").write_text(json.dumps(dict(settings=settings(args), rows=rows), indent=1))
            if L in hf_contexts:  # one cache length for every context: transformers compiles its step once
                ids = torch.randint(0, verifier.config.vocab_size, (1, L), device=verifier.device)
                seconds["hf-static-ar"], _ = per_token_e2e("hf-static-ar", verifier, ids, *args.e2e_tokens, 3,
                                                           cache_len=max(hf_contexts) + args.e2e_tokens[1])
            tqdm.write(f"{placement} {L}: " + " ".join(f"{k}={v * 1e3:.2f}ms" for k, v in seconds.items())
                       + f" ({time.perf_counter() - t0:.0f} s so far)")
            (out / "multi_gpu.json").write_text(json.dumps(dict(settings=settings(args), rows=rows), indent=1))
        _free()
        del verifier
        _free()
    table = markdown(rows, args)
    (out / "multi_gpu.md").write_text(table)
    print(table)
    return 0


def settings(args) -> dict:
    return dict(vars(args), devices=[torch.cuda.get_device_name(d) for d in range(torch.cuda.device_count())],
                date=datetime.date.today().isoformat(), commit=commit(), torch=torch.__version__)


if __name__ == "__main__":
    raise SystemExit(main())
