"""``make zoo``: build the bundled pair from scratch on one GPU, in resumable stages.

    python -m hf_sparsekv.zoo.build data      --work runs/zoo   # corpus, tokenizer, token streams, eval set
    python -m hf_sparsekv.zoo.build train     --work runs/zoo --model verifier --minutes 5
    python -m hf_sparsekv.zoo.build train     --work runs/zoo --model drafter  --minutes 4
    python -m hf_sparsekv.zoo.build export    --work runs/zoo [--to hf_sparsekv/zoo/pair]
    python -m hf_sparsekv.zoo.build quality   [--pair hf_sparsekv/zoo/pair] --out quality.json

Each stage skips work already done in ``--work`` (``train`` resumes from its checkpoint), so a stage cut off by a
time limit is finished by running it again.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from . import PAIR_DIR, eval_documents, load_pair
from .configs import VOCAB_SIZE, drafter_config, verifier_config
from .pretrain import Phase, PretrainConfig, pretrain
from .quality import position_metrics
from .tokenizer import encode_documents, train_tokenizer

EVAL_DOCS = 50
EVAL_DOC_TOKENS = 16384
TOKENIZER_SAMPLE_EVERY = 8  # train the tokenizer on every 8th train document
SHARD = "15MB"

# Verifier: 4K windows for 80% of the run, then 16K; drafter: 2K windows throughout (its native length).
RECIPES = {
    "verifier": dict(config=verifier_config, phases=[Phase(0.8, 4096, 16), Phase(1.0, 16384, 4)], lr=2e-3),
    "drafter": dict(config=drafter_config, phases=[Phase(1.0, 2048, 32)], lr=3e-3),
}


def _joined(docs: list[np.ndarray], eos: int) -> np.ndarray:
    out = np.empty(sum(len(d) + 1 for d in docs), dtype=np.uint16)
    i = 0
    for d in docs:
        out[i : i + len(d)] = d
        out[i + len(d)] = eos
        i += len(d) + 1
    return out


def stage_data(work: Path, vocab_size: int, roots: list[str] | None, eval_fraction: float = 0.1) -> None:
    from ..data import python_source_documents

    if (work / "train.npy").exists():
        print("data: already built")
        return
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train_texts = [d.text for d in python_source_documents("train", roots=roots, eval_fraction=eval_fraction)]
    eval_texts = [d.text for d in python_source_documents("eval", roots=roots, eval_fraction=eval_fraction)]
    if not train_texts or not eval_texts:
        raise ValueError(f"the corpus split has {len(train_texts)} train and {len(eval_texts)} eval documents; "
                         "give more source roots or another --eval-fraction")
    print(f"corpus: {len(train_texts)} train / {len(eval_texts)} eval documents, "
          f"{sum(map(len, train_texts)) / 1e6:.1f} / {sum(map(len, eval_texts)) / 1e6:.1f} M chars")
    tokenizer = train_tokenizer(train_texts[::TOKENIZER_SAMPLE_EVERY], vocab_size)
    tokenizer.save_pretrained(work / "tokenizer")
    train = encode_documents(tokenizer, train_texts)
    evals = encode_documents(tokenizer, eval_texts)
    eos = tokenizer.eos_token_id
    np.save(work / "train.npy", _joined(train, eos))
    np.save(work / "eval.npy", _joined(evals, eos))
    long_docs = [d[:EVAL_DOC_TOKENS] for d in evals if len(d) >= EVAL_DOC_TOKENS][:EVAL_DOCS]
    save_file({f"doc_{i:03d}": torch.from_numpy(d.astype(np.int16)) for i, d in enumerate(long_docs)},
              work / "eval_documents.safetensors")
    lengths = [len(d) for d in train + evals]
    stats = {"train_documents": len(train), "eval_documents": len(evals), "train_tokens": int(sum(map(len, train))),
             "eval_tokens": int(sum(map(len, evals))), "eval_set_documents": len(long_docs),
             "eval_set_tokens_each": EVAL_DOC_TOKENS, "median_document_tokens": int(np.median(lengths)),
             "documents_over_16K_tokens": int(sum(n >= 16384 for n in lengths)),
             "chars_per_token": sum(map(len, train_texts)) / max(1, sum(map(len, train))),
             "vocab_size": len(tokenizer), "seconds": round(time.perf_counter() - t0, 1)}
    (work / "data.json").write_text(json.dumps(stats, indent=2))
    print(json.dumps(stats, indent=2))


def stage_train(work: Path, model_name: str, minutes: float | None, max_steps: int | None,
                deadline: float | None, device: str, seed: int, phases: list[Phase] | None = None,
                **config_overrides) -> dict:
    """Train one model of the pair; ``phases``/``config_overrides`` shrink the recipe (smoke tests)."""
    recipe = RECIPES[model_name]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(work / "tokenizer")
    config = recipe["config"](vocab_size=len(tokenizer), eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id,
                              **config_overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    cfg = PretrainConfig(phases=phases or recipe["phases"], lr=recipe["lr"], minutes=minutes, max_steps=max_steps, seed=seed)
    train = np.load(work / "train.npy", mmap_mode="r")
    evals = np.load(work / "eval.npy", mmap_mode="r")
    summary = pretrain(model, train, evals, cfg, work / model_name, device=device, deadline_s=deadline,
                       name=model_name)
    model.save_pretrained(work / model_name / "final")  # fp32, for export
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))
    return summary


def stage_export(work: Path, to: Path, dtype: torch.dtype) -> None:
    """bf16 safetensors shards of at most 15 MB, the tokenizer, the eval set, and the training summaries."""
    to.mkdir(parents=True, exist_ok=True)
    for name in ("verifier", "drafter"):
        model = LlamaForCausalLM.from_pretrained(work / name / "final", dtype=dtype)
        model.save_pretrained(to / name, max_shard_size=SHARD)
        summary = json.loads((work / name / "summary.json").read_text())
        (to / name / "training.json").write_text(json.dumps(summary, indent=2))
    PreTrainedTokenizerFast.from_pretrained(work / "tokenizer").save_pretrained(to / "tokenizer")
    (to / "eval_documents.safetensors").write_bytes((work / "eval_documents.safetensors").read_bytes())
    (to / "data.json").write_text((work / "data.json").read_text())
    total = sum(f.stat().st_size for f in to.rglob("*") if f.is_file())
    print(f"exported to {to}: {total / 1e6:.1f} MB")


def _full_cache_acceptance(verifier, drafter, documents) -> dict:
    """Greedy acceptance of the drafter on a full cache (γ=5, 64 new tokens, EOS ignored) at 4K/8K/16K prompts."""
    from ..training import measure_acceptance

    cells = measure_acceptance(verifier, drafter, documents, (4096, 8192, 16384), [None], gamma=5, max_new_tokens=64)
    return {c: {"acceptance": row["full"]["acceptance_rate"], "tau": row["full"]["mean_accepted_length"],
                "prompts": len(documents)} for c, row in cells.items()}


def stage_quality(pair: Path, out: Path, docs: int, acceptance_docs: int, device: str) -> dict:
    verifier, drafter, _ = load_pair(pair, device=device)
    documents = eval_documents(pair)[:docs]
    t0 = time.perf_counter()
    report = {
        "documents": len(documents),
        "verifier": position_metrics(verifier, documents, desc="verifier"),
        "verifier_last_2k": position_metrics(verifier, documents, window=2048, desc="verifier (last 2K)"),
        "drafter": position_metrics(drafter, documents, desc="drafter"),
        "acceptance_full_cache": _full_cache_acceptance(verifier, drafter, documents[:acceptance_docs]),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
    }
    report["seconds"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_sparsekv.zoo.build", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=("data", "train", "export", "quality"))
    p.add_argument("--work", type=Path, default=Path("runs/zoo"))
    p.add_argument("--model", choices=sorted(RECIPES))
    p.add_argument("--minutes", type=float, help="training time budget (progress of the LR schedule)")
    p.add_argument("--max-steps", type=int, help="step budget instead of --minutes")
    p.add_argument("--seq-len", type=int, help="one phase of this length instead of the recipe's phases")
    p.add_argument("--batch", type=int, default=1, help="batch of the --seq-len phase")
    p.add_argument("--deadline", type=float, help="stop after this many wall seconds with a checkpoint")
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    p.add_argument("--roots", nargs="*", help="source roots of the corpus (default: this Python installation)")
    p.add_argument("--eval-fraction", type=float, default=0.1, help="share of packages held out for evaluation")
    p.add_argument("--to", type=Path, default=PAIR_DIR)
    p.add_argument("--pair", type=Path, default=PAIR_DIR)
    p.add_argument("--out", type=Path, default=Path("quality.json"))
    p.add_argument("--docs", type=int, default=EVAL_DOCS)
    p.add_argument("--acceptance-docs", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    args = p.parse_args(argv)
    if args.stage == "data":
        stage_data(args.work, args.vocab_size, args.roots, args.eval_fraction)
    elif args.stage == "train":
        if args.model is None:
            p.error("train needs --model")
        if (args.minutes is None) == (args.max_steps is None):
            p.error("train needs exactly one of --minutes and --max-steps")
        phases = [Phase(1.0, args.seq_len, args.batch)] if args.seq_len else None
        stage_train(args.work, args.model, args.minutes, args.max_steps, args.deadline, args.device, args.seed, phases)
    elif args.stage == "export":
        stage_export(args.work, args.to, getattr(torch, args.dtype))
    else:
        stage_quality(args.pair, args.out, args.docs, args.acceptance_docs, args.device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
