"""Batch size > 1 on the speculative path: each row decoded on its own, the outputs assembled as stock
``generate()`` assembles a batch.

Contract (what a left-padded batch gets): row ``b`` of the output is exactly what ``generate()`` returns for
``input_ids[b:b+1]`` with ``attention_mask[b:b+1]`` (its own padding, so ``max_length``/``min_length`` count it as
stock does), followed by ``pad_token_id`` up to the longest row, as stock pads rows that stopped early (EOS, a stop
string, a stopping criterion). ``spec_stats`` holds the totals and each row's own counters (``rows``).

Two ways to get there. Every mode but sampled int4 self-speculation runs all rows together on one engine
(:func:`~.rounds.static_decode_rows`: one captured step per batch, each row with its own length, positions, chunk
selection or quantization state, accepted count and draws). Sampled int4 self-speculation runs the rows one after
another through the batch-1 path (:func:`generate_rows`), each on the engine (a row's quantization cap would cut
another row's sampled block): the verifier's weights are read once per row, so throughput does not grow with the
batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, DynamicCache
from transformers.utils import logging

from ..cache_keyword import output_field
from .stats import SpecStats

logger = logging.get_logger(__name__)


def token_ids(value) -> list[int]:
    """A token-id option (``eos_token_id``: an int, a NumPy integer, a 0-d or 1-d tensor, a list) as a list of ints
    ([] for None), as stock ``generate()`` accepts it."""
    return [] if value is None else [int(t) for t in torch.as_tensor(value).flatten().tolist()]


def pad_value(config) -> int | None:
    """The id stock ``generate()`` writes after a row has finished: ``pad_token_id``, else the first EOS id."""
    if config.pad_token_id is not None:
        return int(config.pad_token_id)
    eos = token_ids(config.eos_token_id)
    return eos[0] if eos else None


def check_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, config, *, streamer, prefix_cache,
                max_time) -> None:
    """Refuse what a batch cannot honour, before any row runs (``max_time``: given only where the rows run one after
    another, so that one clock cannot stop them all)."""
    if streamer is not None:
        raise ValueError("streamer supports batch size 1 only (as in stock generate()), got a batch of "
                         f"{input_ids.shape[0]}")
    if prefix_cache:
        raise NotImplementedError(
            "past_key_values (cache=) is supported with batch size 1 only (prompt caching) on hf_sparsekv's engine: "
            "each row of a batch runs on caches of its own; omit it"
        )
    if max_time is not None:
        raise NotImplementedError("max_time with batch size > 1 is not supported with sampled int4 self-speculation "
                                  "(its rows run one after another)")
    if config.output_scores or config.output_logits:
        raise NotImplementedError(
            "output_scores/output_logits with batch size > 1 are not supported on hf_sparsekv's engine"
        )


def generate_rows(
    generate_one: Callable[[torch.Tensor, torch.Tensor | None, Cache | str | None], object],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    draft_cache,
    pad: int | None,
    target: DynamicCache | None,
):
    """Run ``generate_one(row_ids [1, L], row_mask [1, L] or None, draft_cache)`` for each row and assemble ``[B, L +
    max new]`` sequences. ``target``: None for the sequences alone (``generate_one`` returns the row's sequences);
    else the empty cache of a dict-style output (``generate_one`` returns one with ``sequences``, ``spec_stats`` and
    the row's cache, all but its last token in columns as stock's), which gets the rows' caches (:func:`place_rows`).
    A ``draft_cache`` instance is copied (empty) for each row."""
    # Debug level: every sampled int4 batch takes this path, so a warning would greet every such script run;
    # docs/options.md ("Batches") says what it costs.
    logger.debug("hf_sparsekv: batch of %d decoded one row after another (docs/options.md, 'Batches')",
                 input_ids.shape[0])
    outputs = []
    for b in range(input_ids.shape[0]):
        mask = None if attention_mask is None else attention_mask[b : b + 1]
        cache = copy.deepcopy(draft_cache) if isinstance(draft_cache, Cache) else draft_cache
        outputs.append(generate_one(input_ids[b : b + 1], mask, cache))
    if target is None:
        return assemble(outputs, [], pad, False, None)
    caches = [getattr(out, output_field(type(out))) for out in outputs]
    width = max(out.sequences.shape[1] for out in outputs) - 1
    place_rows(target, lambda b, i: (caches[b].layers[i].keys, caches[b].layers[i].values),
               [cache.get_seq_length() for cache in caches], width, len(caches[0].layers))
    return assemble([out.sequences for out in outputs], [out.spec_stats for out in outputs], pad, True,
                    type(outputs[0]), cache=target)


def place_rows(target: DynamicCache, rows: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], ends: list[int],
               width: int, layers: int) -> DynamicCache:
    """Fill the empty ``target`` as stock's cache of a batch ends: each of its ``layers`` layers ``[B, Hkv, width,
    D]`` (a sliding layer of ``target`` keeps its last tokens, as stock's does), with row b's keys/values ``rows(b,
    layer) -> [1, Hkv, n, D]`` (the row's tokens up to column ``ends[b]``, or its last n of them) in the n columns
    before ``ends[b]``, zeros elsewhere: a row's left padding and the padding after a row that ended early, tokens
    stock's cache holds keys of but the engine never computed (the attention mask hides the left padding). One layer
    at a time (the copy adds one layer's worth at most). Returns ``target``."""
    for i in range(layers):
        keys, values = [], []
        for b, end in enumerate(ends):
            for placed, held in zip((keys, values), rows(b, i)):
                row = held.new_zeros(*held.shape[:2], width, held.shape[3])
                row[:, :, end - held.shape[2] : end] = held
                placed.append(row)
        target.update(torch.cat(keys), torch.cat(values), i)
    return target


def assemble(sequences: list[torch.Tensor], stats: list[SpecStats], pad: int | None, return_dict: bool, output_cls,
             shared_seconds: bool = False, cache: DynamicCache | None = None):
    """Rows ``sequences[b] [1, L_b]`` (each its padded prompt and new tokens) -> ``[B, max L_b]``, rows that stopped
    early padded with ``pad`` after their end as stock does; with ``return_dict``, ``output_cls(sequences=...,
    spec_stats=...)`` with the totals and each row's stats, and ``cache`` (:func:`place_rows`) in its cache field.
    ``shared_seconds``: the rows ran together and the first row's seconds are the batch's (counters are still
    summed)."""
    longest = max(seq.shape[1] for seq in sequences)
    if pad is None and any(seq.shape[1] != longest for seq in sequences):
        raise ValueError(
            "rows stopped at different lengths and there is neither pad_token_id nor eos_token_id to pad the "
            "finished ones with: set generation_config.pad_token_id"
        )
    out = torch.full((len(sequences), longest), pad if pad is not None else 0, dtype=sequences[0].dtype,
                     device=sequences[0].device)
    for b, seq in enumerate(sequences):
        out[b, : seq.shape[1]] = seq[0]
    if not return_dict:
        return out
    total = SpecStats.of_rows(stats)
    if shared_seconds:
        for name in SpecStats.SECONDS:
            setattr(total, name, getattr(stats[0], name))
    return output_cls(sequences=out, spec_stats=total, **({} if cache is None else {output_field(output_cls): cache}))
