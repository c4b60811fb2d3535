"""Acceptance grid on the real pair (issue 14), CPU float32: BudgetDraft Table 1's acceptance half and the
LongSpec/QuantSpec analogues, on held-out Python source.

For each (context, document) the verifier's prompt prefill runs once; every method then starts from a copy of
that prefill (see :class:`PrefilledVerifier`), so a 1.5B prefill on 2 CPU cores is paid once per prompt, not once
per method. The drafter's prefill is not shared: its cache (chunk budget, window) depends on the method.
Each speculative output is checked token for token against greedy AR of the verifier computed here by a plain
one-token-at-a-time loop (on a DynamicCache, or on a HierarchicalQuantCache in the INT8 view for int4).
Each finished cell is appended to ``--out/results.json`` at once; a rerun skips the cells already there.

Methods (γ = --gamma, greedy, batch 1):
    full            full/full: the 0.5B drafter on a full DynamicCache (what stock assisted generation gets)
    chunk-B         sparse/full (BudgetDraft): the drafter on ChunkBudgetCache(B), B in --budgets
    chunkcum-B      the same with the paper's cumulative score, ChunkBudgetCache(B, selection="cumulative"), B in
                    --cum-budgets (the chunk method's selection before issue 36)
    window0-B       window/full: SinkWindowCache(sink=0, window=B), B = --window-budget
    window4-B       window/full: draft_cache="window", kv_budget=B (4 sink tokens + B-4 window)
    int4            QuantSpec self-speculation of the 1.5B (INT4 draft / INT8 verify on one store)
    lookup          retrieval alone: prompt lookup (``prompt_lookup_num_tokens=γ``), no drafter
    chunklookup-B   chunk-B with prompt lookup beside the drafter (a round takes the retrieved continuation where
                    the prompt or the output so far has a match, else the drafter's tokens), B in --budgets
    window4lookup-B window4-B with prompt lookup beside the drafter
    <cell>-tN       a drafter cell above with ``draft_tree_size=N`` (trees: the drafter's chain and its most probable
                    alternatives, N nodes a round; with lookup beside, retrieval grafted in), N in --tree-sizes
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from pathlib import Path

import torch

from hf_sparsekv.cache_keyword import cache_keyword, user_cache
from provenance import commit

METHOD_ORDER = ("full", "chunk", "chunkcum", "window0", "window4", "int4", "lookup", "chunklookup", "window4lookup")
OPT_IN = ("chunkcum", "chunklookup", "window4lookup")  # run when named in --methods


def add_grid_args(p) -> None:
    p.add_argument("--out", default="runs/real", help="directory for results.json")
    p.add_argument("--root", default=None, help="real-pair cache directory (default ~/.cache/hf_sparsekv/real)")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--docs", type=int, default=2, help="documents per context (held-out python-source)")
    p.add_argument("--min-doc-tokens", type=int, default=8192,
                   help="documents are chosen among those at least this long (and as long as the largest context), "
                        "so that every context uses the same documents")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--cum-budgets", type=int, nargs="+", default=None,
                   help="budgets of chunkcum (cumulative selection; default: --budgets)")
    p.add_argument("--window-budget", type=int, default=1024)
    p.add_argument("--methods", nargs="+", default=[m for m in METHOD_ORDER if m not in OPT_IN],
                   choices=list(METHOD_ORDER), help=f"default: all but {', '.join(OPT_IN)}")
    p.add_argument("--tree-sizes", type=int, nargs="+", default=[],
                   help="also run each drafter cell with draft_tree_size=N (cells named <cell>-tN)")
    p.add_argument("--only-trees", action="store_true", help="run only the -tN cells of --tree-sizes")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


class PrefilledVerifier:
    """The verifier, except that a forward over exactly ``prompt`` on an empty cache is answered from a stored
    prefill: the stored keys/values go into the cache through its own ``update`` (the same call the model's
    prefill makes, so every cache ends up in the state the real prefill would leave) and the stored last-position
    logits are returned. Everything else is the verifier itself."""

    def __init__(self, model, prompt: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]], logits: torch.Tensor):
        self._model, self._prompt, self._layers, self._logits = model, prompt, layers, logits

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, input_ids=None, **kwargs):
        cache = user_cache(kwargs)
        if (cache is not None and cache.get_seq_length() == 0
                and input_ids.shape == self._prompt.shape and torch.equal(input_ids, self._prompt)):
            for i, (k, v) in enumerate(self._layers):
                cache.update(k.clone(), v.clone(), i)
            return _Logits(self._logits.clone())
        return self._model(input_ids=input_ids, **kwargs)


class _Logits:
    def __init__(self, logits):
        self.logits = logits


def prefill(model, prompt: torch.Tensor):
    """``(layers [(k, v)], last logits [1, 1, V], seconds)`` of one prefill on a DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{cache_keyword(model): cache})
    seconds = time.perf_counter() - t0
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    return layers, out.logits.float(), seconds


