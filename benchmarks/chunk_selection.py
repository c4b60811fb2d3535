"""Quality of the chunk-budget selection (issue 36): drop-in greedy agreement and drafter acceptance, old vs new.

Drop-in (the verifier alone on a compressed cache, ``generate(ids, past_key_values=cache)``), per prompt length ×
budget B × cache, against the same model's greedy output on the full cache (64 new tokens, EOS ignored):

* ``match``: free-running greedy tokens equal to the full-cache tokens at the same position (of ``--new-tokens``),
  and ``prefix``: the length of the leading run of equal tokens;
* ``top1``: teacher-forced top-1 agreement per position: the compressed cache is fed the full-cache greedy
  continuation and its argmax at each position is compared with the full cache's token.

Caches: ``cumulative`` = ``ChunkBudgetCache(B, selection="cumulative")`` (the paper's score, the old default),
``observed`` = ``ChunkBudgetCache(B)`` (the new default), ``window`` = ``SinkWindowCache(4, B - 4)`` (the same
number of tokens), and any ``--variant NAME:observe,pool,recent,sink`` (to choose the defaults).

Drafter (``--acceptance``): greedy sparse/full speculative decoding of the bundled pair, γ = ``--gamma``, α =
accepted/drafted and τ = mean tokens per round (accepted + 1), pooled over prompts, for the same caches.

    python benchmarks/chunk_selection.py --docs 2 3 4 5 --lengths 2048 4096 --out runs/chunk_selection.json

Prints markdown tables and writes JSON (settings, per-prompt values, pooled cells).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time

import torch
from tqdm import tqdm

import hf_sparsekv
from hf_sparsekv import ChunkBudgetCache, SinkWindowCache
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
        sel = ChunkSelection(observe=observe, pool=pool, recent=recent, sink=sink, recent_cap=cap)
        caches[name] = lambda b, sel=sel: ChunkBudgetCache(b, selection=sel)
    return caches


@torch.no_grad()
def teacher_forced_top1(model, ids: torch.Tensor, continuation: torch.Tensor, cache) -> list[bool]:
    """Per position of ``continuation [n]``: whether ``model`` on ``cache`` predicts it given ``ids`` and the
    continuation before it (prefill under the query hooks, then one forward over continuation[:-1])."""
    with hf_sparsekv.prompt_queries(model):
        first = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    rest = model(input_ids=continuation[None, :-1], past_key_values=cache, use_cache=True).logits[0]
    predicted = torch.cat([first.argmax()[None], rest.argmax(-1)])
    return (predicted == continuation).tolist()


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
    parser.add_argument("--variant", action="append", default=[], help="NAME:observe,pool,recent,sink[,recent_cap]")
    parser.add_argument("--only", nargs="+", help="caches to run (default: all)")
    parser.add_argument("--acceptance", action="store_true", help="also the drafter's α/τ (bundled pair)")
    parser.add_argument("--no-drop-in", action="store_true")
    parser.add_argument("--top1-only", action="store_true", help="drop-in: only the teacher-forced top-1 (fast)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="chunk_selection.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    caches = cache_factories(args.variant)
    if args.only:
        caches = {n: caches[n] for n in args.only}
    verifier, drafter, _ = load_pair(device="cpu", dtype=torch.float32)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result: dict = {"settings": dict(
        date=time.strftime("%Y-%m-%d"), commit=commit, cpu=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(), dtype="float32", models="bundled pair (hf_sparsekv.zoo)",
        documents=args.docs, lengths=args.lengths, budgets=args.budgets, new_tokens=args.new_tokens,
        gamma=args.gamma, caches=list(caches), variants=args.variant, window_sink=WINDOW_SINK,
        default_selection=str(ChunkSelection()),
    )}
    start = time.time()
    if not args.no_drop_in:
        result["drop_in"] = drop_in(verifier, args.docs, args.lengths, args.budgets, caches, args.new_tokens,
                                    args.top1_only)
    if args.acceptance:
        result["acceptance"] = acceptance(verifier, drafter, args.docs, args.lengths, args.budgets, caches,
                                          args.new_tokens, args.gamma)
    result["settings"]["seconds"] = round(time.time() - start, 1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print_tables(result)


if __name__ == "__main__":
    main()
