"""Budget sampling B ~ Cat(budgets, weights) (Alg. 1 step 4, Eq. 7), reproducible and checkpointable."""

from __future__ import annotations

import torch


class BudgetSampler:
    """Draws one KV budget per training step with probabilities ``weights / sum(weights)``.

    Uses its own ``torch.Generator`` (seeded), so the sequence of budgets depends on nothing else; its state is part
    of a training checkpoint.
    """

    def __init__(self, budgets: list[int], weights: list[float], seed: int = 0) -> None:
        if len(budgets) == 0 or len(budgets) != len(weights):
            raise ValueError(f"budgets and weights must be non-empty and of equal length, got {budgets}, {weights}")
        probs = torch.tensor(weights, dtype=torch.float64)
        if bool((probs < 0).any()) or float(probs.sum()) <= 0:
            raise ValueError(f"weights must be non-negative with a positive sum, got {weights}")
        self.budgets = list(budgets)
        self.probs = probs / probs.sum()
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self) -> int:
        return self.budgets[int(torch.multinomial(self.probs, 1, generator=self.generator))]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
