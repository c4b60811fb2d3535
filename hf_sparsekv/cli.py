"""``python -m hf_sparsekv.cli`` (e.g. under ``accelerate launch``) runs what the ``hf-sparsekv`` script runs:
argument parsing is in :mod:`hf_sparsekv_cli` (kept light so that ``--help`` is fast), the commands ``generate``,
``demo``, ``train-drafter`` and ``push-drafter`` in :mod:`hf_sparsekv.commands` (re-exported here)."""

from __future__ import annotations

import sys

from .commands import (  # noqa: F401  (re-exported)
    SPEED_ON_CPU, TAIL_TOKENS, check_budget, cmd_demo, cmd_generate, cmd_push_drafter, cmd_train_drafter, compare,
    default_prompt, report, resolve_generate_args,
)
from .model_paths import _looks_local, refuse_missing_model_paths  # noqa: F401  (re-exported)


def main(argv: list[str] | None = None) -> int:
    from hf_sparsekv_cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
