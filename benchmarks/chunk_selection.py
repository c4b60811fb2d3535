"""Quality of the chunk-budget selection (issue 36): drop-in greedy agreement and drafter acceptance, old vs new.

Drop-in (the verifier alone on a compressed cache, ``generate(ids, past_key_values=cache)``), per prompt length ×
budget B × cache, against the same model's greedy output on the full cache (64 new tokens, EOS ignored):

* ``match``: free-running greedy tokens equal to the full-cache tokens at the same position (of ``--new-tokens``),
  and ``prefix``: the length of the leading run of equal tokens;
* ``top1``: teacher-forced top-1 agreement per position: the compressed cache is fed the full-cache greedy
  continuation and its argmax at each position is compared with the full cache's token.

Caches: ``cumulative`` = ``ChunkBudgetCache(B, selection="cumulative")`` (the paper's score, the old default),
``observed`` = ``ChunkBudgetCache(B)`` (the new default), ``window`` = ``SinkWindowCache(4, B - 4)`` (the same
number of tokens), and any ``--variant NAME:observe,pool,recent,sink[,recent_cap[,kv]]`` (to choose the defaults;
a trailing ``kv`` selects per KV head).

``--pair real``: the drop-in part on the real verifier (Qwen2.5-Coder-1.5B-Instruct, float32, from
``~/.cache/hf_sparsekv/real``; ``python benchmarks/real_models.py fetch``), on the held-out python-source documents
of ``benchmarks/real_grid.py`` (``--docs`` indexes its list, documents of at least 8192 tokens: 0 = accelerate#1,
1 = concurrent#0), with one shared prefill per prompt (``--shared-prefill``, implied).

``--shared-prefill``: the prompt is prefilled once on a full cache while the hooks of
:func:`hf_sparsekv.prompt_queries` record every layer's queries; each compressed cache then receives the stored
keys/values through its own ``update`` and, where it waits for them, those queries (``select``), which is the state
its own prefill would leave (the prefill attends to the whole prompt in every cache). Greedy decoding then runs one
token per forward. Same numbers as the per-cache prefill path, one prefill instead of 1 + 2·budgets·caches.

Drafter (``--acceptance``): greedy sparse/full speculative decoding of the bundled pair, γ = ``--gamma``, α =
accepted/drafted and τ = mean tokens per round (accepted + 1), pooled over prompts, for the same caches.

    python benchmarks/chunk_selection.py --docs 2 3 4 5 --lengths 2048 4096 --out runs/chunk_selection.json
    python benchmarks/chunk_selection.py --pair real --docs 0 1 --lengths 2048 --budgets 512 1024 --threads 1

Prints markdown tables and writes JSON (settings, per-prompt values, pooled cells).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch
from tqdm import tqdm

import hf_sparsekv
from hf_sparsekv import ChunkBudgetCache, SinkWindowCache
from hf_sparsekv.cache_keyword import cache_keyword
from hf_sparsekv.caches.chunk_selection import ChunkSelection
from hf_sparsekv.generation import speculative_generate
from hf_sparsekv.zoo import eval_documents, load_pair

WINDOW_SINK = 4


def cache_factories(variants: list[str]) -> dict:
    """name -> (budget -> a fresh drafter/drop-in cache)."""
    caches = {
        "cumulative": lambda b: ChunkBudgetCache(b, selection="cumulative"),
        "observed": lambda b: ChunkBudgetCache(b),
        "window": lambda b: SinkWindowCache(WINDOW_SINK, b - WINDOW_SINK),
    }
    for spec in variants:
        name, knobs = spec.split(":")
        values = knobs.split(",")
        observe, pool, recent, sink = (int(x) for x in values[:4])
        cap = float(values[4]) if len(values) > 4 else ChunkSelection().recent_cap
        per_kv_head = len(values) > 5 and values[5] == "kv"
        sel = ChunkSelection(observe=observe, pool=pool, recent=recent, sink=sink, recent_cap=cap,
                             per_kv_head=per_kv_head)
        caches[name] = lambda b, sel=sel: ChunkBudgetCache(b, selection=sel)
    return caches


@torch.no_grad()
def teacher_forced_top1(model, ids: torch.Tensor, continuation: torch.Tensor, cache) -> list[bool]:
    """Per position of ``continuation [n]``: whether ``model`` on ``cache`` predicts it given ``ids`` and the
    continuation before it (prefill under the query hooks, then one forward over continuation[:-1])."""
    key = cache_keyword(model)
    with hf_sparsekv.prompt_queries(model):
        first = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{key: cache}).logits[0, -1]
    rest = model(input_ids=continuation[None, :-1], use_cache=True, **{key: cache}).logits[0]
    predicted = torch.cat([first.argmax()[None], rest.argmax(-1)])
    return (predicted == continuation).tolist()


@torch.no_grad()
def prefill_with_queries(model, ids: torch.Tensor):
    """One prefill of ``ids`` on a full DynamicCache: ``(layers [(k, v)], queries [q per layer], scalings, last
    logits [V])``, the queries recomputed by the same hook :func:`hf_sparsekv.prompt_queries` uses."""
    from transformers import DynamicCache

    from hf_sparsekv.caches.query_hooks import after_attention, recompute_queries

    cache, queries, scalings = DynamicCache(), {}, {}

    def grab(module, hidden_states, position_embeddings, _cache):
        i = module.layer_idx
        queries[i] = recompute_queries(module, hidden_states, position_embeddings, cache.layers[i].keys)
        scalings[i] = module.scaling

    with after_attention(model, grab):
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_keyword(model): cache})
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    n = len(layers)
    return layers, [queries[i] for i in range(n)], [scalings[i] for i in range(n)], out.logits[0, -1].float()


def filled(cache, prefilled):
    """``cache`` in the state its own prefill of the prompt would leave: the stored keys/values through its
    ``update``, then the recorded queries to each layer that waits for them."""
    layers, queries, scalings, _ = prefilled
    for i, (k, v) in enumerate(layers):
        cache.update(k.clone(), v.clone(), i)
        if hasattr(cache, "layers") and getattr(cache.layers[i], "awaiting_scores", False):
            cache.layers[i].select(queries[i], scalings[i])
    return cache


@torch.no_grad()
def greedy_continue(model, cache, first_logits: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` greedy tokens (EOS ignored) from a prefilled ``cache``, one forward per token."""
    key = cache_keyword(model)
    tokens = [int(first_logits.argmax())]
    while len(tokens) < n:
        out = model(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True, **{key: cache})
        tokens.append(int(out.logits[0, -1].argmax()))
    return torch.tensor(tokens)


