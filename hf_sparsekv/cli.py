"""``hf-sparsekv`` command line: ``generate`` (speculative vs AR on one prompt), ``demo`` and ``train-drafter``
(BudgetDraft training, see :mod:`hf_sparsekv.training.run`)."""

from __future__ import annotations

import argparse
import sys

import torch

from . import HierarchicalQuantCache  # importing the package also wires generate()
from .generation.stats import SyncedTimer


def _timed_generate(model, ids, **kwargs):
    with SyncedTimer(ids.device) as clock:
        out = model.generate(ids, do_sample=False, **kwargs)
    return out, clock.seconds


def greedy_reference(verifier, ids, max_new_tokens: int, mode="full"):
    """``(sequences, seconds)`` of plain greedy AR; for ``mode == "int4"`` on the INT8 view the self-speculation verifies."""
    cache = {"past_key_values": HierarchicalQuantCache()} if mode == "int4" else {}
    return _timed_generate(verifier, ids, max_new_tokens=max_new_tokens, **cache)


def compare(verifier, drafter, ids, mode, budget: int | None, gamma: int, max_new_tokens: int, reference=None) -> dict:
    """Run speculative generation on ``ids`` and check it against greedy AR; return the figures.

    ``mode`` is a ``draft_cache`` value of ``generate()``: "chunk", "window", "full", "int4" (self-speculative) or a
    cache instance for the drafter. ``reference`` is a :func:`greedy_reference` result to reuse (same ids, length).
    """
    spec_args = {"assistant_model": drafter, "num_assistant_tokens": gamma}
    if mode == "int4":
        spec_args.update(assistant_model=verifier, draft_cache="int4")
    else:
        spec_args.update(draft_cache=mode, kv_budget=budget)
    sequences, ar_seconds = reference or greedy_reference(verifier, ids, max_new_tokens, mode)
    out, spec_seconds = _timed_generate(
        verifier, ids, max_new_tokens=max_new_tokens, return_dict_in_generate=True, **spec_args
    )
    return {
        "identical_to_ar": bool(torch.equal(out.sequences, sequences)),
        "sequences": out.sequences,
        "ar_seconds": ar_seconds,
        "spec_seconds": spec_seconds,
        "speedup": ar_seconds / spec_seconds,
        **out.spec_stats.to_dict(),
    }


def report(name: str, result: dict, tokenizer=None, prompt_length: int = 0) -> None:
    print(f"== {name}")
    if tokenizer is not None:
        print(tokenizer.decode(result["sequences"][0, prompt_length:]))
    print(
        f"identical to greedy AR: {result['identical_to_ar']} | acceptance {result['acceptance_rate']:.3f} | "
        f"tau {result['mean_accepted_length']:.2f} | AR {result['ar_seconds']:.2f}s, speculative "
        f"{result['spec_seconds']:.2f}s, speedup {result['speedup']:.2f}x"
    )


def _load(name: str, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(name, dtype=getattr(torch, dtype)).to(device).eval()


def _cmd_generate(args) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.verifier)
    verifier = _load(args.verifier, args.device, args.dtype)
    drafter = verifier if args.mode == "int4" else _load(args.drafter, args.device, args.dtype)
    text = open(args.prompt_file).read() if args.prompt_file else args.prompt
    ids = tokenizer(text, return_tensors="pt").input_ids.to(args.device)
    result = compare(verifier, drafter, ids, args.mode, args.budget, args.gamma, args.max_new_tokens)
    report(f"{args.mode} (budget {args.budget}, gamma {args.gamma})", result, tokenizer, ids.shape[1])
    return 0 if result["identical_to_ar"] else 1


def _cmd_demo(args) -> int:
    from .demo import main as demo_main

    return demo_main()


def _cmd_train_drafter(args) -> int:
    from .training.run import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-sparsekv")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="speculative vs greedy AR generation on one prompt")
    gen.add_argument("--verifier", required=True, help="path or Hub id of the verifier")
    gen.add_argument("--drafter", help="path or Hub id of the drafter (same tokenizer); not needed for --mode int4")
    gen.add_argument("--mode", default="chunk", choices=["chunk", "window", "int4", "full"])
    gen.add_argument("--budget", type=int, default=256, help="drafter KV budget (chunk/window)")
    gen.add_argument("--gamma", type=int, default=5, help="draft tokens per round")
    gen.add_argument("--prompt", default="def fibonacci(n):")
    gen.add_argument("--prompt-file")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    gen.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    gen.set_defaults(func=_cmd_generate)
    demo = sub.add_parser("demo", help="speculative generation with the bundled pair on a held-out document")
    demo.set_defaults(func=_cmd_demo)
    from .training.run import add_arguments as add_training_arguments

    train = sub.add_parser("train-drafter", help="BudgetDraft multi-view sparse training of a drafter")
    add_training_arguments(train)
    train.set_defaults(func=_cmd_train_drafter)
    args = parser.parse_args(argv)
    if args.command == "generate" and args.mode != "int4" and not args.drafter:
        parser.error("--drafter is required unless --mode int4")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
