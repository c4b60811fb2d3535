"""The round loop on a :class:`~.engine.StaticEngine`: prefill, then rounds of (catch-up,) draft and verify with one
transfer of ``[a, v]`` per round, the host applying the stopping rules, the streamer and the stats token by token
(:mod:`.host_rules` where processors, criteria or outputs need the host), until every row stops. Plain steps (greedy
AR's every round, the controller's choice of none) run in bursts of up to ``QUEUED_BURST``, each queued before the
host waits for the tokens of the one before (where the next round cannot be queued: up to ``AR_STEPS_PER_SYNC``
steps to a sync). A drafting round of a chain queues the next round's drafts behind its verify step, before the host
reads the round (:meth:`RowsDecoding.queue_drafts`), so that the drafter runs while the host does its bookkeeping."""

from __future__ import annotations

import os
import time

import torch

from .batch_rows import assemble
from .common import _strip_left_padding, _tp_size
from .compile_policy import charge
from .draft_tree import CHAIN, RETRIEVED, SIBLING
from .controller import DraftController
from .engine import AR_STEPS_PER_SYNC, StaticEngine, captures, engine_for
from .graph_steps import static_attention_for, wait_for
from .host_rules import (
    GreedyRules, RowOutput, RowSequence, SpeculativeResult, choose, processed, verify_block, verify_tree,
)
from .model_locks import holding
from .stats import SpecStats

# plain steps per queued burst: the device never waits for the host between queued bursts, so a burst needs only
# to outlast the host's work on the one before (about 0.1-0.2 ms); what a call wastes after its last token is the
# burst queued then and the rest of the burst that held it, up to 2 * QUEUED_BURST - 1 steps
QUEUED_BURST = 4
# where the next round's drafts are queued behind a drafting round's verify step: "cuda" (where the host's time
# between rounds is the device's idle time; QUEUE_DRAFTS_ENV=0 turns it off), or True / False everywhere (the tests
# run it on CPU)
QUEUE_DRAFTS: bool | str = "cuda"
QUEUE_DRAFTS_ENV = "HF_SPARSEKV_QUEUE_DRAFTS"


def _same_draws_on_every_rank(model, device: torch.device) -> None:
    """Tensor parallelism: every rank runs the same rounds and must draw the same tokens, so rank 0 seeds every
    rank's generators (with a fresh seed drawn from its own)."""
    if _tp_size(model) > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        seed = torch.randint(0, 2**62, (1,), device=device)
        torch.distributed.broadcast(seed, src=0)
        torch.manual_seed(int(seed))


class _EventTimer:
    """Seconds between CUDA events recorded around phases, summed once at the end (no sync per phase); and the host's
    own seconds in each phase (:meth:`host_seconds`)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.spans: dict[str, list] = {}
        self.host: dict[str, float] = {}

    def mark(self, name: str, start: bool):
        now = time.perf_counter()
        self.host[name] = self.host.get(name, 0.0) + (now if not start else -now)
        stamp = now  # (on CPU, the host's clock is the device's)
        if self.cuda:
            stamp = torch.cuda.Event(enable_timing=True)
            stamp.record()
        if start:
            self.spans.setdefault(name, []).append([stamp, None])
        else:
            self.spans[name][-1][1] = stamp

    def host_seconds(self, name: str) -> float:
        return self.host.get(name, 0.0)

    def seconds(self, name: str) -> float:
        total = 0.0
        for a, b in self.spans.get(name, []):
            total += (a.elapsed_time(b) / 1000.0) if self.cuda else (b - a)
        return total


class _Tokens:
    """Each row's ``k`` tokens of ``seq [B, L]`` from its position ``n[b]`` on (a finished row's from the live rows'
    span; the caller drops them), followed by ``tail [B, m]``'s row, on their way to the host: one copy of the columns
    the live rows wrote, queued behind the steps that write them (on CUDA into pinned memory, with an event), so that
    the host may queue more steps before it waits for these (:meth:`read`)."""

    def __init__(self, seq: torch.Tensor, n: list[int], k: int, done: list[bool], tail: torch.Tensor | None = None):
        live = [m for m, d in zip(n, done) if not d] or n
        self.n, self.k, self.lo = n, k, min(live)
        self.each: list[float] | None = None  # the steps' own seconds, where the caller timed them
        hi = min(max(live) + k, seq.shape[1])
        self.width = hi - self.lo
        block = seq[:, self.lo : hi] if tail is None else torch.cat([seq[:, self.lo : hi], tail], 1)
        self.block = _HostCopy(block)

    def read(self) -> list:
        """The rows' tokens (the host waits for the copy)."""
        rows = self.block.read()
        return [r[: self.width][max(m - self.lo, 0) : max(m - self.lo, 0) + self.k] + r[self.width :]
                for r, m in zip(rows, self.n)]


