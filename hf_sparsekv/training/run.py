"""``hf-sparsekv train-drafter``: arguments, model/data loading, training, final save, model card, Hub push (one
that fails exits with status 1 after saying how to push the saved drafter later: ``hf-sparsekv push-drafter``).

Single GPU: ``hf-sparsekv train-drafter ...``; several: ``accelerate launch -m hf_sparsekv.cli train-drafter ...``
(DDP, same arguments; each process takes every n-th sequence).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from ..caches.chunk_selection import METHODS
from .config import LOSSES, TrainingConfig

PAPER = TrainingConfig()
BUDGETDRAFT_NOTATION = """\
The letters below are the notation of the BudgetDraft paper (He et al., "BudgetDraft: Acceptance-Aware
Multi-View Training for Sparse-KV Speculative Decoding", arXiv:2606.00144); the defaults are its §3.5's:
T the training sequence length and C its continuation (the prompt is P = T - C); B the sparse branch's KV
budgets and w their sampling weights; s the chunk size; L = L_A + λ·L_C the loss, L_A acceptance-aware on
the full cache, L_C multi-view on the sparse caches."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("models and data")
    g.add_argument("--verifier", required=True, help="path or Hub id of the frozen verifier")
    g.add_argument("--tokenizer", help="path or Hub id of the shared tokenizer (default: the verifier's)")
    g.add_argument("--drafter", required=True, help="path or Hub id of the drafter to train (same vocabulary)")
    g.add_argument("--data", required=True,
                   help="'python-source', a datasets Hub id (streamed, e.g. pg19) or local .txt/.jsonl/.json/.parquet files or a folder")
    g.add_argument("--data-split", default="train", help="split of --data to train on")
    g.add_argument("--text-field", default="text", help="text column of a dataset / json records")
    g.add_argument("--eval-data", help="held-out data; unset: --data (for local files that is the training data itself, "
                   "which the log and the model card then say)")
    g.add_argument("--eval-split", help="held-out split of --eval-data; unset: 'eval' for python-source, else 'validation'")
    g.add_argument("--output", required=True, help="output folder: checkpoints, metrics.jsonl, the final drafter")
    g.add_argument("--verifier-dtype", default="bfloat16" if torch.cuda.is_available() else "float32",
                   help="verifier weights (frozen; the default depends on whether CUDA is available)")
    g.add_argument("--drafter-dtype", default="float32", help="drafter weights (trained; paper: float32)")

    t = parser.add_argument_group("BudgetDraft", BUDGETDRAFT_NOTATION)
    t.add_argument("--seq-len", type=int, default=PAPER.seq_len, help="T")
    t.add_argument("--continuation-len", type=int, default=PAPER.continuation_len, help="C (P = T - C)")
    t.add_argument("--prefill-chunk", type=int, default=PAPER.prefill_chunk, help="tokens per chunked-prefill forward")
    t.add_argument("--budgets", type=int, nargs="+", default=PAPER.budgets, help="sparse-branch KV budgets B")
    t.add_argument("--budget-weights", type=float, nargs="+", help="Cat weights w; unset: the paper's 0.4 0.3 0.2 0.1 for the "
                   "paper's budgets, else uniform")
    t.add_argument("--chunk-size", type=int, default=PAPER.chunk_size, help="s")
    t.add_argument("--lam", type=float, default=PAPER.lam, help="λ in L = L_A + λ·L_C")
    t.add_argument("--loss", choices=LOSSES, default=PAPER.loss, help="'la-only': the L_A ablation (Table 3)")
    t.add_argument("--per-kv-head", action="store_true", help="select chunks per KV head (as ChunkBudgetCache(per_kv_head=True))")
    t.add_argument("--selection", choices=METHODS, default=PAPER.selection,
                   help="sparse views' chunk selection (as ChunkBudgetCache(selection=...)); 'cumulative' is the paper's")
    t.add_argument("--lr", type=float, default=PAPER.lr, help="AdamW learning rate")
    t.add_argument("--weight-decay", type=float, default=PAPER.weight_decay, help="AdamW weight decay")
    t.add_argument("--warmup-steps", type=int, default=PAPER.warmup_steps, help="linear warm-up, then cosine decay")
    t.add_argument("--max-steps", type=int, default=PAPER.max_steps, help="optimizer steps")
    t.add_argument("--clip-norm", type=float, default=PAPER.clip_norm, help="gradient clipping (global norm)")
    t.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=torch.cuda.is_available(),
                   help="bf16 autocast (the default is on when CUDA is available)")
    t.add_argument("--gradient-checkpointing", action="store_true", help="trade compute for activation memory")
    t.add_argument("--seed", type=int, default=0, help="data order, budget draws and initialisation")

    e = parser.add_argument_group("held-out acceptance, checkpoints, Hub")
    e.add_argument("--eval-every", type=int, default=500, help="steps between evaluations (0: start and end only)")
    e.add_argument("--no-eval", action="store_true", help="no held-out acceptance at all")
    e.add_argument("--eval-contexts", type=int, nargs="+", help="prompt lengths; unset: 8192 16384 capped at --seq-len")
    e.add_argument("--eval-budgets", type=int, nargs="+", default=[256, 512, 1024, 2048], help="kv_budget values evaluated")
    e.add_argument("--eval-samples", type=int, default=4, help="held-out prompts")
    e.add_argument("--eval-new-tokens", type=int, default=64, help="tokens generated per held-out prompt")
    e.add_argument("--gamma", type=int, default=5, help="draft tokens per round in the evaluation")
    e.add_argument("--save-every", type=int, default=500, help="steps between checkpoints (0: end only)")
    e.add_argument("--resume-from", help="a checkpoint-<step> folder, or 'latest' (the newest one in --output)")
    e.add_argument("--push-to-hub", metavar="REPO", help="push the trained drafter and its model card to this repo")
    e.add_argument("--hub-private", action="store_true", help="create the Hub repo private")
    e.add_argument("--hub-endpoint", help="another Hub-compatible server; unset: HF_ENDPOINT / huggingface.co")
    e.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def config_from_args(args) -> TrainingConfig:
    weights = args.budget_weights
    if weights is None:
        weights = PAPER.budget_weights if list(args.budgets) == PAPER.budgets else [1.0] * len(args.budgets)
    return TrainingConfig(
        seq_len=args.seq_len, continuation_len=args.continuation_len, prefill_chunk=args.prefill_chunk,
        budgets=list(args.budgets), budget_weights=list(weights), chunk_size=args.chunk_size,
        per_kv_head=args.per_kv_head, selection=args.selection, lam=args.lam, loss=args.loss, lr=args.lr, weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps, max_steps=args.max_steps, clip_norm=args.clip_norm, bf16=args.bf16,
        gradient_checkpointing=args.gradient_checkpointing, seed=args.seed,
    )


