"""Model card of a trained drafter (from ``model_cards/budgetdraft_drafter.md``) and its push to the Hub.

The card is rendered with ``huggingface_hub.ModelCard.from_template`` (Jinja2): YAML metadata (base model, datasets,
tags, library) plus the training settings and the measured acceptance per context × budget. ``push_to_hub`` uploads a
``save_pretrained`` folder in one commit through ``huggingface_hub.HfApi`` (``endpoint`` selects another
Hub-compatible server; ``token`` as usual). :func:`push_saved` is the push of ``hf-sparsekv train-drafter
--push-to-hub`` and ``hf-sparsekv push-drafter``: a push that fails (no network, a server or authentication error)
says so in one line with the command that pushes the saved folder later.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from huggingface_hub import HfApi, ModelCard, ModelCardData
from huggingface_hub.errors import HTTPError

from .. import __version__
from .config import TrainingConfig

TEMPLATE_NAME = "budgetdraft_drafter.md"
# Checkpoints and optimiser state stay local; the pushed repo is the drafter itself.
PUSH_IGNORE = ["checkpoint-*", "checkpoint-*/**", "*.pt", "metrics.jsonl"]
# What a push that cannot reach or satisfy the server raises: the HTTP client's errors (connection refused, timeouts;
# huggingface_hub's HfHubHTTPError for an error status) and OSError (missing token, requests' connection errors)
PUSH_ERRORS = (HTTPError, OSError)


def template_path() -> Path:
    """The card template: ``model_cards/`` of the source tree (it is not part of the installed package)."""
    path = Path(__file__).resolve().parents[2] / "model_cards" / TEMPLATE_NAME
    if not path.is_file():
        raise FileNotFoundError(f"model card template not found at {path}")
    return path


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _rows(evals: list[dict], budgets: list) -> list[dict]:
    """Table rows: for each context, the first evaluation (the untrained drafter when it ran at step 0) and the
    last one."""
    if not evals:
        return []
    picks = [evals[0], evals[-1]] if len(evals) > 1 else [evals[-1]]
    rows = []
    contexts = sorted({int(c) for e in picks for c in e["acceptance"]})
    for context in contexts:
        for e in picks:
            row = e["acceptance"].get(context, e["acceptance"].get(str(context)))
            if row is None:
                continue
            label = "untrained" if e["step"] == 0 else f"step {e['step']}"
            values = []
            for b in budgets:
                cell = row.get(b, row.get(str(b)))
                values.append("–" if cell is None else f"{100 * cell['acceptance_rate']:.1f}%")
            rows.append({"context": context, "label": label, "cells": values})
    return rows


def render_model_card(
    *,
    repo_id: str,
    verifier_id: str,
    drafter_base: str,
    data: str,
    config: TrainingConfig,
    steps: int,
    evals: list[dict] | None = None,
    eval_info: dict | None = None,
    processes: int = 1,
    dataset_ids: list[str] | None = None,
    tokenizer_id: str | None = None,
) -> ModelCard:
    """The drafter's card. ``evals``: ``[{"step": s, "acceptance": measure_acceptance(...)}, ...]`` in step order;
    ``eval_info``: ``gamma``, ``max_new_tokens``, ``samples``, ``data`` of those measurements, and ``held_out``
    (False when the prompts came from the training data). ``tokenizer_id``: where the card's "Use" snippet loads the
    tokenizer from; default ``repo_id``, since ``train-drafter`` saves the (shared) tokenizer beside the drafter (a
    verifier folder need not hold one: the bundled pair's has its tokenizer in a folder of its own)."""
    evals = evals or []
    budgets_seen: list = []
    for e in evals:
        for row in e["acceptance"].values():
            for b in row:
                if b not in budgets_seen:
                    budgets_seen.append(b)
    eval_budgets = sorted(budgets_seen, key=lambda b: (isinstance(b, str), int(b) if str(b).isdigit() else 0))
    card_data = ModelCardData(
        base_model=drafter_base if "/" in drafter_base and not Path(drafter_base).exists() else None,
        datasets=dataset_ids or None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["hf_sparsekv", "speculative-decoding", "budgetdraft", "drafter", "sparse-kv-cache"],
    )
    objective = (
        f"L_A + {config.lam}·L_C (multi-view sparse)" if config.uses_sparse_branch else "L_A only (ablation)"
    )
    info = {"gamma": "?", "max_new_tokens": "?", "samples": "?", "data": data, "held_out": True, **(eval_info or {})}
    return ModelCard.from_template(
        card_data,
        template_path=str(template_path()),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        tokenizer_id=tokenizer_id or repo_id,
        verifier_id=verifier_id,
        drafter_base=drafter_base,
        data=data,
        objective=objective,
        config=config,
        budgets="{" + ", ".join(str(b) for b in config.budgets) + "}",
        budget_weights="{" + ", ".join(f"{w:g}" for w in config.budget_weights) + "}",
        steps=steps,
        processes=processes,
        version=__version__,
        commit=_commit(),
        eval=info,
        eval_budgets=eval_budgets,
        acceptance=_rows(evals, eval_budgets),
    )


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    commit_message: str = "BudgetDraft drafter",
    api: HfApi | None = None,
) -> str:
    """Create ``repo_id`` if needed and upload ``folder`` (a ``save_pretrained`` folder with its README.md card) in
    one commit, leaving out checkpoints and optimiser state. Returns the commit URL."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is not a save_pretrained folder (no config.json)")
    if not (folder / "README.md").is_file():
        raise ValueError(f"{folder} has no README.md model card: write one with render_model_card(...).save(...)")
    api = api if api is not None else HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    info = api.upload_folder(
        repo_id=repo_id, folder_path=folder, repo_type="model", commit_message=commit_message, ignore_patterns=PUSH_IGNORE
    )
    return getattr(info, "commit_url", str(info))


def push_command(folder: str | Path, repo_id: str, *, private: bool | None = None, endpoint: str | None = None) -> str:
    """The ``hf-sparsekv push-drafter`` command line (shell-quoted) that pushes the saved ``folder`` to ``repo_id``."""
    words = ["hf-sparsekv", "push-drafter", str(folder), repo_id]
    if private:
        words.append("--hub-private")
    if endpoint:
        words += ["--hub-endpoint", endpoint]
    return shlex.join(words)


def push_saved(folder: str | Path, repo_id: str, *, private: bool | None = None, endpoint: str | None = None,
               say=print) -> bool:
    """:func:`push_to_hub` of the saved ``folder``, ``say``-ing the commit URL. A push that fails with one of
    :data:`PUSH_ERRORS` prints one line to stderr (the error, where the drafter is saved and the :func:`push_command`
    that pushes it later) and returns False; True once pushed."""
    try:
        url = push_to_hub(folder, repo_id, private=private, endpoint=endpoint)
    except PUSH_ERRORS as err:
        reason = " ".join(f"{type(err).__name__}: {err}".split())  # one line, however the client formats it
        print(f"hf-sparsekv: the push to {repo_id} failed ({reason}); the drafter is saved in {folder}; push it "
              f"later with: {push_command(folder, repo_id, private=private, endpoint=endpoint)}", file=sys.stderr)
        return False
    say(f"pushed to {url}")
    return True
