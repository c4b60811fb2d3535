"""Greedy chain speculative decoding (BudgetDraft Alg. 2, QuantSpec §4), lossless against greedy AR.

Each round: the drafter proposes γ tokens; the verifier scores [last token, drafts] in one forward on its own
cache; the longest prefix of drafts equal to the verifier's argmax is accepted, plus the verifier's next token;
both caches are rolled back past the first rejection. Stopping rules are checked token by token in order, so the
output is the one greedy AR produces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache
from transformers.generation import LogitsProcessorList, StoppingCriteriaList

from ..caches import HierarchicalQuantCache
from .drafters import forward
from .stats import SpecStats


@dataclass
class GreedyRules:
    """What ``generate()`` would do to logits and when it stops (batch size 1). ``logits_processor``: stock's
    processors for the call (with sampling, its warpers too; the sampling loop applies them itself), which
    :meth:`process` applies for greedy decoding."""

    prompt_length: int
    max_length: int
    eos_token_ids: list[int]
    min_length: int = 0
    min_new_tokens: int = 0
    logits_processor: LogitsProcessorList = field(default_factory=LogitsProcessorList)
    stopping_criteria: StoppingCriteriaList = field(default_factory=StoppingCriteriaList)
    keep_scores: bool = False  # the static loop keeps each token's scores and logits (output_scores/output_logits)

    def process(self, sequence: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Scores for the token after ``sequence [1, N]`` from raw ``logits [1, V]``."""
        n = sequence.shape[1]
        floor = self.eos_token_ids and (n < self.min_length or n - self.prompt_length < self.min_new_tokens)
        if floor or self.logits_processor:
            logits = logits.clone()  # a processor may write into its input; the raw logits stay as they are
        if floor:
            logits[:, self.eos_token_ids] = float("-inf")
        if self.logits_processor:
            logits = self.logits_processor(sequence, logits)
        return logits

    def stop_token(self, tokens: list[int], scores: tuple | None = None) -> bool:
        """``should_stop`` for a host-side sequence (the static loop)."""
        if len(tokens) >= self.max_length or tokens[-1] in self.eos_token_ids:
            return True
        return bool(self.stopping_criteria) and bool(self.stopping_criteria(torch.tensor([tokens]), scores).any())

    def should_stop(self, sequence: torch.Tensor, scores: tuple | None) -> bool:
        """Whether generation stops after ``sequence [1, N]``; the criteria get ``scores`` as stock passes them: the
        processed scores of every generated token so far (a tuple of ``[1, V]``) with ``output_scores``, else
        None."""
        if sequence.shape[1] >= self.max_length or int(sequence[0, -1]) in self.eos_token_ids:
            return True
        return bool(self.stopping_criteria) and bool(self.stopping_criteria(sequence, scores).any())


@dataclass
class SpeculativeResult:
    sequence: torch.Tensor  # [1, N] prompt + generated tokens
    stats: SpecStats
    scores: list[torch.Tensor]  # processed scores per generated token, [1, V] each
    logits: list[torch.Tensor]  # raw verifier logits per generated token


class Output:
    """The growing sequence ``[1, N]`` and what ``generate()`` returns with it (scores, logits, stats); ``append``
    feeds the streamer and applies the stopping rules."""

    def __init__(self, prompt: torch.Tensor, rules: GreedyRules, streamer=None):
        self.sequence, self.rules, self.streamer = prompt, rules, streamer
        self.stats = SpecStats()
        self.scores: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []

    def append(self, token: int, raw: torch.Tensor, scores: torch.Tensor) -> bool:
        """Add ``token`` (raw logits and processed scores ``[1, V]``); True when generation stops after it."""
        self.sequence = torch.cat([self.sequence, self.sequence.new_tensor([[token]])], dim=1)
        self.logits.append(raw)
        self.scores.append(scores)
        self.stats.new_tokens += 1
        if self.streamer is not None:
            self.streamer.put(self.sequence[0, -1:].cpu())
        return self.rules.should_stop(self.sequence, tuple(self.scores) if self.rules.keep_scores else None)

    def draft_length(self, gamma: int, verifier_cache: Cache) -> int:
        """Drafts for the next round: at most γ, none past ``max_length``, and (self-speculation on a quantized
        store) no verification block crossing a flush of the store."""
        n = min(gamma, self.rules.max_length - self.sequence.shape[1] - 1)
        if isinstance(verifier_cache, HierarchicalQuantCache):
            n = min(n, verifier_cache.uniform_room() - 1)
        return n

    def result(self) -> SpeculativeResult:
        if self.streamer is not None:
            self.streamer.end()
        return SpeculativeResult(self.sequence, self.stats, self.scores, self.logits)