def check_arguments(args, parser: argparse.ArgumentParser) -> None:
    """Refuse, through ``parser.error`` and before any model loads: a configuration :class:`TrainingConfig` rejects,
    a missing local model path, a tokenizer folder without a tokenizer, and an ``--output`` that already holds a run
    unless ``--resume-from`` continues it (a fresh run there would overwrite its checkpoints and append to its
    metrics)."""
    from ..model_paths import refuse_folder_without_tokenizer, refuse_missing_model_paths
    from .checkpoint import latest_checkpoint

    try:
        config_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    refuse_missing_model_paths(args, parser)
    refuse_folder_without_tokenizer(args, parser)
    output = Path(args.output)
    if not args.resume_from and (latest_checkpoint(output) is not None or (output / "metrics.jsonl").exists()):
        parser.error(f"--output {output} already holds a training run: pass --resume-from latest to continue it, "
                     "or choose another --output")


def _eval_split(args) -> str:
    if args.eval_split:
        return args.eval_split
    from ..data import PYTHON_SOURCE

    return "eval" if (args.eval_data or args.data) == PYTHON_SOURCE else "validation"


def run(args) -> int:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..data import documents, token_sequences
    from . import checkpoint as ckpt
    from .hub import push_saved, render_model_card
    from .trainer import BudgetDraftTrainer, EvalSettings

    config = config_from_args(args)
    accelerator = Accelerator()
    say = accelerator.print
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.verifier)
    verifier = AutoModelForCausalLM.from_pretrained(args.verifier, dtype=getattr(torch, args.verifier_dtype))
    drafter = AutoModelForCausalLM.from_pretrained(args.drafter, dtype=getattr(torch, args.drafter_dtype))
    trainer = BudgetDraftTrainer(verifier, drafter, config, accelerator=accelerator, tokenizer=tokenizer)

    output = Path(args.output)
    if args.resume_from:
        path = ckpt.latest_checkpoint(output) if args.resume_from == "latest" else Path(args.resume_from)
        if path is None:
            raise SystemExit(f"--resume-from latest: no complete checkpoint-<step> folder in {output}")
        trainer.load_checkpoint(path)
        say(f"resumed from {path} at step {trainer.step}")

    eval_settings = None
    eval_info = None
    if not args.no_eval:
        contexts = args.eval_contexts or sorted({min(c, config.seq_len) for c in (8192, 16384)})
        eval_source = args.eval_data or args.data
        split = _eval_split(args)
        # Local files are served under any split name, so without --eval-data they are the training documents.
        held_out = not (args.eval_data is None and (Path(args.data).exists() or split == args.data_split))
        if not held_out:
            say(f"warning: there is no held-out data: acceptance is measured on training documents ({eval_source}, "
                f"split {split}); pass --eval-data for a held-out measurement (the model card says so too)")
        texts = documents(eval_source, split=split, text_field=args.text_field)
        prompts = list(itertools.islice(token_sequences(texts, tokenizer, max(contexts)), args.eval_samples))
        if not prompts:
            raise SystemExit(f"no held-out prompt of {max(contexts)} tokens in {eval_source} (split {split})")
        eval_settings = EvalSettings(prompts, contexts, list(args.eval_budgets), gamma=args.gamma,
                                     max_new_tokens=args.eval_new_tokens, every=args.eval_every)
        eval_info = {"gamma": args.gamma, "max_new_tokens": args.eval_new_tokens, "samples": len(prompts),
                     "data": f"{eval_source} (split {split})", "held_out": held_out}

    texts = documents(args.data, split=args.data_split, text_field=args.text_field)
    sequences = token_sequences(texts, tokenizer, config.seq_len)
    history = trainer.train(sequences, output_dir=output, eval_settings=eval_settings, save_every=args.save_every,
                            progress=not args.no_progress)

    pushed = True
    if accelerator.is_main_process:
        ckpt.save_model_folder(trainer.model, output, tokenizer)
        summary = {"step": trainer.step, "config": config.to_dict(), "verifier": args.verifier,
                   "drafter_base": args.drafter, "data": f"{args.data} (split {args.data_split})",
                   "eval": history["eval"], "eval_info": eval_info}
        (output / "training_summary.json").write_text(json.dumps(summary, indent=2, default=str))
        repo_id = args.push_to_hub or str(output)  # what from_pretrained() loads in the card's "Use" snippet
        is_hub_id = "/" in args.data and not Path(args.data).exists()
        card = render_model_card(
            repo_id=repo_id, verifier_id=args.verifier, drafter_base=args.drafter,
            data=summary["data"], config=config, steps=trainer.step, evals=history["eval"], eval_info=eval_info,
            processes=accelerator.num_processes, dataset_ids=[args.data] if is_hub_id else None,
        )
        card.save(output / "README.md")
        say(f"saved the drafter and its card to {output}")
        if args.push_to_hub:  # a failed push leaves the saved drafter and says how to push it later
            pushed = push_saved(output, args.push_to_hub, private=args.hub_private or None,
                                endpoint=args.hub_endpoint, say=say)
    trainer.end_training()
    return 0 if pushed else 1
