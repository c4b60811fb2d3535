"""BudgetDraft on the bundled pair: train the drafter (BudgetDraft, L_A only, single budget) against the bundled
verifier within a time budget, then measure held-out acceptance per context × budget (BudgetDraft Tables 1, 3, 7
in our setting). Prints a markdown table and writes JSON.

    python benchmarks/budgetdraft.py all --minutes 4 --out runs/budgetdraft      # train the 3 variants + evaluate
    python benchmarks/budgetdraft.py all --steps 650 --drafter shipped=hf_sparsekv/zoo/pair/drafter-budgetdraft
    python benchmarks/budgetdraft.py eval --drafter NAME=DIR ... --out runs/budgetdraft   # evaluate only

Training runs ``hf-sparsekv train-drafter`` (one process per variant, in parallel on one GPU). The number of steps
is fixed up front from a timed probe so that each run finishes its warm-up + cosine schedule inside the budget.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from hf_sparsekv.zoo import PAIR_DIR, eval_documents, load_pair

VARIANTS = {
    "budgetdraft": [],
    "la-only": ["--loss", "la-only"],
    "single-1024": ["--budgets", "1024", "--budget-weights", "1"],
    "budgetdraft-cumulative": ["--selection", "cumulative"],  # sparse views by the paper's score (the old default)
}
DEFAULT_VARIANTS = ["budgetdraft", "la-only", "single-1024"]


def _models(work: Path) -> tuple[Path, Path]:
    """Model folders with the pair's tokenizer beside the weights (what ``train-drafter`` loads)."""
    out = {}
    for name in ("verifier", "drafter"):
        target = work / f"pair-{name}"
        if not target.exists():
            shutil.copytree(PAIR_DIR / name, target)
            for f in (PAIR_DIR / "tokenizer").iterdir():
                shutil.copy(f, target / f.name)
        out[name] = target
    return out["verifier"], out["drafter"]


def _common(args, verifier: Path, drafter: Path) -> list[str]:
    return [sys.executable, "-m", "hf_sparsekv.cli", "train-drafter", "--verifier", str(verifier), "--drafter",
            str(drafter), "--data", "python-source", "--seq-len", str(args.seq_len), "--continuation-len", "256",
            "--lr", str(args.lr), "--warmup-steps", str(args.warmup), "--no-eval", "--save-every", "0",
            "--no-progress", "--seed", "0"]


def probe_seconds_per_step(args, verifier: Path, drafter: Path, work: Path) -> float:
    """Seconds per step of one run alone (steps after the first two, which include start-up)."""
    out = work / "probe"
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(_common(args, verifier, drafter) + ["--max-steps", "8", "--output", str(out)], check=True,
                   stdout=subprocess.DEVNULL)
    times = [json.loads(line)["time"] for line in (out / "metrics.jsonl").open() if '"event": "step"' in line]
    return (times[-1] - times[1]) / (len(times) - 2)


def train(args, work: Path) -> dict[str, Path]:
    verifier, drafter = _models(work)
    if args.steps:
        per_step, steps = None, args.steps
    else:
        per_step = probe_seconds_per_step(args, verifier, drafter, work)
        steps = max(10, int(args.minutes * 60 / (per_step * len(args.variants))))  # the parallel runs share the GPU
        print(f"probe: {per_step:.3f} s/step alone -> {steps} steps per variant ({len(args.variants)} in parallel)")
    procs = {}
    for name in args.variants:
        flags = VARIANTS[name]
        log = (work / f"{name}.log").open("w")
        cmd = _common(args, verifier, drafter) + flags + ["--max-steps", str(steps), "--output", str(work / name)]
        procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    start = time.perf_counter()
    for name, proc in procs.items():
        if proc.wait() != 0:
            raise SystemExit(f"{name} failed; see {work / (name + '.log')}")
    print(f"trained {len(procs)} variants x {steps} steps in {time.perf_counter() - start:.0f} s")
    (work / "train.json").write_text(json.dumps({"steps": steps, "probe_seconds_per_step": per_step,
                                                 "seconds": time.perf_counter() - start, "lr": args.lr,
                                                 "seq_len": args.seq_len}, indent=2))
    return {"untrained": PAIR_DIR / "drafter", **{n: work / n for n in args.variants}}


def evaluate_one(name: str, path: Path, args) -> dict:
    from transformers import LlamaForCausalLM

    from hf_sparsekv.training import measure_acceptance

    device = "cuda" if torch.cuda.is_available() else "cpu"
    verifier, _, _ = load_pair(device=device)
    drafter = LlamaForCausalLM.from_pretrained(path, dtype=verifier.dtype).to(device).eval()
    prompts = eval_documents()[: args.prompts]
    result = measure_acceptance(verifier, drafter, prompts, args.contexts, args.budgets, gamma=args.gamma,
                                max_new_tokens=args.new_tokens)
    return {str(c): {str(b): cell["acceptance_rate"] for b, cell in row.items()} for c, row in result.items()}


def table(results: dict, budgets) -> str:
    lines = ["| drafter | context | " + " | ".join(f"B={b}" for b in budgets) + " | spread (max-min) |",
             "|---|---|" + "---|" * (len(budgets) + 1)]
    for name, rows in results.items():
        for context, row in rows.items():
            values = [row[str(b)] for b in budgets]
            lines.append(f"| {name} | {int(context) // 1024}K | " + " | ".join(f"{v:.3f}" for v in values)
                         + f" | {max(values) - min(values):.3f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("all", "eval", "eval-one"))
    p.add_argument("--out", type=Path, default=Path("runs/budgetdraft"))
    p.add_argument("--minutes", type=float, default=4.0, help="training time budget for the parallel variants")
    p.add_argument("--steps", type=int, help="steps per variant (instead of probing for --minutes)")
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS),
                   help="drafters to train (in parallel); budgetdraft-cumulative: sparse views by the paper's score")
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--drafter", nargs="*", default=[], help="NAME=DIR drafters to evaluate (with all: beside the new ones)")
    p.add_argument("--prompts", type=int, default=4, help="held-out documents of the pair")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "eval-one":
        name, path = args.drafter[0].split("=", 1)
        (args.out / f"acceptance-{name}.json").write_text(json.dumps(evaluate_one(name, Path(path), args)))
        return
    given = {n: Path(d) for n, d in (x.split("=", 1) for x in args.drafter)}
    drafters = {**train(args, args.out), **given} if args.what == "all" else given
    procs = [subprocess.Popen([sys.executable, __file__, "eval-one", "--drafter", f"{n}={d}", "--out", str(args.out),
                               "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens),
                               "--gamma", str(args.gamma), "--contexts", *map(str, args.contexts),
                               "--budgets", *map(str, args.budgets)]) for n, d in drafters.items()]
    if any(proc.wait() for proc in procs):
        raise SystemExit("an evaluation failed")
    results = {n: json.loads((args.out / f"acceptance-{n}.json").read_text()) for n in drafters}
    settings = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "prompts": args.prompts, "new_tokens": args.new_tokens, "gamma": args.gamma,
                "contexts": args.contexts, "budgets": args.budgets}
    (args.out / "acceptance.json").write_text(json.dumps({"settings": settings, "acceptance": results}, indent=2))
    print(table(results, args.budgets))


if __name__ == "__main__":
    main()
