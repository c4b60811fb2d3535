"""Training checkpoints: the drafter as a loadable HF folder (safetensors) plus the optimiser/scheduler/RNG state.

Layout of ``DIR/checkpoint-<step>/``: ``config.json`` + ``model*.safetensors`` (``save_pretrained``; the folder is a
drafter ``from_pretrained`` can load), tokenizer files if a tokenizer was given, ``trainer_state.json`` (step, config,
metrics; human-readable) and ``trainer_state.pt`` (optimizer, scheduler, budget sampler, torch RNG).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

STATE_JSON = "trainer_state.json"
STATE_PT = "trainer_state.pt"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete ``checkpoint-<step>`` folder with the highest step in ``output_dir``, or None."""
    found = []
    root = Path(output_dir)
    if root.is_dir():
        for child in root.iterdir():
            match = _CHECKPOINT.match(child.name)
            if match and (child / STATE_PT).is_file():
                found.append((int(match.group(1)), child))
    return max(found)[1] if found else None


def save_model_folder(model, path: Path, tokenizer=None) -> None:
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def save_checkpoint(path: str | Path, model, state: dict, public: dict, tokenizer=None) -> Path:
    """Write the model folder, ``state`` (tensors and objects, ``torch.save``) and ``public`` (JSON). The state file
    is written last, so a folder without it is incomplete and ignored by :func:`latest_checkpoint`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_model_folder(model, path, tokenizer)
    (path / STATE_JSON).write_text(json.dumps(public, indent=2, default=str))
    torch.save(state, path / f"{STATE_PT}.tmp")
    (path / f"{STATE_PT}.tmp").replace(path / STATE_PT)
    return path


def _shared_parameter_names(model) -> set[str]:
    """Names of parameters that share storage with an earlier one (tied weights save_pretrained leaves out)."""
    seen, shared = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        ptr = tensor.data_ptr()
        if ptr in seen:
            shared.update({name, seen[ptr]})
        else:
            seen[ptr] = name
    return shared


def load_model_weights(model, path: str | Path) -> None:
    """Load every ``*.safetensors`` file of a ``save_pretrained`` folder into ``model`` in place.

    Raises ValueError if the folder has no weights, names parameters the model lacks, or lacks parameters the model
    has (other than tied copies)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    state = {}
    for file in files:
        state.update(load_file(str(file)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = set(missing) - _shared_parameter_names(model)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the drafter: missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(unexpected)[:5]}"
        )


def load_state(path: str | Path) -> dict:
    file = Path(path) / STATE_PT
    if not file.is_file():
        raise ValueError(f"{path} is not a complete training checkpoint (no {STATE_PT})")
    return torch.load(file, map_location="cpu", weights_only=False)