@torch.no_grad()
def teacher_forced_shared(model, cache, first_logits: torch.Tensor, continuation: torch.Tensor) -> list[bool]:
    """:func:`teacher_forced_top1` from a prefilled ``cache`` (``first_logits``: the prompt's last logits)."""
    rest = model(input_ids=continuation[None, :-1], use_cache=True, **{cache_keyword(model): cache}).logits[0]
    predicted = torch.cat([first_logits.argmax()[None], rest.argmax(-1)])
    return (predicted == continuation).tolist()


def drop_in_shared(model, prompts, lengths, budgets, caches, new_tokens, top1_only=False, save=None) -> dict:
    """:func:`drop_in` with one prefill per prompt (see the module docstring); ``prompts``: ``[(name, ids [1, T])]``.
    ``save(cells)`` runs after each prompt."""
    cells: dict = {}
    work = [(name, ids, n) for n in lengths for name, ids in prompts]
    bar = tqdm(total=len(work) * len(budgets) * len(caches), desc="drop-in (shared prefill)")
    for name, ids, length in work:
        ids = ids[:, :length]
        t0 = time.perf_counter()
        prefilled = prefill_with_queries(model, ids)
        first = prefilled[3]
        prefill_seconds = time.perf_counter() - t0
        from transformers import DynamicCache

        full = greedy_continue(model, filled(DynamicCache(), prefilled), first, new_tokens)
        print(f"[{length} {name}] prefill {prefill_seconds:.0f}s, full-cache greedy "
              f"{time.perf_counter() - t0 - prefill_seconds:.0f}s", flush=True)
        for budget in budgets:
            for cname, make in caches.items():
                top1 = teacher_forced_shared(model, filled(make(budget), prefilled), first, full)
                cell = cells.setdefault(f"{length}/{budget}/{cname}", dict(match=[], prefix=[], top1=[], docs=[]))
                cell["docs"].append(name)
                if not top1_only:
                    out = greedy_continue(model, filled(make(budget), prefilled), first, new_tokens)
                    same = (out == full).tolist()
                    cell["match"].append(sum(same))
                    cell["prefix"].append(same.index(False) if False in same else len(same))
                cell["top1"].append(sum(top1) / len(top1))
                bar.update()
        del prefilled
        if save is not None:
            save(cells)
    bar.close()
    return cells


