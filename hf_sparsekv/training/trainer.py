"""BudgetDraftTrainer: BudgetDraft's multi-view sparse training of a drafter against a frozen verifier (Alg. 1).

One step on one sequence ``x [1, T]`` (P = T − C):

1. teacher targets: the verifier prefills ``x[:P]`` (chunked) and greedy-decodes the continuation positions (no grad);
2. drafter prefix prefill (chunked, no grad, ``"sparsekv"`` attention, queries recorded for the chunk scores);
3. full-cache branch: continuation forward on the full prefix view → L_A (backward at once, so only one branch's
   graph is alive at a time; under DDP this backward runs without gradient sync);
4. sparse branch: B ~ Cat(budgets, weights), the prefix cut to its top ⌊B/s⌋ chunks by the inference cache's own
   selection, continuation forward at real positions P..T−1 → λ·L_C (backward, gradients synced);
5. clip, AdamW step, scheduler step. The summed gradients are those of L = L_A + λ·L_C (Eq. 4).

The verifier is frozen (``requires_grad=False``, eval mode) and never handed to the optimizer. Multi-GPU: run the same
script under ``accelerate launch``; each process takes every ``world``-th sequence and DDP averages the gradients;
end the script with :meth:`BudgetDraftTrainer.end_training`.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator

from .. import attention
from .checkpoint import STATE_JSON, checkpoint_dir, load_model_weights, load_state
from .checkpoint import save_checkpoint as write_checkpoint
from .budgets import BudgetSampler
from .config import TrainingConfig
from .evaluate import acceptance_table, measure_acceptance
from .objective import autocast, continuation_logits, teacher_targets, top1_loss
from .views import prefill_prefix


def warmup_cosine(warmup_steps: int, max_steps: int) -> Callable[[int], float]:
    """LR factor for optimizer step ``i`` (0-based): linear warm-up (i+1)/warmup over the first ``warmup_steps``
    steps (so the first step already learns), then cosine decay from 1 towards 0 at ``max_steps``."""

    def factor(i: int) -> float:
        if i < warmup_steps:
            return (i + 1) / warmup_steps
        progress = min(1.0, (i - warmup_steps) / max(1, max_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


@dataclass
class StepResult:
    """What one optimizer step did. ``loss`` = L_A + λ·L_C (or L_A alone for ``la-only``); ``agreement_*`` = fraction
    of continuation positions where the branch's argmax equals the teacher target, before the update."""

    step: int
    loss: float
    loss_a: float
    loss_c: float | None
    budget: int | None
    agreement_a: float
    agreement_c: float | None
    lr: float
    grad_norm: float


@dataclass
class EvalSettings:
    """Held-out acceptance measured during training (see :func:`~.evaluate.measure_acceptance`)."""

    prompts: list[torch.Tensor]
    contexts: list[int]
    budgets: list[int | None] = field(default_factory=lambda: [256, 512, 1024, 2048])
    gamma: int = 5
    max_new_tokens: int = 64
    every: int = 0  # steps between evaluations; 0: only at the start and the end
    at_start: bool = True