def widened(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """``logits [..., V']`` of a drafter as ``[..., vocab]``: a narrower drafter (limited to the shared ids) padded
    with -inf, a wider one cut."""
    if logits.shape[-1] < vocab:
        pad = logits.new_full((*logits.shape[:-1], vocab - logits.shape[-1]), float("-inf"))
        logits = torch.cat([logits, pad], dim=-1)
    return logits[..., :vocab]


def prefill(verifier, verifier_cache: Cache, drafter, prompt: torch.Tensor, stats: SpecStats) -> torch.Tensor:
    """Feed the prompt to the verifier (only what ``verifier_cache`` lacks: prompt caching) and the drafter; the
    verifier's float32 logits ``[1, V]`` after the prompt."""
    start = verifier_cache.get_seq_length()
    with stats.timer("prefill_seconds", prompt.device):
        with drafter.sharing_prefill(verifier, verifier_cache):
            raw = forward(verifier, prompt[:, start:], verifier_cache, start, 1)[:, -1]
        drafter.prefill(prompt)
    return raw


def speculative_decode(
    verifier,
    verifier_cache: Cache,
    drafter,
    prompt: torch.Tensor,
    gamma: int,
    rules: GreedyRules,
    streamer=None,
) -> SpeculativeResult:
    """Generate greedily from ``prompt [1, P]`` with ``drafter`` (see :mod:`.drafters`) proposing ``gamma`` tokens
    per round. ``verifier_cache`` is empty or holds the first n < P prompt tokens (prompt caching: only the rest is
    prefilled); it is left holding the sequence minus its last token."""
    out = Output(prompt, rules, streamer)
    stats, device = out.stats, prompt.device
    raw = prefill(verifier, verifier_cache, drafter, prompt, stats)
    scores = rules.process(out.sequence, raw)
    done = out.append(int(scores.argmax(-1)), raw, scores)
    draft_rule = None
    if rules.logits_processor:  # drafts go through the processors the verifier's choice goes through (acceptance)
        vocab = raw.shape[-1]

        def draft_rule(prefix: torch.Tensor, logits: torch.Tensor) -> tuple[int, None]:
            return int(rules.process(prefix, widened(logits, vocab)).argmax(-1)), None

    while not done:
        n_seq = out.sequence.shape[1]
        n_draft = out.draft_length(gamma, verifier_cache)
        drafts: list[int] = []
        if n_draft > 0:
            with stats.timer("draft_seconds", device):
                drafts = drafter.propose(out.sequence, n_draft, draft_rule)[0]
        with stats.timer("verify_seconds", device):
            block = torch.cat([out.sequence[:, -1:], out.sequence.new_tensor([drafts])], dim=1)
            raw_block = forward(verifier, block, verifier_cache, n_seq - 1, 0)[0]
        stats.rounds += 1
        stats.drafted += len(drafts)
        accepted = 0
        for i in range(len(drafts) + 1):
            scores = rules.process(out.sequence, raw_block[i : i + 1])
            token = int(scores.argmax(-1))
            matches = i < len(drafts) and token == drafts[i]
            done = out.append(token, raw_block[i : i + 1], scores)
            if not matches or done:
                break
            accepted += 1
        stats.accepted += accepted
        # The verifier cache holds n_seq - 1 + len(drafts) + 1 tokens; keep those of the sequence minus its last.
        verifier_cache.crop(out.sequence.shape[1] - 1 - (n_seq + len(drafts)))
        drafter.rollback(out.sequence.shape[1] - 1)
    return out.result()
