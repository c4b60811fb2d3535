"""Causal-LM pretraining of the bundled models from a flat token stream: resumable, time- or step-budgeted.

The train stream is the train split's documents joined with EOS (uint16). Each step draws ``batch`` random windows
of ``seq_len + 1`` tokens; the window starts come from a generator seeded by ``(seed, step)``, so a resumed run
sees exactly the batches an uninterrupted one would. The learning rate warms up linearly, then follows a cosine to
``min_lr_ratio``; its progress is ``step / max_steps`` or, with a time budget, the fraction of the budget spent
(checkpointed, so it survives a restart). Phases switch the sequence length by progress (e.g. 4K, then 16K).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm


@dataclass
class Phase:
    until: float  # progress in (0, 1] at which this phase ends
    seq_len: int
    batch: int


@dataclass
class PretrainConfig:
    phases: list[Phase]
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    max_steps: int | None = None  # exactly one of max_steps / minutes
    minutes: float | None = None
    eval_every: int = 100
    checkpoint_every: int = 200
    eval_windows: int = 8

    def __post_init__(self):
        if (self.max_steps is None) == (self.minutes is None):
            raise ValueError("give exactly one of max_steps and minutes")
        self.phases = [p if isinstance(p, Phase) else Phase(**p) for p in self.phases]
        if not self.phases or self.phases[-1].until < 1.0:
            raise ValueError("the last phase must end at progress 1.0")


def _windows(tokens: np.ndarray, seq_len: int, batch: int, rng: np.random.Generator) -> torch.Tensor:
    if len(tokens) <= seq_len + 1:
        raise ValueError(f"token stream of {len(tokens)} is too short for windows of {seq_len + 1}")
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch)
    return torch.from_numpy(np.stack([tokens[s : s + seq_len + 1].astype(np.int64) for s in starts]))


def _lr_factor(cfg: PretrainConfig, step: int, progress: float) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


@torch.no_grad()
def heldout_loss(model, eval_tokens: np.ndarray, seq_len: int, windows: int, device) -> float:
    """Mean next-token loss over ``windows`` evenly spaced windows of the eval stream (bf16 autocast on CUDA)."""
    model.eval()
    starts = np.linspace(0, len(eval_tokens) - seq_len - 2, windows).astype(np.int64)
    total = 0.0
    for s in starts:
        ids = torch.from_numpy(eval_tokens[s : s + seq_len + 1].astype(np.int64))[None].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(ids[:, :-1]).logits
        total += torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten()).item()
    model.train()
    return total / windows


def pretrain(model, train_tokens: np.ndarray, eval_tokens: np.ndarray, cfg: PretrainConfig, work_dir: str | Path,
             device: str | torch.device = "cuda", deadline_s: float | None = None, name: str = "model") -> dict:
    """Train ``model`` in place; checkpoints and ``log.jsonl`` in ``work_dir``; resumes from ``work_dir/state.pt``.

    Returns the run summary (steps, tokens seen, seconds, last held-out loss). ``deadline_s`` (wall seconds from
    the call) stops early with a checkpoint, to be resumed by a later call.
    """
    device = torch.device(device)
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda",
    )
    state_path = work / "state.pt"
    step, tokens_seen, spent = 0, 0, 0.0
    if state_path.exists():
        state = torch.load(state_path, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, tokens_seen, spent = state["step"], state["tokens_seen"], state["seconds"]
        print(f"[{name}] resumed at step {step} ({tokens_seen:,} tokens, {spent:.0f}s)")

    def progress() -> float:
        return step / cfg.max_steps if cfg.max_steps is not None else spent / (cfg.minutes * 60)

    def save():
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                    "tokens_seen": tokens_seen, "seconds": spent, "config": asdict(cfg)}, state_path)

    log = (work / "log.jsonl").open("a")
    start = time.perf_counter()
    bar = tqdm(desc=name, total=cfg.max_steps, initial=step, unit="step", dynamic_ncols=True)
    last_eval = float("nan")
    while progress() < 1.0:
        if deadline_s is not None and time.perf_counter() - start > deadline_s:
            print(f"[{name}] deadline reached at step {step}; checkpoint saved, run again to resume")
            break
        t0 = time.perf_counter()
        phase = next(p for p in cfg.phases if progress() < p.until)
        batch = _windows(train_tokens, phase.seq_len, phase.batch, np.random.default_rng([cfg.seed, step])).to(device)
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * _lr_factor(cfg, step, progress())
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += batch[:, :-1].numel()
        loss_value = loss.item()  # synchronizes, so the step time below is real
        spent += time.perf_counter() - t0
        record = {"step": step, "loss": loss_value, "grad_norm": float(grad_norm), "lr": optimizer.param_groups[0]["lr"],
                  "seq_len": phase.seq_len, "tokens_seen": tokens_seen, "seconds": round(spent, 2)}
        if step % cfg.eval_every == 0:
            last_eval = heldout_loss(model, eval_tokens, phase.seq_len, cfg.eval_windows, device)
            record["heldout_loss"] = last_eval
        log.write(json.dumps(record) + "\n")
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}", heldout=f"{last_eval:.3f}", T=phase.seq_len,
                        tok_s=f"{tokens_seen / max(spent, 1e-9):,.0f}")
        if step % cfg.checkpoint_every == 0:
            save()
    bar.close()
    save()
    final = heldout_loss(model, eval_tokens, cfg.phases[-1].seq_len, cfg.eval_windows, device)
    summary = {"name": name, "steps": step, "tokens_seen": tokens_seen, "train_seconds": round(spent, 1),
               "heldout_loss": final, "finished": progress() >= 1.0, "device": torch.cuda.get_device_name(device)
               if device.type == "cuda" else "cpu", "config": asdict(cfg)}
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    log.close()
    return summary
