"""The draft-length controller: before each round it picks how many tokens to draft, ``g`` (0: a plain verifier step),
to maximise the expected tokens per second

    E[tokens | g] / t(g),   E[tokens | g] = 1 + sum_{k=1..g} prod_{i<=k} p_i

from what the host already has after each round's one sync: the round's wall-clock seconds (draft, verification and
host work together, so nothing is synchronised for timing) and each live row's accepted length.

* ``p_i``: the probability that draft i is accepted once drafts 1..i-1 were: that depth's acceptances over its trials,
  both counted with an exponential decay (a round with ``a`` of ``g`` accepted tried depths 1..min(a+1, g)), shrunk
  towards the rate pooled over all depths by ``SHRINK`` trials, so a depth rarely tried follows the pooled rate
  instead of an old estimate that no round corrects. A call starts from each depth's rate over the earlier calls
  (decayed by ``LONG_DECAY`` a trial), weighing ``CALL_PRIOR`` trials, not from where the last call ended: its text
  is new, and the end of one document is a poor guess of the next one's start.
* ``t(g)``: each width's time is the low quantile of its last ``WINDOW`` measured round seconds (:func:`low`: the
  least of up to four, the second least of five to eight). Noise only adds time (a host hiccup, another process on
  the core, a thread waiting for one), so the low end of the window is the step's own cost, where a median of a few
  samples may be a hiccup. A width counts its own time once it has ``TRUST`` samples; until then, and for a width
  never measured, ``t(g)`` is the least of its bounds from the measured drafting widths: the line through them
  (:func:`interpolated`; through the trusted ones once two are), a narrower width's time plus the slope per draft
  for each extra draft, a wider width's time (more drafts never cost less), its own time so far, and, where neither
  it nor a narrower width is measured, a plain step's time plus the slope per draft. The slope per draft is the
  least of the prior's (below), each measured width's ``(t(w) - t0) / w`` (a round's own cost beyond its drafts is
  not negative) and the slope between any two measured widths, not below 0. So one slow sample of one width moves
  no other width's time, and a wide width is priced from the narrow ones until it is measured itself (an optimistic
  price is corrected by the width's own samples; a pessimistic one would never be), but not below
  ``t0 (1 + VERIFY_COST g)`` (a verification of g + 1 tokens costs a forward and a little more per token: a drafter
  whose drafts are never accepted does not look free). ``t(g)`` is never below a plain step.
  Load that comes and goes (a shared host) leaves a width sampled under it priced high, and the choice, weighing its
  own samples, would never draft it again: so a width whose last sample is ``REPROBE`` rounds old is drafted once in
  place of the best width where the other widths alone price it (a narrower width's time plus the slope) at a better
  rate (at most one such round in ``REPROBE``), and a stale width's sample ``RENEW`` under its time drops the older
  ones (noise only adds time: the load they held has passed), so it is measured afresh.
  The prior, before anything is measured: a round of g drafts costs ``t0 (1 + (draft_cost + VERIFY_COST) g)``, a
  verification of g + 1 tokens about one forward (on a CPU too) and each draft a drafting step, ``draft_cost`` plain
  steps (the round loop's :func:`~.rounds.draft_cost`: 0 for retrieval, a separate drafter's layers over the
  verifier's, 1 for the verifier drafting on its own compressed cache). Where no plain step is measured, ``t0`` is
  the least that the prior implies from the measured drafting widths, ``t(w) / (1 + (draft_cost + VERIFY_COST) w)``,
  and where nothing is, 1 (a plain step is the unit: only ratios decide).
  Plain steps run several to a sync; where they run one after another on the host (a CPU) each step is its own
  sample (with an even share of the burst's host time), else each burst is one sample of its mean time (a mean of
  several steps holds a hiccup of any one of them, so its low end would sit above a single drafting round's). A
  round that ran a step for the first time (compilation, CUDA-graph capture) is not a sample.
* The switch from plain steps to drafting: the first drafting round after plain rounds also catches the drafter up
  on the positions it missed (a forward over them, or for a self-drafter a copy). That is a cost of the switch, not
  of the width: such a round is no sample of its width (else one exploration after a long plain run would make the
  width look slow for good, and drafting would never resume). Its time beyond ``t(g)`` is a sample of a catch-up
  step's cost (a step reads up to ``lag_block`` missed positions: its cost is mostly the drafter's forward, not the
  positions), which the exploration interval accounts for; and the round
  after it drafts the same width again, a clean sample (so that the width's time stays current while plain steps
  win; an exploration then costs two rounds, both counted in its expected loss).

The first rounds start from what is known: each round takes the width of the best rate, from the first round on,
at the prior's costs and the acceptance over earlier calls (``PRIOR_ACCEPT`` at first), so that retrieval or a
cheap drafter that pays at that acceptance drafts at once. Where plain steps win there, they are measured first
(``TRUST`` samples: every choice is weighed against them; queued as every plain run is, below), then the two
narrowest widths are probed while fewer than two drafting widths are measured (a drafter that cannot pay costs
little more than a plain step there; the prior may be wrong; a probe that would pay the drafter's deferred prefill
waits, as an exploration does, for a call that affords it), then the choice, which tries a wider width as soon
as the model expects it to win. A drafter that drafts from the first round still has plain steps measured, as the
first ones are (``TRUST`` samples, bursts queued: a plain step timed alone, its sync and host work included, costs
twice its time in a run of them), once the width it drafts has its own time if drafting then wins by less than
``CHECK_PLAIN`` times on the plain step's time the prior guessed: a drafting round costs more than a plain step plus
its drafts (one draft of a drafter on a compressed cache at 16K took twice a plain step), so the guess can have it
drafting where plain steps win. The engine keeps those samples for its later calls.

While plain steps win, the controller drafts once every ``explore_every`` plain rounds at the best drafting width, so
that a drafter whose acceptance rises is used again; the interval is set so that an exploration round's expected loss
stays under ``EXPLORE_SHARE`` of the plain rounds it follows, or ``EXPLORE_SHARE_CALLS`` where drafting that width pays
at the acceptance over the earlier calls (a good document whose first answer tokens are hard dips this call's estimates,
and should draft again within the call; a drafter that pays on no text keeps the smaller budget) (and within
``EXPLORE_MIN..EXPLORE_MAX`` rounds; while the drafter's prefill is pending, its cost adds rounds up to
``PREFILL_EXPLORE_MAX``). Until that exploration the choice of plain steps stands without being computed again (only the
plain step's time is observed meanwhile; a move of its time by more than ``PLAIN_DRIFT`` decides again at once, without
stopping the queue of plain steps where they still win), and its steps run as greedy AR's do: bursts of several steps to
a sync, each queued before the host reads the tokens of the one before (:meth:`plain_ahead`), so that the device does
not wait for the host.

What a controller learns (round times, acceptance, the plain rounds since the last draft) is kept by the engine
across calls (:class:`ControllerMemory`). A call that starts where plain steps win (:meth:`DraftController.defers`)
leaves the drafter's prefill for its first drafting round (a self-drafter's cache is then filled from the verifier's,
its chunks selected from the prompt queries the prefill kept): a drafter that does not pay then costs no prefill in
the calls between explorations. That prefill's cost is learnt per prompt token it reads (a sink + window drafter's
reads only the positions its cache keeps), from a deferred prefill's round and from a separate drafter's prefill at
a call's start (its host and device seconds, read after the prefill's own sync; not the engine's first, whose
one-time costs would stand for good). It counts in the exploration's expected loss while it is pending, so
explorations that would pay it come further apart; a call whose remaining tokens would not save it by drafting (a
short answer after a long prompt) does not draft, however well drafting pays per round; and an exploration due in a
call whose plain steps left would take less than 1 / ``PREFILL_CALL_SHARE`` times that prefill waits for a call long
enough to afford it (each call stays within that share of our AR's time, where an exploration paying a whole
prompt's drafter prefill in a short call would cost it several times as much).

A constant γ (``fixed``) bypasses all of this: every round drafts γ. The controller changes no acceptance rule; it
only chooses how many drafts a round verifies, so the output is the same for any choice (greedy) or distributed the
same (sampling).
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field

LADDER = (1, 2, 3, 4, 6, 8)  # the widths the controller may choose, cut at the engine's γ (which is always one)
DECAY = 0.95  # weight of the past acceptance counts at each new trial (the same depth; the pooled ones per trial)
SHRINK = 4.0  # pseudo-trials at the pooled rate in each depth's estimate
WINDOW = 7  # round times kept per width (their low quantile, :func:`low`, is its time)
TRUST = 3  # samples before a width's own time is used instead of the line through the plain step (:meth:`_line`)
VERIFY_COST = 0.03  # prior: what each draft adds to a verification, as a share of a plain step (g + 1 tokens are
# verified in about one forward, on a CPU too)
PRIOR_ACCEPT = 0.6  # a depth's acceptance before any observation
LONG_DECAY = 0.995  # ... the weight of the past counts at each new trial in the rate over calls
CALL_PRIOR = 8.0  # the trials that rate weighs at a call's start
EXPLORE_SHARE = 0.02  # an exploration's expected loss, as a share of the plain rounds before it
EXPLORE_SHARE_CALLS = 0.05  # ... where the acceptance over earlier calls says drafting pays (this call's may be a dip)
EXPLORE_MIN, EXPLORE_MAX = 8, 512
PREFILL_EXPLORE_MAX = 8 * EXPLORE_MAX  # ... while an exploration would also pay a deferred drafter prefill
PREFILL_CALL_SHARE = 0.02  # ... which it pays only in a call whose plain steps left take 1 / this of that prefill
CHECK_PLAIN = 2.0  # drafting that wins by less than this on a guessed plain step's time measures one first
PLAIN_DRIFT = 0.05  # a run of plain steps is decided again early once their time moves by more than this
REPROBE = 16  # rounds after which a width's own samples are stale: it is drafted again where the other widths
# price it above the best width (:meth:`DraftController._stale_width`); at most one such round in this many
RENEW = 0.25  # a stale width's sample this much under its time drops the older ones: the load they held has passed
# (noise only adds time), and the width is measured afresh (TRUST new samples) before its own time counts again
CATCH_UP = -1  # the key of :attr:`DraftController.samples` holding the seconds of one catch-up step
PREFILL = -2  # ... and the deferred drafter prefill's seconds per prompt token


def low(values: list[float]) -> float:
    """A window's low quantile: its ``(n - 1) // 4``-th smallest of ``n`` (the least of up to 4 samples, the second
    least of 5 to 8). Noise (a host hiccup, a busy core, a thread waiting for a core) only adds time: the low end of
    the window is the step's own cost, where a median of a few samples may be a hiccup."""
    return sorted(values)[(len(values) - 1) // 4]


def widths(gamma: int) -> tuple[int, ...]:
    """The draft widths an adaptive engine of at most ``gamma`` drafts may run: :data:`LADDER` up to ``gamma``, and
    ``gamma`` itself."""
    return tuple(sorted({w for w in LADDER if w < gamma} | {gamma}))


def _expected(hits: list, trials: list, pooled: list) -> list[float]:
    """E[tokens | g] for g = 0..len(hits) from each depth's (decayed) acceptances and trials, each shrunk towards
    the pooled rate (``pooled``: its trials, acceptances) by SHRINK trials."""
    rate, total, survive, expected = pooled[1] / pooled[0], 1.0, 1.0, [1.0]
    for hit, tried in zip(hits, trials):
        survive *= (hit + SHRINK * rate) / (tried + SHRINK)
        total += survive
        expected.append(total)
    return expected


def interpolated(seconds: dict[int, float], g: int, known: list[int] | None = None) -> float | None:
    """Seconds at width ``g`` from ``seconds`` (width -> seconds): measured, else interpolated between the nearest
    measured widths, else extrapolated from the slope between the narrowest and the widest measured width; None while
    nothing is measured. ``known``: ``sorted(seconds)``, where the caller has it."""
    if g in seconds:
        return seconds[g]
    known = sorted(seconds) if known is None else known
    if not known:
        return None
    i = bisect.bisect_left(known, g)  # known[i - 1] < g < known[i]
    if 0 < i < len(known):
        a, b = known[i - 1], known[i]
        return seconds[a] + (seconds[b] - seconds[a]) * (g - a) / (b - a)
    if len(known) < 2:
        return seconds[known[0]]
    a, b = (known[0], known[-1])
    slope = max((seconds[b] - seconds[a]) / (b - a), 0.0)
    anchor = b if g > b else a
    return max(seconds[anchor] + slope * (g - anchor), 1e-9)


@dataclass
class ControllerMemory:
    """What a controller learns, kept by the engine across calls (its steps cost the same, and its drafter meets
    text of the same kind): the round times (:attr:`DraftController.samples`), each depth's decayed trials and
    acceptances, and the plain rounds since the last drafting round (so that an exploration falls due across short
    calls too)."""

    gamma: int
    samples: dict = field(default_factory=dict)
    trials: list = None
    hits: list = None
    pooled: list = None
    plain_run: int = 0
    rounds: int = 0  # rounds observed (a burst of plain steps counts each), over every call
    sampled: dict = field(default_factory=dict)  # width -> :attr:`rounds` at its last time sample
    reprobed: int = -REPROBE  # :attr:`rounds` at the last round that drafted a stale width
    calls: list = None  # per depth, then pooled: (trials, acceptances) decayed by LONG_DECAY, over every call

    def __post_init__(self):
        self.trials = self.trials or [0.0] * self.gamma  # depths 1..gamma (index i - 1)
        self.hits = self.hits or [0.0] * self.gamma
        self.pooled = self.pooled or [1.0, PRIOR_ACCEPT]  # (trials, acceptances) over every depth
        self.calls = self.calls or [[0.0, 0.0] for _ in range(self.gamma + 1)]

    def count(self, accepted: int, drafted: int) -> None:
        """A row's round that verified ``drafted`` drafts and accepted ``accepted``: depths 1..min(accepted + 1,
        drafted) were tried, all but the last of them accepted unless all ``drafted`` were. Each trial, in depth order,
        in the call's counts (its depth's and the pooled ones) and in the counts over calls."""
        trials, hits, calls = self.trials, self.hits, self.calls
        pooled_trials, pooled_hits = self.pooled
        every = calls[-1]
        for depth in range(min(accepted + 1, drafted)):
            hit = 1.0 if depth < accepted else 0.0
            trials[depth] = DECAY * trials[depth] + 1.0
            hits[depth] = DECAY * hits[depth] + hit
            pooled_trials, pooled_hits = DECAY * pooled_trials + 1.0, DECAY * pooled_hits + hit
            for counts in (calls[depth], every):
                counts[0] = LONG_DECAY * counts[0] + 1.0
                counts[1] = LONG_DECAY * counts[1] + hit
        self.pooled = [pooled_trials, pooled_hits]

    def start_call(self) -> None:
        """A new call: each depth's counts (and the pooled ones) become its rate over the calls so far, weighing at
        most CALL_PRIOR trials (depths never tried keep theirs)."""
        for i, (tried, hit) in enumerate(self.calls):
            if tried <= 0.0:
                continue
            weight = min(tried, CALL_PRIOR)
            if i < self.gamma:
                self.trials[i], self.hits[i] = weight, weight * hit / tried
            else:
                self.pooled = [weight, weight * hit / tried]


class DraftController:
    """Chooses each round's number of drafts. ``gamma``: the most drafts a round may verify (the engine's width);
    ``fixed``: a constant number of drafts (no choice; ``None``: choose among ``choices``, default :func:`widths`;
    a tree engine offers ``(γ,)``: its tree or a plain step); ``memory``: what earlier calls learnt
    (:class:`ControllerMemory`, kept by the engine; default: nothing yet). Its :attr:`samples` are the round times
    measured so far (width -> the last ``WINDOW`` seconds; :data:`CATCH_UP`: a catch-up step's seconds;
    :data:`PREFILL`: a deferred drafter prefill's seconds per prompt token). ``lag_block``: the missed positions a
    lagging drafter's catch-up step reads."""

    def __init__(self, gamma: int, fixed: int | None = None, memory: ControllerMemory | None = None,
                 choices: tuple[int, ...] | None = None, lag_block: int = 1, draft_cost: float = 1.0):
        self.gamma = gamma
        self.lag_block = lag_block
        self.draft_cost = draft_cost
        self.fixed = fixed
        self.widths = (fixed,) if fixed is not None else choices or widths(gamma)
        self.memory = ControllerMemory(gamma) if memory is None else memory
        self.memory.start_call()
        self.seconds = {w: low(v) for w, v in self.samples.items() if w >= 0}  # width -> its low quantile
        self.deferred = 0  # prompt tokens the drafter's deferred prefill would read, unread this call (:meth:`defers`)
        self.again: int | None = None  # a width to draft again next round (its switch round was no sample)
        self._plain_until: tuple[int, float, int] | None = None  # while plain steps win: (the plain run at which
        # to explore, the plain step's seconds then, the widest width allowed then); the choice stands until then
        # unless that time moves or a wider width is allowed
        self._rates: dict[int, float] = {}  # rate(g) since the last observation
        self._expected: list[float] | None = None  # E[tokens | g] for g = 0..gamma, since the last observation
        self._basis_kept: tuple | None = None  # what round_seconds derives from (:meth:`_basis`)
        self._times: dict[int, float | None] = {}  # round_seconds(g) since the last observation
        self.explorations = 0

    # what earlier calls learnt, and this call adds to
    samples = property(lambda self: self.memory.samples)
    trials = property(lambda self: self.memory.trials)
    hits = property(lambda self: self.memory.hits)
    pooled = property(lambda self: self.memory.pooled)
    plain_run = property(lambda self: self.memory.plain_run, lambda self, v: setattr(self.memory, "plain_run", v))

    # ---- the model
    def acceptance(self, depth: int) -> float:
        """p_depth (1-based): the depth's decayed acceptances over its trials, with SHRINK trials at the pooled
        rate."""
        pooled = self.pooled[1] / self.pooled[0]
        i = depth - 1
        return (self.hits[i] + SHRINK * pooled) / (self.trials[i] + SHRINK)

    def expected_tokens(self, g: int) -> float:
        """E[tokens | g]: the verifier's own token plus the expected accepted drafts (every g's at once, kept until
        the next observation)."""
        if self._expected is None:
            self._expected = _expected(self.hits, self.trials, self.pooled)
        return self._expected[g]

    def pays_over_calls(self, g: int) -> bool:
        """Whether drafting ``g`` beats plain steps at the acceptance over the earlier calls
        (:attr:`ControllerMemory.calls`) rather than this call's."""
        calls, t0, tg = self.memory.calls, self.round_seconds(0), self.round_seconds(g)
        if calls[-1][0] <= 0.0 or not t0 or tg is None:
            return False
        return _expected([h for _, h in calls[:-1]], [t for t, _ in calls[:-1]], calls[-1])[g] * t0 > tg

    def round_seconds(self, g: int) -> float:
        """t(g) (see the module docstring): a plain step's time (g = 0), a drafting width's own once it has TRUST
        samples, else the least of its bounds (:meth:`_bounds`), but at least t0 (1 + VERIFY_COST g); never below a
        plain step; kept until the next observation. While nothing is measured it is in units of a plain step (the
        prior alone)."""
        times = self._times
        if g in times:
            return times[g]
        if self._basis_kept is None:
            self._basis_kept = self._basis()
        t0 = self._basis_kept[0]
        if g == 0:
            t = t0
        elif len(self.samples.get(g, ())) >= TRUST:
            t = self.seconds[g]
        else:  # (a verification of g + 1 tokens costs at least one forward, a little more per token)
            t = max(min(self._bounds(g)), t0 * (1.0 + VERIFY_COST * g))
        times[g] = t = max(t, t0)
        return t

    def _bounds(self, g: int, own: bool = True) -> list[float]:
        """What an untrusted width ``g``'s time is at most, from the measured drafting widths' times: the line through
        the base widths (two or more; :func:`interpolated`), a narrower width's time plus the slope per extra draft
        (with neither it nor a narrower width measured, a plain step's plus the slope per draft), a wider width's time
        (more drafts never cost less), its own time so far. Noise only adds time, so one slow sample of one width moves
        none of the others' bounds. ``own=False``: by the other widths alone (no line, not its own time)."""
        t0, slope, base, known, drafting = self._basis_kept
        others = drafting if own else {w: t for w, t in drafting.items() if w != g}
        bounds = [interpolated(base, g, known)] if own and len(known) >= 2 else []
        bounds += [t + slope * (g - w) if w < g else t for w, t in others.items()]
        if not any(w <= g for w in others):
            bounds.append(t0 + slope * g)
        return bounds

    def _basis(self) -> tuple[float, float, dict, list, dict]:
        """What :meth:`round_seconds` derives from: ``t0``, a plain step's time (with none measured, the least the
        prior implies from the drafting widths, t(w) / (1 + (``draft_cost`` + VERIFY_COST) w); with nothing
        measured, 1); the seconds per draft: the least of the prior's, (``draft_cost`` + VERIFY_COST) t0, each
        measured width's (t(w) - t0) / w (a round's own cost, beyond its drafts, is not negative), and the slope
        between any two of them (not below 0); the widths the line runs through
        (the trusted drafting widths once two are, else the measured ones) and their sorted widths; the measured
        drafting widths' times."""
        prior = self.draft_cost + VERIFY_COST
        drafting = {w: t for w, t in self.seconds.items() if w > 0}
        t0 = self.seconds.get(0)
        if t0 is None:
            t0 = min((t / (1.0 + prior * w) for w, t in drafting.items()), default=1.0)
        slopes = [(t - t0) / w for w, t in drafting.items()]  # (each at least the cost of a draft)
        slopes += [(drafting[b] - drafting[a]) / (b - a) for a, b in itertools.combinations(sorted(drafting), 2)]
        slope = max(min([prior * t0, *slopes]), 0.0)
        trusted = {w: t for w, t in drafting.items() if len(self.samples[w]) >= TRUST}
        base = trusted if len(trusted) >= 2 else drafting
        return t0, slope, base, sorted(base), drafting

    def rate(self, g: int) -> float:
        """E[tokens | g] / t(g); kept until the next observation."""
        if g not in self._rates:
            self._rates[g] = self.expected_tokens(g) / self.round_seconds(g)
        return self._rates[g]

    def best_drafting(self) -> int:
        return max(self.widths, key=self.rate)

    def expects_to_draft(self, g: int) -> bool:
        """Whether another round of ``g`` drafts is likely to follow, at the rates learnt so far, without choosing
        (nothing changes): a constant γ always; else where ``g`` drafts beat plain steps (not an exploration's round
        while plain steps win). The round loop queues the next round's drafts on it (:mod:`.rounds`)."""
        return self.fixed is not None or self.rate(g) > self.rate(0)

    # ---- decisions
    def choose(self, allowed: int | None = None, remaining: int | None = None) -> int:
        """The next round's number of drafts, at most ``allowed`` (a width of :attr:`widths`, or 0); ``remaining``:
        the most tokens the call may still generate (None: no bound), against which a pending drafter prefill must
        pay back (:meth:`pays_back`)."""
        cap = self.gamma if allowed is None else allowed
        options = [w for w in self.widths if w <= cap]
        if self.fixed is not None:
            return options[-1] if options else 0
        if not options:
            return 0
        again, self.again = self.again, None
        if again is not None and again <= cap:
            return again
        if self._plain_until is not None:  # a run of plain steps: nothing but their own time changed since
            if self._plain_stands() and cap <= self._plain_until[2]:
                return 0
            self._plain_until = None
        best = max(options, key=self.rate)
        if self.rate(best) > self.rate(0) and self.pays_back(best, remaining, self.deferred):
            if self._plain_guessed(best):
                return 0  # (measured as the first plain steps are: :meth:`plain_steps`, :meth:`plain_ahead`)
            stale = self._stale_width(best, options)
            if stale is not None:
                self.memory.reprobed = self.memory.rounds
                return stale
            return best  # (from the first round where the prior, or what earlier calls measured, says it pays)
        if len(self.samples.get(0, ())) < TRUST:
            return 0  # plain steps win, not yet measured: TRUST samples of them (every choice is weighed against them)
        probes = [w for w in self.widths[:2] if w not in self.seconds]
        if probes and sum(w > 0 for w in self.seconds) < 2:  # then the two narrowest widths, where the prior said
            # no (the cost per draft, the first depths' acceptance; a drafter that cannot pay costs little there), in
            # a call that affords the drafter's pending prefill, as an exploration
            return probes[0] if probes[0] <= cap and self._call_affords_prefill(remaining) else 0
        # (else plain steps, explored now and then: acceptance learnt on other text may be stale)
        until = self.explore_every(best)
        if self.plain_run >= until:
            if self._call_affords_prefill(remaining):
                self.explorations += 1
                return best
            until = self.plain_run + remaining + 1  # (due, but not in this call: the next that affords it)
        self._plain_until = until, self.seconds[0], cap
        return 0

    def _stale_width(self, best: int, options: list[int]) -> int | None:
        """A width to draft instead of ``best`` this round, to renew its own time: trusted, its last sample REPROBE
        rounds old or more, and priced by the other drafting widths (:meth:`_bound_by_others`) at a rate above
        ``best``'s (the best such); None where there is none or a stale width was drafted in the last REPROBE rounds.
        Load that comes and goes leaves a width sampled under it priced high for good: the choice, weighing its own
        samples, never drafts it again. Each such round costs at most the rate it loses once every REPROBE rounds."""
        memory = self.memory
        if memory.rounds - memory.reprobed < REPROBE:
            return None
        target, stale = self.rate(best), None
        for w in options:
            if w == best or len(self.samples.get(w, ())) < TRUST or not self._stale(w):
                continue
            rate = self.expected_tokens(w) / self._bound_by_others(w)
            if rate > target:
                target, stale = rate, w
        return stale

    def _stale(self, g: int) -> bool:
        """Whether width ``g``'s last time sample is REPROBE rounds old or more."""
        rounds = self.memory.rounds
        return rounds - self.memory.sampled.get(g, rounds) >= REPROBE

    def _bound_by_others(self, g: int) -> float:
        """What width ``g``'s time is at most by the other measured drafting widths alone (:meth:`_bounds` without
        its own time), at least t0 (1 + VERIFY_COST g)."""
        self.round_seconds(g)  # (the basis)
        return max(min(self._bounds(g, own=False)), self._basis_kept[0] * (1.0 + VERIFY_COST * g))

    def _call_affords_prefill(self, remaining: int | None) -> bool:
        """Whether an exploration due now may pay the drafter's pending prefill (:attr:`deferred` prompt tokens, at
        its learnt cost): at most PREFILL_CALL_SHARE of the ``remaining`` plain steps' time this call may still take.
        A short answer after a long prompt then never pays a prefill it cannot save (at 16K on an H100 a separate
        drafter's prefill costs 10 of 128 plain steps, a self-drafter's cache fill 25); the exploration waits for a
        call long enough (:attr:`ControllerMemory.plain_run` keeps counting across calls). True where nothing is
        pending or its cost is not known yet."""
        cost = self._low(PREFILL) * self.deferred
        return not cost or remaining is None or cost <= PREFILL_CALL_SHARE * remaining * self.round_seconds(0)

    def _plain_guessed(self, best: int) -> bool:
        """Whether drafting ``best`` wins only on a plain step's time the prior guessed: no TRUST plain samples yet,
        ``best``'s own time trusted, and its predicted rate under CHECK_PLAIN times a plain step's. The guess
        (:meth:`_basis`) prices a drafting round as a plain step plus its drafts; a round's own cost beyond them (the
        verification of g + 1 tokens, the drafter's first step, a sync) makes it too high, so a drafter that loses
        to plain steps would draft for good. Not retrieval (``draft_cost`` 0), whose rounds without a match are plain
        steps, measured as they come."""
        return (self.draft_cost > 0 and len(self.samples.get(0, ())) < TRUST <= len(self.samples.get(best, ()))
                and self.rate(best) < CHECK_PLAIN * self.rate(0))

    def plain_steps(self, most: int) -> int:
        """After choosing a plain step: how many to run before the next choice (one sync for all; at most ``most``,
        and not past the next exploration; greedy AR, ``fixed`` 0, and the first plain rounds: ``most``)."""
        if self.fixed is not None:
            return most if self.fixed == 0 else 1
        if self._plain_until is None and len(self.samples.get(0, ())) < TRUST:
            return most  # measuring a plain step: no exploration is due (the probes come next)
        until = self._plain_until[0] if self._plain_until is not None else self.explore_every(self.best_drafting())
        return max(1, min(most, until - self.plain_run))

    def plain_ahead(self, launched: int, most: int) -> int:
        """While ``launched`` plain steps run, not yet observed: how many more (at most ``most``) the choice of plain
        steps that stands may queue behind them, before the host reads theirs (0: the round after them is chosen
        first; greedy AR: ``most``). The first plain rounds, which measure a plain step before any width is probed,
        queue whole bursts until the burst that gives the last of their ``TRUST`` samples is in flight."""
        if self.fixed is not None:
            return most if self.fixed == 0 else 0
        if self._plain_until is None:  # the first plain steps, measuring a plain step (TRUST samples): whole bursts,
            # queued too, so that no sample holds a host wait the later, queued runs do not pay; the burst in flight
            # gives one sample, then the probes
            return most if len(self.samples.get(0, ())) + 1 < TRUST else 0
        if not self._plain_stands(launched) and not self._plain_still_wins(launched):
            return 0
        return max(0, min(most, self._plain_until[0] - self.plain_run - launched))

    def _plain_still_wins(self, ahead: int) -> bool:
        """The plain step's time moved while the choice of plain steps stood: whether plain steps still beat every
        width then allowed (the choice then stands, at the new time, its exploration where it was), so that a drift
        which changes nothing does not stop the queue of plain steps; False where the exploration falls due."""
        until, _, cap = self._plain_until
        if self.plain_run + ahead >= until:
            return False
        options = [w for w in self.widths if w <= cap]
        if options and self.rate(max(options, key=self.rate)) > self.rate(0):
            return False  # (:meth:`choose` decides, the prefill's pay-back too)
        self._plain_until = until, self.seconds[0], cap
        return True

    def _plain_stands(self, ahead: int = 0) -> bool:
        """Whether the choice of plain steps stands for a round ``ahead`` plain steps from now: its exploration not
        yet due, and the plain step's time within PLAIN_DRIFT of what it was when it was chosen."""
        until, t0, _ = self._plain_until
        return self.plain_run + ahead < until and abs(self.seconds[0] - t0) <= PLAIN_DRIFT * t0

    def explore_every(self, g: int) -> int:
        """Plain rounds between explorations at width ``g``: the expected loss of one, n plain rounds after the last
        (its time beyond what plain steps take for the tokens it brings, and the catch-up steps over the n positions
        the drafter missed: at most n / lag_block + 1), is at most EXPLORE_SHARE of those n rounds' time
        (EXPLORE_SHARE_CALLS where :meth:`pays_over_calls`)."""
        t0, tg = self.round_seconds(0), self.round_seconds(g)
        if not t0 or tg is None:
            return EXPLORE_MIN
        rounds = 2 if self.samples.get(CATCH_UP) else 1  # a lagging drafter's exploration: the switch, then a sample
        loss = rounds * max(tg - self.expected_tokens(g) * t0, 0.0)
        prefill = self._low(PREFILL) * self.deferred
        step = self._low(CATCH_UP)
        share = EXPLORE_SHARE_CALLS if self.pays_over_calls(g) else EXPLORE_SHARE
        margin = share * t0 - step / self.lag_block  # what each plain round leaves for the loss
        if margin <= 0:
            return EXPLORE_MAX if not prefill else PREFILL_EXPLORE_MAX
        if self.lag_block > 1:  # (the last, partly filled catch-up step)
            loss += step
        n = min(max(math.ceil(loss / margin), EXPLORE_MIN), EXPLORE_MAX)
        # a pending prefill's share lengthens the interval past EXPLORE_MAX (else, with a long prompt, each
        # exploration would pay a prefill of several times EXPLORE_SHARE of the rounds before it)
        return n if not prefill else min(n + math.ceil(prefill / margin), PREFILL_EXPLORE_MAX)

    def defers(self, remaining: int | None = None, prompt_tokens: int = 0) -> bool:
        """At a call's start: whether plain steps win (measured), or drafting at the best width would not save its
        drafter's prefill of ``prompt_tokens`` over the call's ``remaining`` tokens (:meth:`pays_back`), so that the
        drafter's prefill may wait for the first drafting round (:attr:`deferred`; an exploration due at once makes
        that the first round)."""
        measured = 0 in self.seconds and any(w > 0 for w in self.seconds)
        if self.fixed is not None or not measured or self.again is not None:
            return False
        best = self.best_drafting()
        return self.rate(best) <= self.rate(0) or not self.pays_back(best, remaining, prompt_tokens)

    def pays_back(self, g: int, remaining: int | None, prompt_tokens: int) -> bool:
        """Whether drafting ``g`` a round for the call's ``remaining`` tokens saves more time than plain steps by
        more than the drafter's prefill of ``prompt_tokens`` costs (its seconds per prompt token learnt,
        :data:`PREFILL`): a short answer after a long prompt is decoded plainly, the drafter never reading the
        prompt. True where nothing is pending or nothing is known of the prefill's cost."""
        cost = self._low(PREFILL) * prompt_tokens
        if not cost or remaining is None or self.rate(0) <= 0 or self.rate(g) <= 0:
            return True
        return remaining * (1.0 / self.rate(0) - 1.0 / self.rate(g)) > cost

    def prefill_cost(self, seconds: float, prompt_tokens: int) -> None:
        """A drafter prefill that ran at the call's start took ``seconds`` for ``prompt_tokens``: a sample of
        :data:`PREFILL`."""
        if prompt_tokens > 0:
            self._keep(PREFILL, seconds / prompt_tokens)

    def observe(self, g: int, accepted: list[int], seconds: float | None, rounds: int = 1,
                caught_up: int = 0, prefilled: int = 0, each: list[float] | None = None) -> None:
        """After a round of ``g`` drafts: each live row's accepted count, and the round's wall-clock seconds (None:
        not a timing sample); ``rounds`` plain steps run together count as that many rounds of their mean time, or,
        where ``each`` gives their own seconds (steps that ran one after another on the host, a CPU's), as that many
        samples (a mean of several steps holds a hiccup of any one of them: its low quantile would sit above a single
        round's, which would favour drafting);
        ``caught_up``: the positions the drafter caught up on before drafting (after plain rounds: the switch's
        cost, kept apart from the width's); ``prefilled``: the prompt tokens of the drafter's deferred prefill,
        which ran in this round (likewise)."""
        if seconds is not None and g > 0 and (prefilled or (self.plain_run > 0 and caught_up > 0)):
            t = self.round_seconds(g)
            steps = math.ceil(caught_up / self.lag_block)  # the catch-up steps this round ran
            if prefilled:  # (against the width's priced time where it is not measured yet: its bounds price it
                # low, so the prefill's cost comes out high, never free)
                excess = seconds - t - self._low(CATCH_UP) * steps
                self._keep(PREFILL, max(excess, 0.0) / prefilled)
            elif g in self.seconds:
                self._keep(CATCH_UP, max(seconds - t, 0.0) / steps)
            self.again = g  # the next round drafts g again: a clean sample of its time
            seconds = None
        self._forget_derived()
        self.memory.rounds += rounds
        if g == 0:
            self.plain_run += rounds
        else:
            self.plain_run, self._plain_until = 0, None
            for a in accepted:
                self.memory.count(a, g)
        if seconds is not None:
            for sample in each if each is not None else (seconds,):
                self._keep(g, sample)

    def _low(self, key: int) -> float:
        kept = self.samples.get(key)
        return low(kept) if kept else 0.0

    def _keep(self, key: int, seconds: float) -> None:
        kept = self.samples.setdefault(key, [])
        if key > 0 and kept and seconds < (1.0 - RENEW) * low(kept) and self._stale(key):
            kept.clear()  # (load that has passed: see :data:`RENEW`)
        kept.append(seconds)
        del kept[:-WINDOW]
        if key >= 0:
            self.memory.sampled[key] = self.memory.rounds
            self.seconds[key] = low(kept)
            self._forget_derived()

    def _forget_derived(self) -> None:
        """Drop what was derived from the samples and counts (rates, round times, E[tokens], the interpolation
        basis)."""
        self._rates.clear()
        self._times.clear()
        self._expected = self._basis_kept = None
