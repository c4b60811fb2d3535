"""Per-call statistics of speculative generation."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

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
    """Counters of one ``generate()`` call.

    ``rounds`` counts verifier decode forwards; ``drafted``/``accepted`` count draft tokens proposed/accepted.
    ``acceptance_rate`` α = accepted / drafted; ``mean_accepted_length`` τ = tokens produced per verifier forward
    (accepted drafts + the verifier's own token, averaged over rounds). Seconds are wall-clock, CUDA-synchronized.
    """

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        produced = self.new_tokens - 1  # the first token comes from the prefill
        return produced / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_accepted_length"] = self.mean_accepted_length
        return d

    @contextmanager
    def timer(self, field: str, device: torch.device):
        """Add the block's seconds to ``field``."""
        clock = SyncedTimer(device)
        try:
            with clock:
                yield
        finally:
            setattr(self, field, getattr(self, field) + clock.seconds)