class _HostCopy:
    """A device tensor's values as they are now, on their way to the host: on CUDA one copy into pinned memory,
    queued behind the steps that write them, and an event, so that the host may queue more steps before it waits
    (:meth:`read`); elsewhere a copy at once (steps queued after this one write in place at once)."""

    def __init__(self, t: torch.Tensor):
        self.event = None
        if t.is_cuda:
            self.values = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.values.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(t.device))
        else:
            self.values = t.clone()

    def read(self) -> list:
        """The values as a (nested) list; the host waits for the copy."""
        if self.event is not None:
            self.event.synchronize()
        return self.values.tolist()


def draft_cost(engine: StaticEngine) -> float:
    """The controller's prior of a drafting step's cost, as a share of a plain step's, before any is measured:
    retrieval's drafts are a few comparisons (0); a separate drafter's step, its layers over the verifier's (a small
    model's step costs its layers' launches and reads, each about a verifier layer's at a short context); the
    verifier drafting on its own compressed cache or quantized store, one step (1)."""
    if engine.spec.mode == "lookup":
        return 0.0
    drafter = engine.drafter
    if drafter is None or drafter is engine.verifier:
        return 1.0
    layers = [getattr(m.config, "num_hidden_layers", None) for m in (drafter, engine.verifier)]
    return min(layers[0] / layers[1], 1.0) if all(layers) else 1.0


def static_speculative_decode(engine: StaticEngine, prompt: torch.Tensor, rules, streamer=None, prefix=None,
                              streamed_prompt: torch.Tensor | None = None, token_types: torch.Tensor | None = None):
    """Speculative decoding on ``engine`` from ``prompt [1, P]`` under ``rules``: the prompt and its generated tokens
    with their stats (and scores where ``rules`` keep them). ``prefix``: a ``DynamicCache``, empty or holding the
    first tokens of the prompt (prompt caching); it is extended to hold the whole sequence but its last token.
    ``streamed_prompt``: what ``streamer`` gets first, once the prefill has run (a call refused there has streamed
    nothing, so stock's path may serve it). ``token_types [1, P]``: the prompt's ``token_type_ids`` (an engine built
    for them)."""
    result, = static_decode_rows(engine, [prompt], [rules], streamer, None if prefix is None else [prefix],
                                 streamed_prompt, None if token_types is None else [token_types])
    if prefix is not None:
        engine.write_back(prefix, 0, result.sequence.shape[1] - 1)
    return result


def static_decode_rows(engine: StaticEngine, prompts: list[torch.Tensor], rules: list, streamer=None,
                       prefixes: list | None = None, streamed_prompt: torch.Tensor | None = None,
                       token_types: list | None = None) -> list:
    """Decode ``prompts[b] [1, P_b]`` under ``rules[b]`` together, one row of ``engine`` each (``engine.spec.batch ==
    len(prompts)``); one :class:`~.host_rules.SpeculativeResult` per row, each what that prompt alone would give.

    Every round runs all rows (one captured step for the batch) and brings ``[a, v]`` of every row to the host in one
    transfer; a row that has stopped keeps its length (``live``), its tokens are dropped and its steps read only the
    step's own slots of its caches (at long context it costs little more than its share of the weight reads). Per-row
    stats count the row's own rounds while it ran; the seconds are the batch's and are reported by the first row
    only. An engine with host-side rules (``engine.spec.host``) picks the tokens on the host from the verify step's
    logits (:mod:`.host_rules`), and keeps their scores and logits when the rules ask for them
    (``rules[b].keep_scores``)."""
    device = prompts[0].device
    if engine.warpers is not None:
        _same_draws_on_every_rank(engine.verifier, device)
    engine.set_min_length([max(r.min_length, r.prompt_length + r.min_new_tokens) for r in rules],
                          sorted({e for r in rules for e in r.eos_token_ids}))
    decoding = RowsDecoding(engine, prompts, rules, streamer)
    models = [engine.verifier] + ([] if engine.drafter is None else [engine.drafter])
    with torch.no_grad(), static_attention_for(*models, switches=engine.attention_switches), engine.typed_forwards():
        decoding.prefill(prefixes, streamed_prompt, token_types)
        while not all(decoding.done):
            decoding.round()
    return decoding.finish()


