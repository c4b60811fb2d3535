"""The draft-length controller on CPU against every constant γ and plain greedy decoding, idle or loaded.

A tiny random Llama (2 layers, hidden 64, float64: the tests' ``tiny_model``), greedy, ``--new-tokens`` new tokens:

* ``retrieval``: a prompt of a 23-token motif repeated ``--repeats-of-motif`` times, prompt lookup
  (``prompt_lookup_num_tokens=8``): once the model's own continuation repeats, every draft is accepted;
* ``useless``: a separate random drafter (1 layer) on a full cache, whose drafts the verifier almost never accepts.

Per case: plain ``generate()``, each constant γ in ``--gammas`` (prompt lookup: ``prompt_lookup_num_tokens=γ``;
the drafter: ``num_assistant_tokens=γ``; both with the constant schedule) and the controller (no schedule, at most 8),
the median seconds per call over ``--repeats`` after ``--warmup`` calls of each. A model keeps an engine per
configuration, so in either order each method's engine and what the controller learnt (kept by the engine) persist
from call to call; only the sequence an engine holds is forgotten before each call (``forget_sequences``), so that
every call prefills its whole prompt, as a call on a new prompt does. ``--order interleaved`` (default): one call of
each method per repeat. ``--order grouped``: each method's calls in a row, as in a user's loop; a block of plain calls
runs before each method's block and after the last, and each method is set against the plain blocks on either side
of it (a process slows as its kept engines and objects grow).
``--load N`` starts N busy processes (``while 1: pass``) for the measurement and kills them after. Every output is checked against stock greedy. Prints a table and writes
``controller_cpu_load<N>[_grouped].json`` and the table as ``.txt`` under ``--out``.

    python benchmarks/controller_cpu.py --out runs/controller-cpu --load 0
    python benchmarks/controller_cpu.py --out runs/controller-cpu --load 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

import hf_sparsekv
from hf_sparsekv.generation.engine import forget_sequences

VOCAB = 96


def tiny_llama(layers: int, hidden: int, seed: int) -> LlamaForCausalLM:
    """A random Llama of ``layers`` layers, as the tests build it (float64, spread logits)."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4 if hidden >= 64 else 2, num_key_value_heads=2 if hidden >= 64 else 1,
                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval().to(torch.float64)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def cases(verifier, drafter, motif_repeats: int, gammas: list[int]) -> dict:
    """case -> (prompt [1, P], {method: generate() keyword arguments}); method "plain" has none."""
    g = torch.Generator().manual_seed(0)
    motif = torch.randint(3, VOCAB, (1, 23), generator=g)
    random_prompt = torch.randint(3, VOCAB, (1, 23 * motif_repeats), generator=g)
    constant = dict(num_assistant_tokens_schedule="constant")  # (a constant γ; the controller: no schedule given)
    lookup = {"plain": {}, **{f"gamma {k}": dict(prompt_lookup_num_tokens=k, **constant) for k in gammas},
              "controller": dict(prompt_lookup_num_tokens=8)}
    model = {"plain": {}, **{f"gamma {k}": dict(assistant_model=drafter, draft_cache="full", num_assistant_tokens=k)
                             for k in gammas},
             "controller": dict(assistant_model=drafter, draft_cache="full")}  # (at most 8 drafts a round)
    return {"retrieval": (motif.repeat(1, motif_repeats), lookup), "useless": (random_prompt, model)}


