"""Byte-level BPE tokenizer for the bundled pair, trained with ``tokenizers`` on the train split."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (every byte representable, no unknown token); ids 0 and 1 are EOS and PAD."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=PAD, model_max_length=1 << 20)


def encode_documents(tokenizer: PreTrainedTokenizerFast, texts: Iterable[str], batch: int = 64) -> list[np.ndarray]:
    """Each document as a uint16 array of ids (no special tokens), encoded in parallel batches by the Rust backend."""
    if len(tokenizer) > np.iinfo(np.uint16).max:
        raise ValueError(f"vocabulary of {len(tokenizer)} does not fit uint16")
    backend = tokenizer.backend_tokenizer
    out: list[np.ndarray] = []
    pending: list[str] = []

    def flush():
        for enc in backend.encode_batch(pending, add_special_tokens=False):
            out.append(np.asarray(enc.ids, dtype=np.uint16))
        pending.clear()

    for text in texts:
        pending.append(text)
        if len(pending) == batch:
            flush()
    if pending:
        flush()
    return out