def real_prompts(tokenizer, docs: list[int]) -> list[tuple[str, torch.Tensor]]:
    """The real grid's held-out documents (``benchmarks/real_grid.py``: at least 8192 tokens, one per package)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from real_grid import documents

    found = documents(tokenizer, max(docs) + 1, 8192)
    return [found[d] for d in docs]


def drop_in(model, documents, lengths, budgets, caches, new_tokens, top1_only=False) -> dict:
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                  pad_token_id=0)
    cells: dict = {}
    work = [(d, n) for n in lengths for d in documents]
    bar = tqdm(total=len(work) * len(budgets) * len(caches), desc="drop-in")
    for doc, length in work:
        ids = eval_documents()[doc][None, :length]
        full = model.generate(ids, **kwargs)[0, length:]
        for budget in budgets:
            for name, make in caches.items():
                top1 = teacher_forced_top1(model, ids, full, make(budget))
                cell = cells.setdefault(f"{length}/{budget}/{name}", dict(match=[], prefix=[], top1=[]))
                if not top1_only:
                    out = model.generate(ids, past_key_values=make(budget), **kwargs)[0, length:]
                    same = (out == full).tolist()
                    cell["match"].append(sum(same))
                    cell["prefix"].append(same.index(False) if False in same else len(same))
                cell["top1"].append(sum(top1) / len(top1))
                bar.update()
    bar.close()
    return cells


def acceptance(verifier, drafter, documents, lengths, budgets, caches, new_tokens, gamma) -> dict:
    cells: dict = {}
    bar = tqdm(total=len(lengths) * len(budgets) * len(caches) * len(documents), desc="acceptance")
    for length in lengths:
        for budget in budgets:
            for name, make in caches.items():
                totals = dict(accepted=0, drafted=0, rounds=0, new_tokens=0)
                for doc in documents:
                    ids = eval_documents()[doc][None, :length]
                    out = speculative_generate(
                        verifier, ids, assistant_model=drafter, draft_cache=make(budget), num_assistant_tokens=gamma,
                        max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, return_dict_in_generate=True,
                    )
                    for key in totals:
                        totals[key] += out.spec_stats[key]
                    bar.update()
                cells[f"{length}/{budget}/{name}"] = dict(
                    totals, alpha=totals["accepted"] / max(totals["drafted"], 1),
                    tau=(totals["new_tokens"] - len(documents)) / max(totals["rounds"], 1),
                )
    bar.close()
    return cells


def mean(values) -> float:
    return sum(values) / len(values)


def print_tables(result: dict) -> None:
    s = result["settings"]
    names = s["caches"]
    if result.get("drop_in"):
        print_drop_in(result, s, names)
    if "acceptance" in result:
        print(f"\nDrafter cache (bundled pair, γ={s['gamma']}): α / τ")
        print("| prompt | B | " + " | ".join(names) + " |")
        print("|---|---|" + "---|" * len(names))
        for length in s["lengths"]:
            for budget in s["budgets"]:
                cells = [result["acceptance"][f"{length}/{budget}/{n}"] for n in names]
                print(f"| {length} | {budget} | " + " | ".join(f"{c['alpha']:.3f} / {c['tau']:.2f}" for c in cells) + " |")


def print_drop_in(result: dict, s: dict, names: list[str]) -> None:
    print(f"\nDrop-in greedy agreement with the full cache ({s['new_tokens']} new tokens, docs {s['documents']}): "
          "match / prefix / top-1")
    print("| prompt | B | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for length in s["lengths"]:
        for budget in s["budgets"]:
            row = []
            for name in names:
                c = result["drop_in"][f"{length}/{budget}/{name}"]
                if c["match"]:
                    row.append(f"{mean(c['match']):.1f} / {mean(c['prefix']):.1f} / {mean(c['top1']):.3f}")
                else:
                    row.append(f"{mean(c['top1']):.3f}")
            print(f"| {length} | {budget} | " + " | ".join(row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, nargs="+", default=[2, 3, 4, 5], help="held-out document indices")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--variant", action="append", default=[], help="NAME:observe,pool,recent,sink[,recent_cap[,kv]]")
    parser.add_argument("--only", nargs="+", help="caches to run (default: all)")
    parser.add_argument("--acceptance", action="store_true", help="also the drafter's α/τ (bundled pair)")
    parser.add_argument("--no-drop-in", action="store_true")
    parser.add_argument("--top1-only", action="store_true", help="drop-in: only the teacher-forced top-1 (fast)")
    parser.add_argument("--pair", choices=["bundled", "real"], default="bundled",
                        help="real: the drop-in part on the real 1.5B verifier (implies --shared-prefill)")
    parser.add_argument("--root", default=None, help="--pair real: cache directory (default ~/.cache/hf_sparsekv/real)")
    parser.add_argument("--shared-prefill", action="store_true", help="drop-in: one prefill per prompt")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="chunk_selection.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    caches = cache_factories(args.variant)
    if args.only:
        caches = {n: caches[n] for n in args.only}
    if args.pair == "real":
        if args.acceptance:
            parser.error("--pair real: the drafter's acceptance on the real pair is benchmarks/real_grid.py")
        from hf_sparsekv.zoo.real import load_real_pair

        verifier, drafter, tokenizer = load_real_pair(root=args.root, device="cpu", dtype=torch.float32)
        args.shared_prefill = True
        models = f"real verifier {getattr(verifier.config, '_name_or_path', '')}"
    else:
        verifier, drafter, _ = load_pair(device="cpu", dtype=torch.float32)
        models = "bundled pair (hf_sparsekv.zoo)"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result: dict = {"settings": dict(
        date=time.strftime("%Y-%m-%d"), commit=commit, cpu=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(), dtype="float32", models=models, pair=args.pair,
        shared_prefill=args.shared_prefill,
        documents=args.docs, lengths=args.lengths, budgets=args.budgets, new_tokens=args.new_tokens,
        gamma=args.gamma, caches=list(caches), variants=args.variant, window_sink=WINDOW_SINK,
        default_selection=str(ChunkSelection()),
    )}
    start = time.time()
    def save(cells=None):
        if cells is not None:
            result["drop_in"] = cells
        result["settings"]["seconds"] = round(time.time() - start, 1)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)

    if not args.no_drop_in and args.shared_prefill:
        if args.pair == "real":
            prompts = real_prompts(tokenizer, args.docs)
            result["settings"]["document_names"] = [name for name, _ in prompts]
        else:
            prompts = [(str(d), eval_documents()[d][None]) for d in args.docs]
        result["drop_in"] = drop_in_shared(verifier, prompts, args.lengths, args.budgets, caches, args.new_tokens,
                                           args.top1_only, save)
    elif not args.no_drop_in:
        result["drop_in"] = drop_in(verifier, args.docs, args.lengths, args.budgets, caches, args.new_tokens,
                                    args.top1_only)
    if args.acceptance:
        result["acceptance"] = acceptance(verifier, drafter, args.docs, args.lengths, args.budgets, caches,
                                          args.new_tokens, args.gamma)
    save()
    print_tables(result)


if __name__ == "__main__":
    main()