def greedy_reference(model, cache, prompt_len: int, first_logits: torch.Tensor, n: int, eos: set[int]):
    """Greedy AR, one token per forward, continuing a prefilled ``cache``: ``(tokens, top-2 gaps, seconds)``."""
    tokens, gaps = [], []
    logits = first_logits[0, -1]
    t0 = time.perf_counter()
    with torch.no_grad():
        while True:
            top = torch.topk(logits.double(), 2)
            tokens.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            if len(tokens) == n or tokens[-1] in eos:
                break
            pos = prompt_len + len(tokens) - 1
            out = model(input_ids=torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[pos]]), use_cache=True,
                        **{cache_keyword(model): cache})
            logits = out.logits[0, -1].float()
    return tokens, gaps, time.perf_counter() - t0


def _method_cells(args) -> list[str]:
    cells = []
    for m in args.methods:
        if m in ("chunk", "chunklookup"):
            cells += [f"{m}-{b}" for b in args.budgets]
        elif m == "chunkcum":
            cells += [f"chunkcum-{b}" for b in (args.cum_budgets or args.budgets)]
        elif m in ("window0", "window4", "window4lookup"):
            cells.append(f"{m}-{args.window_budget}")
        else:
            cells.append(m)
    trees = [f"{c}-t{n}" for n in args.tree_sizes for c in cells if c.split("-")[0] not in ("int4", "lookup")]
    return trees if args.only_trees else cells + trees


def _spec_kwargs(cell: str, verifier, drafter, gamma: int) -> dict:
    base, _, tree = cell.rpartition("-t")
    if base and tree.isdigit():  # <cell>-tN: the cell's drafter drafting trees of N nodes
        return dict(_chain_kwargs(base, verifier, drafter, gamma), draft_tree_size=int(tree))
    return _chain_kwargs(cell, verifier, drafter, gamma)


def _chain_kwargs(cell: str, verifier, drafter, gamma: int) -> dict:
    from hf_sparsekv import ChunkBudgetCache, SinkWindowCache

    if cell == "full":
        return dict(assistant_model=drafter, draft_cache="full")
    if cell == "int4":
        return dict(assistant_model=verifier, draft_cache="int4")
    if cell == "lookup":
        return dict(prompt_lookup_num_tokens=gamma)
    kind, budget = cell.rsplit("-", 1)
    budget = int(budget)
    if kind == "chunk":
        return dict(assistant_model=drafter, kv_budget=budget)
    if kind == "chunklookup":
        return dict(assistant_model=drafter, kv_budget=budget, prompt_lookup_num_tokens=gamma)
    if kind == "window4lookup":
        return dict(assistant_model=drafter, draft_cache="window", kv_budget=budget, prompt_lookup_num_tokens=gamma)
    if kind == "chunkcum":
        return dict(assistant_model=drafter, draft_cache=ChunkBudgetCache(budget, selection="cumulative"))
    if kind == "window4":
        return dict(assistant_model=drafter, draft_cache="window", kv_budget=budget)
    if kind == "window0":
        return dict(assistant_model=drafter, draft_cache=SinkWindowCache(sink=0, window=budget, max_rollback=gamma + 1))
    raise ValueError(f"unknown cell {cell!r}")


def documents(tokenizer, n: int, min_tokens: int) -> list[tuple[str, torch.Tensor]]:
    """The first ``n`` held-out python-source documents with at least ``min_tokens`` tokens, one per package:
    ``[(name, ids[1, T])]``."""
    from hf_sparsekv.data import python_source_documents

    out = []
    for doc in python_source_documents("eval"):
        if any(name.split("#")[0] == doc.package for name, _ in out):
            continue
        ids = tokenizer(doc.text, add_special_tokens=False, return_tensors="pt").input_ids
        if ids.shape[1] >= min_tokens:
            out.append((f"{doc.package}#{doc.part}", ids))
            if len(out) == n:
                return out
    raise RuntimeError(f"only {len(out)} held-out documents with >= {min_tokens} tokens (asked for {n})")


