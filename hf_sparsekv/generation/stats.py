"""Per-call statistics of speculative generation."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields

import torch


class SyncedTimer:
    """Wall-clock seconds of a ``with`` block, CUDA-synchronized at both ends on a CUDA device."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self.seconds = 0.0

    def __enter__(self) -> "SyncedTimer":
        if self.cuda:
            torch.cuda.synchronize()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self._start


@dataclass
class SpecStats:
    """Counters of one speculative ``generate()`` call: ``out.spec_stats`` with ``return_dict_in_generate=True``.

    Fields (attributes; ``out.spec_stats["rounds"]`` works too, and :meth:`to_dict` gives a plain dict):

    - ``rounds``: verifier decode forwards after the prefill (one per draft-and-verify round), up to each row's
      stop: plain steps run past it (the rest of a burst, :mod:`.rounds`) are not counted.
    - ``drafted``: draft tokens proposed by the drafter, summed over rounds (at most γ per round).
    - ``accepted``: draft tokens the verifier accepted (``accepted <= drafted``).
    - ``retrieved_rounds``: rounds (retrieval beside a drafter) whose kept tokens followed the retrieved branch of
      the round's tree rather than the drafter's; ``drafted`` counts γ per round there too (one branch's length).
    - ``sibling_rounds``: tree rounds (``draft_tree_size``) whose kept path ended on one of the drafter's nodes
      off its chain.
    - ``width_rounds``: rounds per number of drafts verified, ``{γ: rounds}``; ``width_rounds.get(0)`` counts the
      rounds without drafts (one plain verifier step: the draft-length controller's choice, :mod:`.controller`, or no
      retrieval match, or no room in a quantized store). ``ar_rounds`` (derived) is that count.
    - ``new_tokens``: tokens generated (the first comes from the verifier's prefill, each later one from a round).
    - ``prefill_tokens``: prompt tokens the verifier's prefill read: the prompt's, less the leading ones its cache
      still held from the engine's last call (a chat's next turn, :meth:`~.engine.StaticEngine.prefill`).
    - ``drafter_prefill_tokens``: prompt tokens a separate drafter's prefill read (its full cache also keeps a chat's
      earlier turns; a sink + window cache's prefill reads only the positions it keeps; 0 where its prefill was
      deferred and no round drafted, or no separate drafter).
    - ``prefill_seconds``: wall-clock seconds of the verifier's and the drafter's prefill of the prompt (a drafter
      prefill deferred to the first drafting round: its device seconds there, or host seconds on CPU).
    - ``draft_seconds``: seconds spent drafting; ``verify_seconds``: seconds in verifier forwards.
    - ``rounds_seconds``: wall-clock seconds from the prefill's end to the last round's end (a deferred drafter
      prefill excluded): ``rounds_seconds - draft_seconds - verify_seconds`` is the host's time between the rounds'
      steps; a call's time beyond ``prefill_seconds + rounds_seconds`` is spent before the prefill (the front end:
      argument checks, the engine's lookup) and after the last round (the output's assembly).
      All seconds are wall-clock, CUDA-synchronized on a CUDA device.
    - ``prompts``: how many prompts (batch rows) the counters add up; ``rows``: for a batch of more than one
      prompt, each row's own ``SpecStats`` in batch order (empty for one prompt).

    Derived (read-only properties, also in :meth:`to_dict` and reachable by ``[...]``):

    - ``acceptance_rate`` α = accepted / drafted; None where nothing was drafted (every round a plain step: see
      :meth:`summary`).
    - ``mean_accepted_length`` τ = tokens produced per verifier forward = (new_tokens - prompts) / rounds: the
      accepted drafts plus the verifier's own token, averaged over rounds (0.0 without rounds).
    """

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    retrieved_rounds: int = 0
    sibling_rounds: int = 0
    width_rounds: dict = field(default_factory=dict)
    new_tokens: int = 0
    prefill_tokens: int = 0
    drafter_prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    rounds_seconds: float = 0.0
    prompts: int = 1
    rows: list = field(default_factory=list)

    DERIVED = ("acceptance_rate", "mean_accepted_length", "ar_rounds")
    SECONDS = ("prefill_seconds", "draft_seconds", "verify_seconds", "rounds_seconds")  # a call's, not a row's

    @property
    def ar_rounds(self) -> int:
        return self.width_rounds.get(0, 0)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float:
        produced = self.new_tokens - self.prompts  # each prompt's first token comes from its prefill
        return produced / self.rounds if self.rounds else 0.0

    def summary(self) -> str:
        """One line for people: α with the drafts it counts, τ, and the rounds per width (0: a plain step); where
        nothing was drafted, that, and why it may be."""
        widths = dict(sorted(self.width_rounds.items()))
        if not self.drafted:
            return (f"no drafts: {self.rounds} plain verifier steps (the draft-length controller found drafting would "
                    "not pay here, or retrieval found no match); tau 1.00")
        return (f"acceptance {self.acceptance_rate:.2f} ({self.accepted} of {self.drafted} drafts), tau "
                f"{self.mean_accepted_length:.2f}, rounds by width {widths}")

    def to_dict(self) -> dict:
        """Every field and derived figure as a plain ``dict`` (JSON-serialisable)."""
        d = asdict(self)
        for name in self.DERIVED:
            d[name] = getattr(self, name)
        return d

    def keys(self) -> list[str]:
        """The names :meth:`to_dict` returns; with ``__getitem__`` this makes ``{**stats}`` and ``dict(stats)`` work."""
        return [f.name for f in fields(self)] + list(self.DERIVED)

    def __getitem__(self, name: str):
        """``stats["acceptance_rate"]``: the dict-style access ``spec_stats`` had before it was a dataclass."""
        if not isinstance(name, str) or name not in self.keys():
            raise KeyError(name)
        return getattr(self, name)

    def __contains__(self, name) -> bool:
        return name in self.keys()

    def __repr__(self) -> str:
        return (
            f"SpecStats(acceptance_rate={_rate(self.acceptance_rate)}, mean_accepted_length={self.mean_accepted_length:.2f}, "
            f"rounds={self.rounds}, drafted={self.drafted}, accepted={self.accepted}, new_tokens={self.new_tokens}, "
            f"prefill_seconds={self.prefill_seconds:.3f}, draft_seconds={self.draft_seconds:.3f}, "
            f"verify_seconds={self.verify_seconds:.3f})"
        )

    @classmethod
    def of_rows(cls, rows: list["SpecStats"]) -> "SpecStats":
        """Totals over the rows of a batch (counters and seconds summed), keeping each row's stats in ``rows``."""
        total = cls(prompts=len(rows), rows=list(rows))
        for name in ("rounds", "drafted", "accepted", "retrieved_rounds", "sibling_rounds", "new_tokens") + cls.SECONDS:
            setattr(total, name, sum(getattr(r, name) for r in rows))
        for r in rows:
            for width, count in r.width_rounds.items():
                total.width_rounds[width] = total.width_rounds.get(width, 0) + count
        return total

    @contextmanager
    def timer(self, field: str, device: torch.device):
        """Add the block's seconds to ``field``."""
        clock = SyncedTimer(device)
        try:
            with clock:
                yield
        finally:
            setattr(self, field, getattr(self, field) + clock.seconds)


def _rate(value: float | None) -> str:
    return "None" if value is None else f"{value:.3f}"
