"""BudgetDraft drafter training (paper Alg. 1): trainer, acceptance measurement, checkpoints, Hub push + cards."""

from .budgets import BudgetSampler
from .config import LOSSES, TrainingConfig
from .evaluate import acceptance_table, measure_acceptance
from .trainer import BudgetDraftTrainer, EvalSettings, StepResult

__all__ = [
    "LOSSES",
    "BudgetDraftTrainer",
    "BudgetSampler",
    "EvalSettings",
    "StepResult",
    "TrainingConfig",
    "acceptance_table",
    "measure_acceptance",
]