def busy(n: int) -> list[subprocess.Popen]:
    """``n`` processes spinning on a core each."""
    return [subprocess.Popen([sys.executable, "-c", "while 1: pass"], start_new_session=True) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def measure(verifier, ids: torch.Tensor, methods: dict, new_tokens: int, repeats: int, warmup: int,
            grouped: bool = False) -> dict:
    """Each method's seconds per call after the warm-up calls, its first call's seconds (with the process's one-time
    costs), its last call's width_rounds, and whether its
    output was stock greedy's every time. ``grouped``: each method's calls in a row (else one of each in turn), a
    block of plain calls before each and after the last; each method's ``plain_adjacent_s``: the median plain call of
    the blocks on either side of it."""
    greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)
    reference = verifier.generate(ids, **greedy).sequences
    seconds, first = {m: [] for m in methods}, {}
    widths, identical = {}, {m: True for m in methods}
    if grouped:
        order = [b for m in methods if m != "plain" for b in ("plain", m)] + ["plain"]
        calls = [(r, m, block) for block, m in enumerate(order) for r in range(warmup + repeats)]
    else:
        calls = [(r, m, 0) for r in range(warmup + repeats) for m in methods]
    blocks: dict[int, list[float]] = {}  # grouped: block index -> its plain calls' seconds
    for repeat, method, block in tqdm(calls, desc="calls", leave=False):
        kwargs = methods[method]
        forget_sequences(verifier)  # a repeat prefills its whole prompt, as HF's static cache does
        start = time.perf_counter()
        out = verifier.generate(ids, **greedy, **kwargs)
        elapsed = time.perf_counter() - start
        identical[method] &= torch.equal(out.sequences, reference)
        if repeat >= warmup:
            seconds[method].append(elapsed)
            if method == "plain":
                blocks.setdefault(block, []).append(elapsed)
        else:
            first.setdefault(method, elapsed)
        stats = getattr(out, "spec_stats", None)
        if stats is not None:
            widths[method] = {int(k): v for k, v in sorted(stats.width_rounds.items())}
    results = {m: {"median_s": statistics.median(s), "seconds": s, "first_call_s": first.get(m),
                   "width_rounds": widths.get(m), "identical": identical[m]} for m, s in seconds.items()}
    if grouped:
        for block, m in enumerate(order):
            if m != "plain":
                results[m]["plain_adjacent_s"] = statistics.median(blocks[block - 1] + blocks[block + 1])
    return results


def table(results: dict, load: int) -> str:
    lines = [f"load: {load} busy processes; seconds per call (median), speed against plain of the same run (grouped: "
             "the plain blocks beside the method's); the first (warm-up) call apart",
             "| case | method | s | × plain | × best γ | first call s | widths of the last call | identical |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for case, rows in results.items():
        best = min(r["median_s"] for m, r in rows.items() if m.startswith("gamma"))
        for method, row in rows.items():
            s = row["median_s"]
            plain = row.get("plain_adjacent_s", rows["plain"]["median_s"])
            first = "-" if row["first_call_s"] is None else f"{row['first_call_s']:.3f}"
            lines.append(f"| {case} | {method} | {s:.3f} | {plain / s:.2f} | {best / s:.2f} | {first} | "
                         f"{row['width_rounds'] or '-'} | {row['identical']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats-of-motif", type=int, default=8)
    p.add_argument("--gammas", default="1,2,3,4,6,8")
    p.add_argument("--load", type=int, default=0, help="busy processes during the measurement")
    p.add_argument("--cases", default="retrieval,useless")
    p.add_argument("--order", choices=("interleaved", "grouped"), default="interleaved")
    p.add_argument("--out", default="runs/controller-cpu")
    args = p.parse_args()
    verifier, drafter = tiny_llama(2, 64, 0), tiny_llama(1, 32, 7)
    chosen = {k: v for k, v in cases(verifier, drafter, args.repeats_of_motif, [int(g) for g in args.gammas.split(",")])
              .items() if k in args.cases.split(",")}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # (killed: the busy processes are stopped too)
    load_before = os.getloadavg()
    procs = busy(args.load)
    try:
        with torch.no_grad():
            results = {case: measure(verifier, ids, methods, args.new_tokens, args.repeats, args.warmup,
                                     args.order == "grouped")
                       for case, (ids, methods) in tqdm(chosen.items(), desc="cases")}
    finally:
        stop(procs)
    text = f"order: {args.order}\n" + table(results, args.load)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tree = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()
    record = {"date": time.strftime("%Y-%m-%d"), "commit": os.environ.get("GIT_COMMIT") or tree or "unknown",
              "settings": vars(args), "threads": torch.get_num_threads(), "package": hf_sparsekv.__file__,
              "torch": torch.__version__, "cpus": os.cpu_count(), "loadavg_before": load_before,
              "loadavg_after": os.getloadavg(), "results": results}
    name = f"controller_cpu_load{args.load}" + ("_grouped" if args.order == "grouped" else "")
    (out / f"{name}.json").write_text(json.dumps(record, indent=1))
    (out / f"{name}.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
