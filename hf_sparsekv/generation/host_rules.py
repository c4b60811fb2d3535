"""Host-side rules between the static engine's captured steps: what needs a row's sequence at every position or the
scores of every token — the processors stock ``generate()`` builds that the device cannot apply (n-gram and
bad-word bans, sequence bias, forced tokens, ...), a user's ``logits_processor``, ``stopping_criteria`` (which may
read the scores), ``output_scores`` / ``output_logits``.

With these the engine's verify step stops at the logits: it leaves the raw float32 logits ``[B, L, V]`` of its block
(L = γ+1: after the row's sequence, then after each of its first i drafts) in :attr:`StaticEngine.logits`. For each
row, :func:`verify_block` applies the row's processors after each exact prefix, as stock ``generate()`` would after
that prefix, picks the verifier's tokens from the processed scores (greedy: the argmax; sampling: speculative
sampling against the drafter's ``q``) and keeps the scores and logits of the tokens it emits; the engine then writes
them on the device (:meth:`StaticEngine.commit`). The drafts stay on the device (they only decide how many tokens a
round keeps, never which). A tree round (:mod:`.draft_tree`) leaves the logits of its N + 1 nodes, and
:func:`verify_tree` processes each node after its own path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.generation import LogitsProcessorList, StoppingCriteriaList

from .acceptance import accept_or_resample, accepted_length, walk_tree
from .sampling import draw
from .stats import SpecStats


@dataclass
class GreedyRules:
    """What ``generate()`` would do to one row's logits and when it stops. ``logits_processor``: stock's processors
    for the call (with sampling, its warpers too), which :meth:`process` applies."""

    prompt_length: int
    max_length: int
    eos_token_ids: list[int]
    min_length: int = 0
    min_new_tokens: int = 0
    logits_processor: LogitsProcessorList = field(default_factory=LogitsProcessorList)
    stopping_criteria: StoppingCriteriaList = field(default_factory=StoppingCriteriaList)
    keep_scores: bool = False  # the static loop keeps each token's scores and logits (output_scores/output_logits)
    _held: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # device -> SequenceBuffer

    def sequence(self, tokens: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """The row's sequence ``tokens`` as ``[1, N]`` int64 on ``device``, a view of a buffer that receives only the
        tokens it has not seen: a long context is not converted again at every token. Positions below N are never
        written again (tokens are committed), so a view handed out earlier keeps its values."""
        device = torch.device(device)
        if device not in self._held:
            self._held[device] = SequenceBuffer(device)
        return self._held[device].view(tokens)

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
        """Whether generation stops after ``tokens`` (the row's sequence); the criteria get ``scores`` as stock passes
        them: the processed scores of every generated token so far (a tuple of ``[1, V]``) with ``output_scores``,
        else None."""
        ends = len(tokens) >= self.max_length or tokens[-1] in self.eos_token_ids
        if not self.stopping_criteria:
            return ends
        return bool(self.stopping_criteria(self.sequence(tokens), scores).any()) or ends  # (called at the last token
        # too, as stock calls every criterion after every token)


class RowSequence:
    """A row's committed tokens: its prompt ``[1, P]`` (a tensor, on the model's device) and the tokens generated after
    it (a host list). ``len`` and the last token are read every token; the prompt's values come to the host only
    where something indexes into them (a prompt's ``tolist()`` grows with the context: 0.2 ms for 16K tokens and
    2.8 ms for 128K on one CPU core). :class:`SequenceBuffer` copies the prompt tensor itself."""

    def __init__(self, prompt: torch.Tensor):
        self.prompt = prompt
        self.prompt_length = prompt.shape[1]
        self.new: list[int] = []
        self._prompt_list: list[int] | None = None

    def __len__(self) -> int:
        return self.prompt_length + len(self.new)

    def append(self, token: int) -> None:
        self.new.append(token)

    def __getitem__(self, index):
        p = self.prompt_length
        if isinstance(index, int) and -len(self.new) <= index < 0:
            return self.new[index]
        start = (index.start or 0) if isinstance(index, slice) else None
        if start is not None and start >= p and index.step is None:  # a slice of the generated tokens
            return self.new[start - p : None if index.stop is None else max(index.stop - p, 0)]
        if self._prompt_list is None:
            self._prompt_list = self.prompt[0].tolist()
        return (self._prompt_list + self.new)[index]


class SequenceBuffer:
    """A growing ``[1, capacity]`` int64 buffer on one device holding a row's committed tokens; :meth:`view` copies
    only the tokens past what it holds (one small host-to-device copy) and returns ``[1, N]``. Invariant: each list
    passed extends the one before (a row's committed tokens only grow), so one buffer serves one row of one call."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer = torch.empty((1, 0), dtype=torch.long, device=device)
        self.held = 0

    def view(self, tokens: list[int] | RowSequence) -> torch.Tensor:
        n = len(tokens)
        if n > self.buffer.shape[1]:  # a new buffer (views of the old one keep theirs)
            grown = torch.empty((1, max(2 * n, 256)), dtype=torch.long, device=self.device)
            grown[:, : self.held].copy_(self.buffer[:, : self.held])
            self.buffer = grown
        self.held = min(self.held, n)
        prompt = getattr(tokens, "prompt", None)  # a RowSequence: its prompt as the tensor it is
        if prompt is not None and self.held < prompt.shape[1]:
            self.buffer[:, self.held : prompt.shape[1]].copy_(prompt[:, self.held :])
            self.held = prompt.shape[1]
        if n > self.held:
            self.buffer[0, self.held : n] = torch.tensor(tokens[self.held : n], dtype=torch.long)
            self.held = n
        return self.buffer[:, :n]


@dataclass
class SpeculativeResult:
    """One row's generation."""

    sequence: torch.Tensor  # [1, N] prompt + generated tokens
    stats: SpecStats
    scores: list[torch.Tensor]  # processed scores per generated token, [1, V] each
    logits: list[torch.Tensor]  # raw verifier logits per generated token


@dataclass
class RowOutput:
    """A row's emitted tokens with their processed scores and raw logits ``[1, V]`` each (kept when asked for)."""

    keep_scores: bool
    scores: list = field(default_factory=list)
    logits: list = field(default_factory=list)

    def add(self, scores: list[torch.Tensor], raw: list[torch.Tensor]) -> None:
        if self.keep_scores:
            self.scores.extend(scores)
            self.logits.extend(raw)


def processed(rules: GreedyRules, sequence: torch.Tensor, raw: torch.Tensor, sampling: bool) -> torch.Tensor:
    """Scores ``[1, V]`` of the token after ``sequence [1, N]`` from raw float32 ``raw [1, V]``: greedy, stock's
    processors and the minimum-length EOS floor (:meth:`GreedyRules.process`); sampling, the processors and warpers
    stock builds for sampling (they carry the minimum length themselves)."""
    if sampling:
        return rules.logits_processor(sequence, raw.clone())
    return rules.process(sequence, raw)


def choose(scores: torch.Tensor, sampling: bool) -> int:
    """The token after processed ``scores [1, V]``: the argmax, or a draw from their softmax."""
    return int(draw(torch.softmax(scores, -1))[0]) if sampling else int(scores.argmax(-1)[0])


def verify_block(rules: GreedyRules, tokens: list[int], drafts: list[int], raw: torch.Tensor, q: torch.Tensor | None,
                 room: int) -> tuple[int, list[int], list[torch.Tensor], list[torch.Tensor]]:
    """One row's round: ``tokens`` its sequence so far, ``drafts`` its γ drafts, ``raw [γ+1, V]`` the verifier's
    float32 logits after the sequence and after each prefix of the drafts, ``q [γ, V]`` the drafter's probabilities
    of its drafts (sampling; None: greedy), ``room`` the most drafts the row may keep (a quantized store's state).
    Returns ``(accepted, emitted tokens, their scores, their raw logits)``."""
    drafts = drafts[:room]
    raw = raw[: len(drafts) + 1].clone()  # the engine's buffer is rewritten by the next round
    device = raw.device
    sequence = torch.cat([rules.sequence(tokens, device), torch.tensor([drafts], dtype=torch.long, device=device)], 1)
    n, sampling = len(tokens), q is not None
    scores = [processed(rules, sequence[:, : n + i], raw[i : i + 1], sampling) for i in range(len(drafts) + 1)]
    if sampling:
        p = torch.softmax(torch.cat(scores), -1)[None]
        accepted, token = accept_or_resample(p, q[None, : len(drafts)], sequence[:, n:])
        a = int(accepted[0])
        emitted = drafts[:a] + [int(token[0])]
    else:
        verified = torch.cat(scores).argmax(-1)[None]
        a = int(accepted_length(sequence[:, n:], verified)[0])
        emitted = verified[0, : a + 1].tolist()
    return a, emitted, scores[: a + 1], [raw[i : i + 1] for i in range(a + 1)]


def verify_tree(rules: GreedyRules, tokens: list[int], nodes: list[int], parents: list[int], raw: torch.Tensor,
                q: torch.Tensor | None, gamma: int) -> tuple[int, list[int], list[torch.Tensor], list[torch.Tensor], int]:
    """One row's tree round (:mod:`.draft_tree`): ``nodes`` / ``parents`` the tree's node tokens and parents (node 0
    the root), ``raw [N+1, V]`` the verifier's float32 logits at the nodes, ``q [γ, V]`` the drafter's probabilities
    of its chain (sampling; None: greedy). Each node's scores are processed after its own path, then the tree is
    walked as on the device (:func:`~.acceptance.walk_tree`). Returns ``(accepted, emitted tokens, their scores,
    their raw logits, the last node kept)``."""
    raw = raw[: len(nodes)].clone()  # the engine's buffer is rewritten by the next round
    sampling = q is not None
    paths = [[]]  # each node's tokens after the sequence
    for i in range(1, len(nodes)):
        paths.append(paths[parents[i]] + [nodes[i]])
    held = rules.sequence(tokens, raw.device)
    scores = [processed(rules, torch.cat([held, torch.tensor([path], dtype=torch.long, device=raw.device)], 1),
                        raw[i : i + 1], sampling)
              for i, path in enumerate(paths)]
    stacked = torch.cat(scores)[None]  # [1, N+1, V]
    node_tokens, node_parents = torch.tensor([nodes], device=raw.device), torch.tensor([parents], device=raw.device)
    if sampling:
        node, accepted, token = walk_tree(node_tokens, node_parents, gamma, p=torch.softmax(stacked, -1), q=q[None])
    else:
        node, accepted, token = walk_tree(node_tokens, node_parents, gamma, targets=stacked.argmax(-1))
    node, a = int(node[0]), int(accepted[0])
    on_path = [node]  # the nodes from the root to the kept one
    while on_path[-1] != 0:
        on_path.append(parents[on_path[-1]])
    on_path.reverse()
    emitted = paths[node] + [int(token[0])]
    return a, emitted, [scores[i] for i in on_path], [raw[i : i + 1] for i in on_path], node
