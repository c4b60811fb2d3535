"""The project's bundled verifier/drafter pair (trained by :mod:`hf_sparsekv.zoo.build`), loaded offline.

``PAIR_DIR`` holds ``verifier/``, ``drafter/`` (the pretrained 2K drafter) and ``drafter-budgetdraft/`` (the same
drafter after BudgetDraft training against the verifier) as Llama bf16 safetensors, ``tokenizer/`` (byte-level BPE)
and ``eval_documents.safetensors`` (held-out long documents of Python source, as token ids).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

PAIR_DIR = Path(__file__).parent / "pair"
DRAFTERS = {"budgetdraft": "drafter-budgetdraft", "base": "drafter"}


def _check(pair: Path) -> Path:
    pair = Path(pair)
    missing = [n for n in ("verifier", "drafter", "tokenizer", "eval_documents.safetensors") if not (pair / n).exists()]
    if missing:
        raise FileNotFoundError(f"the model pair at {pair} lacks {missing}; build it with `make zoo`")
    return pair


def load_pair(pair: str | Path = PAIR_DIR, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
              drafter: str = "budgetdraft"):
    """``(verifier, drafter, tokenizer)`` from ``pair``, offline, in eval mode on ``device``.

    ``drafter`` is ``"budgetdraft"`` (trained for sparse caches by ``benchmarks/budgetdraft.py``) or ``"base"`` (the
    plain pretrained 2K drafter, all that ``make zoo`` builds). ``dtype`` defaults to float32 on CPU (bf16 matmuls are slow
    there) and the stored bf16 on CUDA.
    """
    if drafter not in DRAFTERS:
        raise ValueError(f"drafter must be one of {sorted(DRAFTERS)}, got {drafter!r}")
    from transformers import AutoTokenizer, LlamaForCausalLM

    pair = _check(pair)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    drafter_dir = DRAFTERS[drafter]
    if not (pair / drafter_dir).exists():
        raise FileNotFoundError(f"{pair} has no {drafter_dir}/; pass drafter='base' or train it with benchmarks/budgetdraft.py")
    models = []
    for name in ("verifier", drafter_dir):
        model = LlamaForCausalLM.from_pretrained(pair / name, dtype=dtype, local_files_only=True)
        models.append(model.to(device).eval())
    tokenizer = AutoTokenizer.from_pretrained(pair / "tokenizer", local_files_only=True)
    return models[0], models[1], tokenizer


def eval_documents(pair: str | Path = PAIR_DIR) -> list[torch.Tensor]:
    """The held-out documents (never seen in training), as 1-D LongTensors of token ids, in a fixed order."""
    tensors = load_file(_check(pair) / "eval_documents.safetensors")
    return [tensors[k].long() for k in sorted(tensors)]