class BudgetDraftTrainer:
    """Trains ``drafter`` in place. ``verifier`` and ``drafter`` must share the vocabulary; both are moved to the
    accelerator's device. The drafter is switched to the ``"sparsekv"`` attention (what inference uses)."""

    def __init__(self, verifier, drafter, config: TrainingConfig, accelerator: Accelerator | None = None, tokenizer=None):
        if verifier is drafter:
            raise ValueError("the drafter must be a separate model from the verifier")
        v_vocab = verifier.config.get_text_config().vocab_size
        d_vocab = drafter.config.get_text_config().vocab_size
        if v_vocab != d_vocab:
            raise ValueError(f"verifier vocab_size {v_vocab} != drafter vocab_size {d_vocab}: they must share a tokenizer")
        self.config = config
        self.accelerator = accelerator if accelerator is not None else Accelerator()
        self.device = self.accelerator.device
        self.tokenizer = tokenizer

        self.verifier = verifier.to(self.device).eval()
        self.verifier.requires_grad_(False)
        drafter = drafter.to(self.device)
        drafter.set_attn_implementation(attention.NAME)
        drafter.train()
        if config.gradient_checkpointing:
            enable = getattr(drafter, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                drafter.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            # Our continuation views never write on update, so a layer replayed in backward reads the same prefix.
            for module in drafter.modules():
                if hasattr(module, "_can_checkpoint_with_cache"):
                    module._can_checkpoint_with_cache = True
        params = [p for p in drafter.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the drafter has no trainable parameters")
        optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(config.warmup_steps, config.max_steps))
        self.drafter, self.optimizer = self.accelerator.prepare(drafter, optimizer)
        self.sampler = BudgetSampler(config.budgets, config.budget_weights, seed=config.seed)
        self.step = 0
        self.history: dict = {"steps": [], "eval": []}

    # ------------------------------------------------------------------ one step
    @property
    def model(self):
        """The drafter itself (not the DDP wrapper)."""
        return self.accelerator.unwrap_model(self.drafter)

    def end_training(self) -> None:
        """Call last in a run under several processes: waits for every process, drops the DDP wrapper (its reducer
        holds the process group) and the optimizer, then destroys the process group, so that no communication
        thread is left for interpreter exit to tear down (gloo can abort a process there). ``self.model`` (the
        trained drafter) stays usable; training further does not. On one process only the wait and the drop."""
        self.accelerator.wait_for_everyone()
        self.drafter, self.optimizer, self.scheduler = self.model, None, None
        self.accelerator.free_memory()
        self.accelerator.end_training()

    def _sequence(self, sequence: torch.Tensor) -> torch.Tensor:
        if not isinstance(sequence, torch.Tensor) or sequence.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"a training sequence must be an integer tensor of token ids, got {type(sequence).__name__}"
                             f"{'' if not isinstance(sequence, torch.Tensor) else ' of ' + str(sequence.dtype)}")
        if sequence.dim() == 1:
            sequence = sequence.unsqueeze(0)
        if sequence.dim() != 2 or sequence.shape != (1, self.config.seq_len):
            raise ValueError(
                f"a training sequence must have shape [{self.config.seq_len}] or [1, {self.config.seq_len}] "
                f"(seq_len), got {tuple(sequence.shape)}"
            )
        return sequence.long().to(self.device)

    def accumulate_gradients(self, sequence: torch.Tensor, budget: int | None = None) -> dict:
        """Alg. 1 steps 1–4 on one sequence of ``seq_len`` tokens: adds ∇(L_A + λ·L_C) to the drafter's ``.grad``
        (no optimizer step). ``budget`` overrides the sampled one (tests, analysis). Returns the loss terms."""
        cfg = self.config
        seq = self._sequence(sequence)
        p = cfg.prefix_len
        continuation = seq[:, p:]
        with autocast(self.device, cfg.bf16):
            targets = teacher_targets(self.verifier, seq, p, cfg.prefill_chunk)
            prefix = prefill_prefix(self.model, seq[:, :p], cfg.prefill_chunk)

        sync_later = self.accelerator.no_sync(self.drafter) if cfg.uses_sparse_branch else nullcontext()
        with sync_later:
            with autocast(self.device, cfg.bf16):
                logits_a = continuation_logits(self.drafter, continuation, prefix.full_view(), p)
            loss_a, agreement_a = top1_loss(logits_a, targets)
            self.accelerator.backward(loss_a)
        del logits_a
        terms = dict(loss_a=float(loss_a.detach()), loss_c=None, budget=None, agreement_a=agreement_a, agreement_c=None)
        if cfg.uses_sparse_branch:
            budget = self.sampler.sample() if budget is None else budget
            view = prefix.sparse_view(budget, cfg.chunk_size, cfg.per_kv_head, cfg.score_window, cfg.selection)
            with autocast(self.device, cfg.bf16):
                logits_c = continuation_logits(self.drafter, continuation, view.cache, p)
            loss_c, agreement_c = top1_loss(logits_c, targets)
            self.accelerator.backward(cfg.lam * loss_c)
            terms.update(loss_c=float(loss_c.detach()), budget=budget, agreement_c=agreement_c)
        terms["loss"] = terms["loss_a"] + (cfg.lam * terms["loss_c"] if terms["loss_c"] is not None else 0.0)
        return terms

    def train_step(self, sequence: torch.Tensor, budget: int | None = None) -> StepResult:
        """One optimizer step (Alg. 1 step 5): gradients of one sequence, clip, AdamW, scheduler."""
        terms = self.accumulate_gradients(sequence, budget)
        grad_norm = self.accelerator.clip_grad_norm_(self.drafter.parameters(), self.config.clip_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return StepResult(step=self.step, lr=lr, grad_norm=float(grad_norm), **terms)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, settings: EvalSettings) -> dict:
        """Held-out acceptance of the current drafter (see :func:`measure_acceptance`)."""
        return measure_acceptance(
            self.verifier, self.model, settings.prompts, settings.contexts, settings.budgets,
            gamma=settings.gamma, max_new_tokens=settings.max_new_tokens,
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        state = {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "history": self.history,
        }
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        return state

    def save_checkpoint(self, path: str | Path) -> Path | None:
        """Write a resumable checkpoint (main process only; every process waits for it)."""
        written = None
        if self.accelerator.is_main_process:
            public = {"step": self.step, "config": self.config.to_dict(), "eval": self.history["eval"]}
            written = write_checkpoint(path, self.model, self.state_dict(), public, self.tokenizer)
        self.accelerator.wait_for_everyone()
        return written

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore the drafter weights, optimizer, scheduler, budget sampler, RNG and step from ``path``."""
        state = load_state(path)
        saved = json.loads((Path(path) / STATE_JSON).read_text()).get("config", {})
        for key in ("seq_len", "continuation_len", "budgets", "budget_weights", "loss", "chunk_size"):
            if key in saved and saved[key] != getattr(self.config, key):
                raise ValueError(
                    f"checkpoint {path} was trained with {key}={saved[key]!r}, this run has {getattr(self.config, key)!r}"
                )
        load_model_weights(self.model, path)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        self.step = int(state["step"])
        self.history = state["history"]

    # ------------------------------------------------------------------ the loop
    def _log(self, output_dir: Path | None, record: dict) -> None:
        if output_dir is not None and self.accelerator.is_main_process:
            with open(output_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record, default=str) + "\n")

    def _run_eval(self, settings: EvalSettings, output_dir: Path | None, say: Callable[[str], None]) -> None:
        if self.accelerator.is_main_process:
            results = self.evaluate(settings)
            record = {"step": self.step, "acceptance": results}
            self.history["eval"].append(record)
            self._log(output_dir, {"event": "eval", **record})
            table = acceptance_table(results)
            say(f"step {self.step} held-out acceptance: " + "; ".join(
                f"ctx {c}: " + ", ".join(f"B={b} {a:.3f}" for b, a in row.items()) for c, row in table.items()
            ))
        self.accelerator.wait_for_everyone()

    def train(
        self,
        sequences: Iterable[torch.Tensor],
        output_dir: str | Path | None = None,
        eval_settings: EvalSettings | None = None,
        save_every: int = 0,
        progress: bool = True,
        skip_consumed: bool = True,
    ) -> dict:
        """Train until ``config.max_steps`` (or the sequences run out). Returns ``self.history``.

        Each process takes every ``num_processes``-th sequence; after :meth:`load_checkpoint` the first ``step``
        sequences of this process's share are skipped (``skip_consumed``), so the same stream resumes where it was.
        Writes ``metrics.jsonl`` and ``checkpoint-<step>/`` (every ``save_every`` steps, and at the end) under
        ``output_dir`` when given.
        """
        from tqdm.auto import tqdm

        acc = self.accelerator
        out = Path(output_dir) if output_dir is not None else None
        if out is not None and acc.is_main_process:
            out.mkdir(parents=True, exist_ok=True)
        stream = iter(sequences)
        if acc.num_processes > 1:
            stream = itertools.islice(stream, acc.process_index, None, acc.num_processes)
        if skip_consumed and self.step:
            stream = itertools.islice(stream, self.step, None)
        bar = tqdm(total=self.config.max_steps, initial=self.step, disable=not (progress and acc.is_main_process),
                   desc="budgetdraft", dynamic_ncols=True)
        say = bar.write if not bar.disable else (lambda s: None)
        if eval_settings is not None and eval_settings.at_start and self.step == 0:
            self._run_eval(eval_settings, out, say)
        while self.step < self.config.max_steps:
            sequence = next(stream, None)
            if sequence is None:
                say(f"data exhausted after {self.step} steps")
                break
            result = self.train_step(sequence)
            if not math.isfinite(result.loss):
                raise FloatingPointError(f"loss is {result.loss} at step {result.step}")
            record = asdict(result)
            self.history["steps"].append(record)
            self._log(out, {"event": "step", "time": time.time(), **record})
            postfix = {"loss": f"{result.loss:.3f}", "L_A": f"{result.loss_a:.3f}", "lr": f"{result.lr:.2e}"}
            if result.loss_c is not None:
                postfix.update({"L_C": f"{result.loss_c:.3f}", "B": result.budget})
            bar.set_postfix(postfix, refresh=False)
            bar.update(1)
            last = self.step >= self.config.max_steps
            if eval_settings is not None and eval_settings.every and self.step % eval_settings.every == 0 and not last:
                self._run_eval(eval_settings, out, say)
            if out is not None and save_every and self.step % save_every == 0 and not last:
                self.save_checkpoint(checkpoint_dir(out, self.step))
        bar.close()
        if eval_settings is not None:
            self._run_eval(eval_settings, out, say)
        if out is not None:
            self.save_checkpoint(checkpoint_dir(out, self.step))
        return self.history