class _Round:
    """What one round runs: ``width`` drafts (0: plain steps), verified as a tree or a chain, ``steps`` plain steps to
    a sync (``queued``: as bursts queued ahead of the host's reads), ``rooms``: each row's tokens it may keep."""

    def __init__(self, width: int, tree: bool, queued: bool, steps: int, rooms: list[int]):
        self.width, self.tree, self.queued, self.steps, self.rooms = width, tree, queued, steps, rooms
        self.drafting = width > 0
        self.caught_up = 0  # positions the drafter caught up on before drafting (the controller keeps them apart)
        self.prefilled = 0  # prompt tokens of the drafter's deferred prefill, run in this round


class RowsDecoding:
    """One call's rounds on ``engine`` for ``prompts`` under ``rules`` (:func:`static_decode_rows`): each row's tokens,
    stats and outputs as the rounds run, the controller that picks each round's width, and what the drafter has not
    read. Its phases: :meth:`prefill`, :meth:`round` until every row is ``done``, :meth:`finish`."""

    def __init__(self, engine: StaticEngine, prompts: list[torch.Tensor], rules: list, streamer=None):
        self.engine, self.prompts, self.rules, self.streamer = engine, prompts, rules, streamer
        self.rows = rows = len(prompts)
        self.device = prompts[0].device
        self.timer = _EventTimer(self.device.type == "cuda")
        self.tokens = [RowSequence(prompt) for prompt in prompts]  # (the prompts stay on the device)
        self.stats = [SpecStats() for _ in range(rows)]
        self.done = [False] * rows
        self.host = engine.spec.host
        self.gamma = gamma = engine.spec.gamma
        self.quant = engine.verifier_cache if engine.spec.mode == "int4" else None  # self-speculation's shared store
        self.drafter_store = engine.drafter_cache if engine.spec.mode == "int4-drafter" else None
        self.lookup = engine.spec.mode == "lookup"  # retrieval: drafts come with each step; rows without a match
        # draft nothing
        self.beside = bool(engine.spec.retrieval)  # retrieval beside a drafter: a round with a match verifies a tree
        self.always_tree = engine.grows_tree  # draft_tree_size: every drafting round a tree (whose draft step first
        # feeds the drafter what it has not read, up to γ + 1 tokens: no catch-up step)
        self.sampling = engine.warpers is not None
        self.outputs = [RowOutput(r.keep_scores) for r in rules]
        fixed = 0 if engine.spec.mode == "ar" else None if engine.spec.adaptive else gamma  # "ar": no round drafts
        self.lagging = engine.lagging
        # a separate drafter's chain (the controller's or a constant γ), or int4 self-speculation's: the next drafts
        # queued behind a verify step
        queue = QUEUE_DRAFTS is True or (QUEUE_DRAFTS == "cuda" and self.device.type == "cuda"
                                         and os.environ.get(QUEUE_DRAFTS_ENV, "1") != "0")
        self.queues = queue and engine.drafter is not None and not engine.self_drafting and not (
            self.host or self.lookup or self.beside or self.always_tree or self.drafter_store is not None)
        self.queued_width = 0  # drafts queued for the next round (0: none)
        self.controller = DraftController(gamma, fixed, engine.controller_memory,
                                          (gamma,) if self.always_tree else None,
                                          engine.lag_offsets.numel() if self.lagging else 1, draft_cost(engine))
        self.synchronous = self.device.type != "cuda"  # each step runs as it is called: its own time is measured
        self.retired = None  # how many rows the device's ``live`` last knew finished: a copy only when one finished
        self.found = None  # each row's retrieval match, as the last step reported it (lookup or beside)
        self.catch_up = None  # the drafter's step before the next draft: "catch_up" (one token), "catch_up_block"
        self.behind = [0] * rows  # per row: positions before n - 1 its drafter has not read (rounds without drafts)
        # a separate drafter's cache holds row 0's positions below this: its prefill's, then as of each drafting round
        # (every position before the row's last token, but a last draft all accepted, which it never read)
        self.drafter_upto = 0
        self.last, self.fresh = 0.0, True  # the last round's end; whether this round ran a step first
        self.t0 = self.rounds_from = time.perf_counter()  # the call's start (its prefill's, then its rounds')
        self.capture_seconds = 0.0  # of the rounds' time, the adaptive steps' first captures (after the prefill)

    # --- the prefill ------------------------------------------------------------------------------------------------

    def prefill(self, prefixes: list | None, streamed_prompt: torch.Tensor | None, token_types: list | None) -> None:
        """Every row's prompt into the engine's caches, and its first token."""
        engine, controller, prompts, timer = self.engine, self.controller, self.prompts, self.timer
        # a drafter the controller expects not to use yet reads its prompt only when a round first drafts
        prompt_tokens = sum(p.shape[1] for p in prompts)
        drafter_tokens = sum(engine.drafter_reads(p.shape[1]) for p in prompts)  # (a sink + window: its window)
        defer = engine.defers_drafter and controller.defers(self.room_left(), drafter_tokens)
        firsts = engine.prefill(prompts, self.host_first if self.host else None, prefixes, defer, timer, token_types)
        wait_for(engine.devices)
        self.rounds_from = time.perf_counter()
        self.stats[0].prefill_seconds = self.rounds_from - self.t0
        self.stats[0].prefill_tokens = prompt_tokens - engine.reused
        if "drafter_prefill" in timer.host and not engine.drafter_start:  # its cost, for the next calls' choice to
            # defer it (no extra sync; a chat turn's prefill of its new tokens alone is no sample of a whole prompt's)
            controller.prefill_cost(max(timer.seconds("drafter_prefill"), timer.host_seconds("drafter_prefill")),
                                    drafter_tokens)
        if engine.spec.adaptive:
            captures_from = time.perf_counter()
            engine.capture_widths(controller.widths, self.queues and self.quant is None)  # (int4 queues its own
            # draft steps: :meth:`queue_drafts`)
            self.capture_seconds = time.perf_counter() - captures_from
        controller.deferred = drafter_tokens if engine.drafter_deferred else 0
        if self.streamer is not None and streamed_prompt is not None:
            self.streamer.put(streamed_prompt)
        for row, first in enumerate(firsts):
            self.accept(row, [first])
        self.retire_finished()
        self.found = engine.report[:, -1].tolist() if self.lookup or self.beside else None
        self.drafter_upto = 0 if engine.drafter_deferred else prompts[0].shape[1]
        self.last, self.fresh = time.perf_counter(), True

    # --- one round --------------------------------------------------------------------------------------------------

    def round(self) -> None:
        """One round: its plan, the drafter's steps, then the verify step (or plain steps) and its tokens."""
        plan = self.plan()
        self.draft(plan)
        if plan.queued:
            self.plain_run(plan.steps, self.fresh)
            self.fresh = False
            return
        self.timer.mark("verify", True)
        rounds, each = self.verify(plan)
        self.timer.mark("verify", False)
        self.account(plan, rounds, each)

    def plan(self) -> _Round:
        """The controller's width for this round, within what the rows allow (a retrieval match, a quantized store's
        room), and how its steps run."""
        engine, controller, gamma, done = self.engine, self.controller, self.gamma, self.done
        rooms = [gamma + 1] * self.rows
        matched = self.found is not None and any(f and not d for f, d in zip(self.found, done))  # a live row's match
        allowed = gamma  # the most drafts this round may verify
        if self.lookup and not matched:  # one verifier step when no live row found a match (the report said so)
            allowed = 0
        if self.drafter_store is not None:  # the drafter's forwards this round start at n - 2 (a catch-up) or later
            self.flush(self.drafter_store, -1)
        if self.quant is not None:  # self-speculation: quantize each row up to this round's state, then keep no
            self.flush(self.quant, 0)  # token that would see another state; a round in which no row can keep a
            rooms = [self.quant.room(len(t) - 1) for t in self.tokens]  # draft runs one verifier step instead
            allowed = min(allowed, max(r for r, d in zip(rooms, done) if not d) - 1)
        width = controller.choose(allowed, self.room_left() if controller.deferred else None)  # (a pending prefill
        drafting = width > 0  # asks)
        tree = (self.always_tree and drafting) or (self.beside and matched)  # the round verifies a tree (the drafts,
        # grafted retrieval)
        # plain steps whose tokens alone come back (no retrieval match, no quantization state between them) run as
        # bursts queued ahead of the host's reads
        queued = not drafting and allowed > 0 and not (self.host or tree or self.lookup or self.beside) and (
            self.quant is None)
        steps = 1  # plain steps chosen by the controller run several to a sync (greedy AR: every round)
        if not drafting and allowed > 0 and not (self.host or tree):
            steps = controller.plain_steps(min(QUEUED_BURST if queued else AR_STEPS_PER_SYNC, self.room_left()))
        if drafting and self.quant is not None:
            engine.set_caps([min(r - 1, width) for r in rooms])
        return _Round(width, tree, queued, steps, rooms)

    def draft(self, plan: _Round) -> None:
        """The drafter's steps of a round: a deferred prefill, what it missed, then its drafts."""
        engine, timer, tokens, prompts = self.engine, self.timer, self.tokens, self.prompts
        drafting = plan.drafting
        queued, self.queued_width = self.queued_width, 0
        if drafting and plan.width <= queued:  # queued behind the last verify step (:meth:`queue_drafts`)
            return
        drafter_steps = drafting or self.catch_up is not None  # (else no drafter step runs: no events to record)
        if drafting and engine.drafter_deferred:  # (its seconds count as prefill, not drafting)
            timer.mark("deferred_prefill", True)
            engine.prefill_drafter(prompts)
            timer.mark("deferred_prefill", False)
            plan.prefilled, self.controller.deferred = self.controller.deferred, 0
            self.behind = [0 if d else len(t) - 1 - p.shape[1] for t, p, d in zip(tokens, prompts, self.done)]
        if drafter_steps:
            timer.mark("draft", True)
        behind = self.behind
        plan.caught_up = max(behind) if self.lagging and drafting else 0
        if self.lagging:  # the drafter gets what it missed (rounds without drafts) before it drafts
            if drafting and max(behind) == 1 and not (self.always_tree or engine.self_drafting):
                self.fresh |= engine.run_step("catch_up")
            elif drafting and max(behind) > (self.gamma if self.always_tree else 0 if engine.self_drafting else 1):
                # (a tree's draft step reads up to γ + 1 missed tokens itself; self-drafting copies them)
                engine.held.copy_(torch.tensor([len(t) - 1 - b for t, b in zip(tokens, behind)]), non_blocking=True)
                for _ in range(-(-max(behind) // self.controller.lag_block)):
                    self.fresh |= engine.run_step("catch_up_lag")
            self.behind = behind if not drafting else [0] * self.rows
        elif self.catch_up is not None and (drafting or engine.self_drafting):  # (self-drafting: before a step
            self.fresh |= engine.run_step(self.catch_up)  # without drafts too, which writes the drafter's cache
            self.catch_up = None  # from n - 1)
        if drafting and not self.lookup:
            self.fresh |= engine.run_step("draft", plan.width)
        if drafter_steps:
            timer.mark("draft", False)

    def verify(self, plan: _Round) -> tuple[list, list[float] | None]:
        """The round's verify step (or ``plan.steps`` plain steps): each row's (accepted, emitted, kind of the last
        node kept), and where steps run as they are called, plain steps' own seconds."""
        engine, tokens, done = self.engine, self.tokens, self.done
        width, tree, steps = plan.width, plan.tree, plan.steps
        if self.host:
            self.fresh |= engine.run_step("tree_logits" if tree else "verify_logits" if plan.drafting else "ar_logits",
                                          width or None)
            rounds = self.host_round(width, plan.rooms, tree)
            self.found = engine.report[:, -1].tolist() if self.lookup or self.beside else None
            return rounds, None
        start = time.perf_counter()
        self.fresh |= engine.run_step("verify_tree" if tree else "verify" if plan.drafting else "ar_step",
                                      width or None)
        each = [time.perf_counter() - start] if self.synchronous and not plan.drafting else None
        for i in range(1, steps):
            if self.quant is not None:  # each plain step sees its own quantization state (known on the host)
                self.flush(self.quant, i)
            self.fresh, step_seconds = self.timed_plain(1, self.fresh)
            each = None if each is None else each + step_seconds
        if steps > 1 and (self.lookup or self.beside):  # each row's tokens from its n on, and the match
            new = _Tokens(engine.seq, [len(t) for t in tokens], steps, done, engine.report[:, -1:]).read()
            self.found = [r[-1] for r in new]
            return [(0, new[row][:-1], CHAIN) for row in range(self.rows)], each
        if steps > 1:  # (int4 self-speculation's plain steps)
            new = _Tokens(engine.seq, [len(t) for t in tokens], steps, done).read()
            return [(0, new[row], CHAIN) for row in range(self.rows)], each
        if (self.queues and plan.drafting and not tree and self.room_left() > width + 1
                and self.controller.expects_to_draft(width) and (self.quant is None or self.state_holds(width))):
            on_its_way = _HostCopy(engine.report)
            self.queue_drafts(width)
            report = on_its_way.read()  # the round's one sync, for this round's report alone
        else:
            report = engine.report.tolist()  # the round's one sync
        self.found = [r[-1] for r in report]
        return [(r[0], r[1 : r[0] + 2], r[-2] if tree else CHAIN) for r in report], each

    def queue_drafts(self, width: int) -> None:
        """Behind this round's verify step, before the host reads it: the next round's ``width`` drafts (this round's
        width, where the controller expects to draft it again). Their first step reads ``seq[n-2]`` and ``seq[n-1]``
        (the former the last draft of a round that accepted every draft, which the drafter never read; else a token
        it read, the same keys written again), every position read from the device. The next round verifies them
        where it drafts at most ``width`` (:meth:`draft`), and else drafts again (or steps plainly); either way the
        drafter has then read every position before ``n - 1``. int4 self-speculation's store already holds every
        position before ``n - 1`` (the verify step wrote them): its queued drafts are a plain draft step, from
        ``seq[n-1]``, where the quantization state holds (:meth:`state_holds`)."""
        timer = self.timer
        timer.mark("verify", False)
        timer.mark("draft", True)
        self.fresh |= self.engine.run_step("draft" if self.quant is not None else "queued_draft", width)
        timer.mark("draft", False)
        timer.mark("verify", True)
        self.queued_width = width

    def state_holds(self, width: int) -> bool:
        """int4 self-speculation, before the host reads this round's tokens: whether every live row, whatever this
        round accepts (at most its cap), starts the next round in the quantization state this round ran in, with room
        for ``width`` drafts, so that the next round's drafts may run now (nothing to quantize before them, and the
        same caps). A row's next round starts at most cap + 1 positions on, where its room shrinks by as many."""
        caps = self.engine.caps_held
        return all(self.quant.room(len(tokens) - 1) >= caps[row] + width + 2
                   for row, tokens in enumerate(self.tokens) if not self.done[row])

    def account(self, plan: _Round, rounds: list, each: list[float] | None) -> None:
        """Each live row's tokens and stats of the round, what its drafter must read next, and the round's cost to
        the controller."""
        engine, stats = self.engine, self.stats
        width, steps, drafting = plan.width, plan.steps, plan.drafting
        live = [row for row in range(self.rows) if not self.done[row]]
        for row in live:
            a, emitted, kind = rounds[row]
            before = stats[row].new_tokens
            self.accept(row, emitted)
            ran = 1 if steps == 1 else stats[row].new_tokens - before  # a row's plain steps up to its stop
            stats[row].rounds += ran
            stats[row].drafted += width
            stats[row].accepted += a
            stats[row].width_rounds[width] = stats[row].width_rounds.get(width, 0) + ran
            stats[row].retrieved_rounds += kind == RETRIEVED
            stats[row].sibling_rounds += kind == SIBLING
            # the drafter never read the last draft of a round that accepted every draft (the shared store of
            # self-speculation holds every token, and a self-drafting verify step writes the drafter's cache), nor
            # the tokens of a kept path off the chain; feeding it again to the other rows rewrites what they hold
            unread = int(a == width and not self.queued_width)  # (a queued draft read it)
            if drafting and row == 0:  # (a row done this round read as far: its kept tokens are no more)
                self.drafter_upto = len(self.tokens[0]) - 1 - unread
            if (self.quant is not None or engine.drafter is None or self.done[row]
                    or (self.always_tree and not self.lagging)):
                continue
            if self.lagging:  # (a tree round: its draft step read up to the root; the kept tokens after it are new;
                # a self-drafting verify step wrote the drafter's cache)
                self.behind[row] += (steps if not drafting else 0 if engine.self_drafting
                                     else a if self.always_tree else unread)
            elif kind != CHAIN:
                self.catch_up = "catch_up_block"
            elif drafting and unread and self.catch_up is None and not (engine.self_drafting and not plan.tree):
                self.catch_up = "catch_up"  # (a self-drafting chain's verify step wrote the drafter's cache; a
                # tree's did not)
        now = time.perf_counter()
        self.controller.observe(width, [rounds[row][0] for row in live],
                                None if self.fresh else (now - self.last) / steps, steps, plan.caught_up,
                                plan.prefilled, self.shared(each, now - self.last) if steps > 1 else None)
        self.last, self.fresh = now, False
        self.retire_finished()

    # --- plain steps queued in bursts ---------------------------------------------------------------------------

    def timed_plain(self, k: int, new: bool = False) -> tuple[bool, list[float] | None]:
        """``k`` plain verifier steps; whether one was new (captured in this call), and where steps run as they are
        called (:attr:`synchronous`), the seconds of each (else None)."""
        each = []
        for _ in range(k):
            start = time.perf_counter()
            new |= self.engine.run_step("ar_step")
            each.append(time.perf_counter() - start)
        return new, each if self.synchronous else None

    def launch_plain(self, k: int, n: list[int]) -> tuple[_Tokens, bool]:
        """``k`` plain verifier steps from each row's position ``n[b]``, and their tokens on their way to the host
        (with the steps' own seconds where they ran synchronously, ``each``); whether the step was new."""
        new, each = self.timed_plain(k)
        tokens = _Tokens(self.engine.seq, n, k, self.done)
        tokens.each = each
        return tokens, new

    def plain_run(self, steps: int, fresh: bool) -> None:
        """Plain steps, ``steps`` (at most ``QUEUED_BURST``) first, then more while the controller's choice of plain
        steps stands (greedy AR: until every row stops) and every live row has room for them: each burst of up to
        ``QUEUED_BURST`` is queued before the host waits for the tokens of the one before, so that the device does not
        wait for the host between bursts. Each burst is a round of the controller's (its time per step observed)."""
        stats, done = self.stats, self.done
        self.timer.mark("verify", True)
        burst, new = self.launch_plain(steps, [len(t) for t in self.tokens])
        fresh |= new
        carried = 0.0  # the host seconds of queueing this burst, spent before ``last`` (in the round before)
        while burst is not None:
            live = [row for row in range(self.rows) if not done[row]]
            room = min(self.rules[row].max_length - len(self.tokens[row]) for row in live) - burst.k
            more = min(self.controller.plain_ahead(burst.k, QUEUED_BURST), room)
            queued = time.perf_counter()
            following = self.launch_plain(more, [m + burst.k for m in burst.n])[0] if more > 0 else None
            queued = time.perf_counter() - queued  # (a step runs as it is queued where nothing is asynchronous)
            new = burst.read()
            for row in live:
                before = stats[row].new_tokens
                self.accept(row, new[row])
                ran = stats[row].new_tokens - before  # the row's steps up to its stop
                stats[row].rounds += ran
                stats[row].width_rounds[0] = stats[row].width_rounds.get(0, 0) + ran
                if self.lagging and not done[row]:  # its drafter missed these positions
                    self.behind[row] += burst.k
            now = time.perf_counter()
            seconds = now - self.last - queued + carried  # this burst's time, not the next one's queueing
            self.controller.observe(0, [0] * len(live), None if fresh else seconds / burst.k, burst.k,
                                    each=self.shared(burst.each, seconds))
            self.last, fresh, carried = now, False, queued
            self.retire_finished()
            burst = None if all(done) else following  # (a burst queued past every row's stop is left to run)
        self.timer.mark("verify", False)

    @staticmethod
    def shared(each: list[float] | None, seconds: float) -> list[float] | None:
        """Each plain step's own seconds with an even share of the rest of the round's ``seconds`` (its host work)."""
        if each is None:
            return None
        rest = max(seconds - sum(each), 0.0) / len(each)
        return [t + rest for t in each]

    # --- the rows' tokens -------------------------------------------------------------------------------------------

    def accept(self, row: int, new: list[int]) -> None:
        """Row ``row``'s new tokens, up to its stop (which marks it ``done``)."""
        rules, stats, tokens = self.rules, self.stats, self.tokens
        for token in new:
            tokens[row].append(token)
            stats[row].new_tokens += 1
            if self.streamer is not None:
                self.streamer.put(torch.tensor([token]))
            kept = self.outputs[row].scores[: stats[row].new_tokens] if rules[row].keep_scores else None
            if rules[row].stop_token(tokens[row], None if kept is None else tuple(kept)):  # scores as stock
                self.done[row] = True
                return

    def host_first(self, row: int, raw: torch.Tensor) -> int:
        scores = processed(self.rules[row], self.prompts[row], raw, self.sampling)
        self.outputs[row].add([scores], [raw])
        return choose(scores, self.sampling)

    def host_round(self, width: int, rooms: list[int], tree: bool) -> list[tuple[int, list[int], int]]:
        """Each live row's (accepted, emitted, kind of the last node kept) from the logits the verify step of
        ``width`` drafts left; committed on the device."""
        engine = self.engine
        drafting = width > 0
        drafts = engine.drafts.tolist() if drafting else [[] for _ in range(self.rows)]
        nodes = engine.nodes.tolist() if tree else None  # [5, B, N+1]: tokens, parents, depths, bits, kinds
        results, kept = [], []
        for row in range(self.rows):
            if self.done[row]:
                results.append((0, [], CHAIN))
                kept.append(0)
                continue
            q = engine.q[row] if self.sampling and drafting else None
            rules, tokens = self.rules[row], self.tokens[row]
            if tree:
                a, emitted, scores, raw, node = verify_tree(rules, tokens, nodes[0][row], nodes[1][row],
                                                            engine.logits[row], q, self.gamma)
                kept.append(node)
                kind = nodes[4][row][node]
            else:
                room = min(rooms[row] - 1, width)
                (a, emitted, scores, raw), kind = verify_block(rules, tokens, drafts[row], engine.logits[row], q,
                                                               room), CHAIN
            self.outputs[row].add(scores, raw)
            results.append((a, emitted, kind))
        engine.commit([e for _, e, _ in results], [a for a, _, _ in results], kept if tree else None)
        return results

    def flush(self, store, ahead: int) -> None:
        """Bring a quantized store's live rows to the state of a step that starts ``ahead`` past their last token."""
        for row in range(self.rows):
            if not self.done[row]:
                store.flush_to(len(self.tokens[row]) - 1 + ahead, row)

    def room_left(self) -> int:
        """The most tokens a live row may still generate."""
        return max(r.max_length - len(t) for r, t, d in zip(self.rules, self.tokens, self.done) if not d)

    def retire_finished(self) -> None:
        if self.retired != sum(self.done):
            self.engine.live.copy_(torch.tensor([0 if d else 1 for d in self.done]), non_blocking=True)
            self.retired = sum(self.done)

    # --- the end ----------------------------------------------------------------------------------------------------

    def finish(self) -> list:
        """The engine's state for the next call (what the drafter holds), the stats' seconds, and each row's
        :class:`~.host_rules.SpeculativeResult`."""
        engine, stats, timer = self.engine, self.stats, self.timer
        engine.prompt_queries = []  # (a deferred self-drafter's kept queries: none past the call)
        if engine.keeps_drafter_prefix and not engine.drafter_deferred:  # what the drafter read of row 0's sequence,
            # less a margin of one (the next call's prefill reads one token more)
            engine.drafter_holds = max(0, self.drafter_upto - 1)
        stats[0].drafter_prefill_tokens = engine.drafter_prefill_tokens
        wait_for(engine.devices)
        stats[0].rounds_seconds = time.perf_counter() - self.rounds_from - timer.seconds("deferred_prefill")
        if engine.spec.compiled and (engine.light or not engine.compiled):  # toward compiling them (more)
            charge(engine.verifier, stats[0].rounds_seconds - self.capture_seconds, light=engine.compiled)
        stats[0].prefill_seconds += timer.seconds("deferred_prefill")
        stats[0].draft_seconds = timer.seconds("draft")
        stats[0].verify_seconds = timer.seconds("verify")
        if self.streamer is not None:
            self.streamer.end()
        # each row: its prompt (on the device already) and its new tokens (only these converted from the host's list: a
        # whole 16K-token sequence took 1.8 ms on a CPU core, 128K 15 ms)
        device = self.device
        return [SpeculativeResult(torch.cat([p, torch.tensor([t.new], dtype=p.dtype, device=device)], 1), st,
                                  out.scores[: len(t.new)], out.logits[: len(t.new)])
                for t, st, out, p in zip(self.tokens, stats, self.outputs, self.prompts)]


@holding("model")
def graph_greedy_generate(model, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id=None,
                          attention_mask: torch.Tensor | None = None, pad_token_id: int | None = None) -> torch.Tensor:
    """Greedy AR on the static engine: one verifier step per token, replayed as a CUDA graph on CUDA, one host sync
    per burst of ``QUEUED_BURST`` tokens, the next burst queued first. ``input_ids [B, L]`` (a batch left-padded,
    with its ``attention_mask``) -> ``[B, L + n]``: each row stops at EOS or after ``max_new_tokens`` and is
    token-identical to ``model.generate(row, do_sample=False, max_new_tokens=...)`` of its unpadded prompt alone,
    followed by ``pad_token_id`` (default: the model's, else the first EOS id) where it stopped before the longest
    row. The rows run together, one engine row each. The call holds ``model``'s lock (:mod:`.model_locks`)."""
    if input_ids.dim() != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [B, L] with B, L >= 1, got shape {tuple(input_ids.shape)}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                         f"{tuple(input_ids.shape)}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if eos_token_id is None:
        eos_token_id = model.generation_config.eos_token_id
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if pad_token_id is None:
        pad_token_id = model.generation_config.pad_token_id
    if pad_token_id is None and eos:
        pad_token_id = eos[0]
    prompts = [
        _strip_left_padding(input_ids[b : b + 1], None if attention_mask is None else attention_mask[b : b + 1])
        .to(model.device) for b in range(input_ids.shape[0])
    ]
    rules = [GreedyRules(prompt_length=p.shape[1], max_length=p.shape[1] + max_new_tokens, eos_token_ids=eos)
             for p in prompts]
    engine = engine_for(model, None, "ar", None, 1, max(r.max_length for r in rules), max_new_tokens,
                        use_graphs=captures(model), batch=len(prompts))
    results = static_decode_rows(engine, prompts, rules)
    sequences = [torch.cat([input_ids[b : b + 1].to(model.device), res.sequence[:, p.shape[1] :]], 1)
                 for b, (p, res) in enumerate(zip(prompts, results))]
    return assemble(sequences, [res.stats for res in results], pad_token_id, False, None)