def _save(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def _mismatch(got: list[int], ref: list[int], gaps: list[float]):
    for i, (g, r) in enumerate(zip(got, ref)):
        if g != r:
            return {"position": i, "expected": r, "got": g, "reference_top2_gap": gaps[i]}
    if len(got) != len(ref):
        return {"position": min(len(got), len(ref)), "length_got": len(got), "length_expected": len(ref)}
    return None


def run_grid(args, models=None) -> dict:
    """Run (or resume) the grid; ``models`` = (verifier, drafter, tokenizer) to skip loading the real pair."""
    from hf_sparsekv import HierarchicalQuantCache, speculative_generate
    from transformers import DynamicCache

    if args.threads:
        torch.set_num_threads(args.threads)
    if models is None:
        from hf_sparsekv.zoo.real import load_real_pair

        models = load_real_pair(root=args.root, device="cpu", dtype=torch.float32)
    verifier, drafter, tokenizer = models
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    data = json.loads(path.read_text()) if path.exists() else {"cells": [], "references": []}
    data["settings"] = {
        "verifier": getattr(verifier.config, "_name_or_path", ""), "drafter": getattr(drafter.config, "_name_or_path", ""),
        "dtype": "float32", "device": "cpu", "torch_threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "gamma": args.gamma, "new_tokens": args.new_tokens, "contexts": args.contexts,
        "dataset": "hf_sparsekv.data python-source, eval split", "commit": commit(),
        "torch": torch.__version__, "date": datetime.date.today().isoformat(),
    }
    done = {(c["context"], c["doc"], c["method"]) for c in data["cells"]}
    cells = _method_cells(args)
    eos_ids = verifier.generation_config.eos_token_id
    eos = set([eos_ids] if isinstance(eos_ids, int) else (eos_ids or []))
    docs = documents(tokenizer, args.docs, max(args.min_doc_tokens, *args.contexts))
    for context in args.contexts:
        for name, ids in docs:
            todo = [c for c in cells if (context, name, c) not in done]
            if not todo:
                continue
            prompt = ids[:, :context]
            layers, logits, seconds = prefill(verifier, prompt)
            print(f"[{context} {name}] verifier prefill {seconds:.1f}s", flush=True)
            refs = {}
            for kind in {"int8" if c == "int4" else "full" for c in todo}:
                cache = DynamicCache() if kind == "full" else HierarchicalQuantCache()
                for i, (k, v) in enumerate(layers):
                    cache.update(k.clone(), v.clone(), i)
                tokens, gaps, ar_seconds = greedy_reference(verifier, cache, context, logits, args.new_tokens, eos)
                refs[kind] = (tokens, gaps)
                data["references"].append({"context": context, "doc": name, "kind": kind, "tokens": tokens,
                                           "min_top2_gap": min(gaps), "prefill_seconds": seconds,
                                           "decode_seconds": ar_seconds})
                print(f"[{context} {name}] AR {kind}: {ar_seconds:.1f}s, min top-2 gap {min(gaps):.3g}", flush=True)
            proxy = PrefilledVerifier(verifier, prompt, layers, logits)
            for cell in todo:
                tokens, gaps = refs["int8" if cell == "int4" else "full"]
                spec = _spec_kwargs(cell, proxy, drafter, args.gamma)
                t0 = time.perf_counter()
                record = {"context": context, "doc": name, "method": cell, "gamma": args.gamma}
                try:
                    with torch.no_grad():
                        out = speculative_generate(proxy, prompt, max_new_tokens=args.new_tokens, do_sample=False,
                                                   num_assistant_tokens=args.gamma, return_dict_in_generate=True, **spec)
                    got = out.sequences[0, context:].tolist()
                    stats = out.spec_stats
                    record.update(
                        alpha=stats["acceptance_rate"], tau=stats["mean_accepted_length"], rounds=stats["rounds"],
                        drafted=stats["drafted"], accepted=stats["accepted"], new_tokens=stats["new_tokens"],
                        drafter_prefill_seconds=stats["prefill_seconds"], draft_seconds=stats["draft_seconds"],
                        verify_seconds=stats["verify_seconds"], seconds=time.perf_counter() - t0,
                        identical=got == tokens, mismatch=_mismatch(got, tokens, gaps),
                    )
                except Exception as e:  # recorded; the rest of the grid still runs
                    record.update(error=f"{type(e).__name__}: {e}")
                data["cells"].append(record)
                _save(path, data)
                print(f"[{context} {name}] {cell}: " + (record.get("error") or
                      f"alpha={record['alpha']:.3f} tau={record['tau']:.2f} identical={record['identical']} "
                      f"({record['seconds']:.0f}s)"), flush=True)
            del layers, refs, proxy
    _save(path, data)
    return data


def table(data: dict) -> str:
    """Markdown: α and τ per method and context, averaged over documents (α pooled: accepted / drafted)."""
    from collections import defaultdict

    groups = defaultdict(list)
    for c in data["cells"]:
        if "error" not in c:
            groups[(c["method"], c["context"])].append(c)
    contexts = sorted({k[1] for k in groups})
    methods = sorted({k[0] for k in groups}, key=lambda m: (METHOD_ORDER.index(m.split("-")[0]), len(m), m))
    lines = ["| method | " + " | ".join(f"{c // 1024}K α | {c // 1024}K τ" for c in contexts) + " | identical |",
             "| --- |" + " --- | --- |" * len(contexts) + " --- |"]
    for m in methods:
        row, ident = [], []
        for c in contexts:
            g = groups.get((m, c), [])
            if g:
                alpha = sum(x["accepted"] for x in g) / max(sum(x["drafted"] for x in g), 1)
                tau = sum(x["new_tokens"] - 1 for x in g) / max(sum(x["rounds"] for x in g), 1)
                row += [f"{alpha:.3f}", f"{tau:.2f}"]
                ident += [x["identical"] for x in g]
            else:
                row += ["", ""]
        lines.append(f"| {m} | " + " | ".join(row) + f" | {sum(ident)}/{len(ident)} |")
    return "\n".join(lines)
