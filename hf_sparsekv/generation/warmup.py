"""Paying a configuration's first call ahead of the first request (a server's start, a notebook's first cell)."""

from __future__ import annotations

import time

import torch

from .compile_policy import compile_from_now


def warmup(model, max_length: int, max_new_tokens: int = 128, **generate_kwargs) -> float:
    """Run ``model.generate`` once, on a made-up prompt of ``max_length - max_new_tokens`` tokens, with the arguments
    the real calls will pass (``assistant_model=``, ``kv_budget=``, ``draft_cache=``, ``static_engine=True``,
    ``prompt_lookup_num_tokens=``, sampling options, ...): the engine of that configuration is built for sequences of
    up to ``max_length`` tokens, its steps compiled and captured, and kept, so that later calls with prompts up to that
    length pay none of it (each call still fills its own caches). The steps compile now
    (:mod:`~hf_sparsekv.generation.compile_policy`; ``HF_SPARSEKV_COMPILE=0`` keeps them uncompiled). Returns the
    seconds it took.

    The output is discarded; the made-up prompt is random token ids (seeded), which only sizes and exercises the
    engine."""
    if max_new_tokens < 1 or max_length <= max_new_tokens:
        raise ValueError(f"warmup needs max_length > max_new_tokens >= 1, got {max_length} and {max_new_tokens}")
    for name in ("input_ids", "inputs", "attention_mask", "max_length", "max_new_tokens"):
        if name in generate_kwargs:
            raise ValueError(f"warmup makes its own prompt and length: do not pass {name}")
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, max_length - max_new_tokens), generator=generator).to(model.device)
    start = time.perf_counter()
    compile_from_now(model)
    # (an all-ones mask: a pad id drawn into the prompt is a token here)
    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens, **generate_kwargs)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter() - start
