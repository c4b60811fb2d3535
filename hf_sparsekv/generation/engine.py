"""The engine of ``generate()``'s speculative and AR decoding (the only loop): preallocated caches, device-side drafting and acceptance,
one host sync per round; on CUDA its steps are captured as CUDA graphs, on CPU (and with ``HF_SPARSEKV_GRAPHS=0``)
the same steps run eagerly on PyTorch's reference attention.

The round itself (stopping rules, streaming, stats) is :mod:`.rounds`; the drafter's steps and cache layouts
:mod:`.drafting`; acceptance :mod:`.acceptance`.

Device state (all preallocated): ``seq [capacity]`` the token sequence, ``n [1]`` its length. Between rounds the
verifier's cache holds positions ``0..n-2`` (all but the last token), and so does the drafter's (an adaptive engine's
drafter lags behind after rounds without drafts, and may not have read its prompt yet: see "Adaptive engines"). A
round:

1. (only after a round that accepted every draft) **catch-up**: the drafter is fed ``seq[n-2]``, the last draft,
   which it proposed but never read;
2. **draft**: γ one-token drafter steps, each step's argmax the next step's input (``drafts [γ]``);
3. **verify**: the verifier reads ``[seq[n-1], drafts]`` at positions ``n-1..n-1+γ`` (one forward), its argmaxes
   ``v [γ+1]``; ``a`` = the number of leading drafts equal to ``v``; ``seq[n..n+γ] = v``; ``n += a + 1``;
4. one transfer brings ``a`` and ``v`` to the host, which applies the stopping rules token by token.

Self-drafting on a chunk-budget or window cache (``drafter is verifier``, TriForce/MagicDec-style): the verifier's
prefill fills the drafter's cache too (its ``companion``: one prefill, the chunk selection from the same queries);
rounds are as above.

Adaptive engines (:mod:`.controller`: each round drafts as many tokens as the controller chooses, or none): in a
round without drafts the drafter reads nothing (``lagging``); before its next draft it catches up on what it missed
(a separate drafter: its forward over blocks of :data:`LAG_BLOCK` tokens from ``held``; a self-drafter: the
verifier's keys/values of those positions copied into its cache). A call that starts where plain steps win may
leave the drafter's prefill for the first round that drafts (:meth:`StaticEngine.prefill`, ``defer_drafter``).

Self-speculation on the INT4 view (QuantSpec, mode ``"int4"``): the verifier drafts on the INT4 view of its own
:class:`~hf_sparsekv.caches.static.StaticQuantCache` and verifies on its INT8 view; there is no catch-up (verification
writes every token into the one store). Before each round the host quantizes each row of the store up to the
round's state (``flush_to``, outside the graphs); a row keeps no token of the block past the point where that state
would move (``cap``), and a round in which no row could keep all its drafts runs one verifier step instead (no
drafts), so every kept token sees the state greedy AR on the INT8 view would see.

Retrieval drafting (mode ``"lookup"``, ``prompt_lookup_num_tokens``; :mod:`.retrieval`): no drafter and no draft
step; every step that moves the sequence ends by filling ``drafts`` with the continuation of an earlier occurrence of
each row's last tokens, and a round in which no row found one runs one verifier step instead.

Trees (:mod:`.draft_tree`; chunk/window/full drafters): with ``tree_size`` (``draft_tree_size``) every round, and with
retrieval beside the drafter (``spec.retrieval``) every round in which some live row found a match, verifies a tree
instead of the chain: the drafter's chain ``drafts``, the most probable of the other nodes it grew (``pool_*``,
``frontier``: :func:`~.drafting.draft_tree`, with ``tree_size``) and the retrieved continuation ``retrieved [B, γ]``,
one verifier forward of N + 1 tokens with tree attention. Each row keeps one root-to-node path
(:func:`~.acceptance.walk_tree`), whose keys/values the verifier's cache then holds at their positions' slots. The
drafter's cache holds its positions up to ``held [B]`` (exclusive). A ``tree_size`` round's draft step first feeds it
the γ + 1 tokens from ``held`` (the kept path and its token, up to the root), then sets ``held = n``. Beside
retrieval alone, ``held`` follows what the chain's draft step fed it (``fed [B, γ]`` from ``fed_at``, checked after
each verification), and a row whose path left the chain gets a catch-up block of γ + 1 tokens from ``held`` before it
drafts again (writes past the sequence stay within the slots a round may write ahead).

A separate drafter on a quantized cache (mode ``"int4-drafter"``) reads its own store in the INT4 view; the host
quantizes each row of it before each round, up to the state of the round's first drafter forward.

Sampling (``do_sample=True``, :mod:`.sampling`): the same rounds with draws instead of argmaxes, all on the device.
Both models' float32 logits get the EOS floor and the engine's warpers (temperature, top-k, top-p, ...); the draft
step keeps the drafter's probabilities ``q [γ, V]`` of its drafts; the verify step runs
:func:`~.sampling.accept_or_resample` and writes the accepted drafts and the drawn token. AR sampling draws each
token from the verifier's processed distribution.

Host-side rules (:mod:`.host_rules`: processors the device cannot apply, a user's ``logits_processor``,
``output_scores``/``output_logits``): the verify step stops at its raw logits (``logits [B, γ+1, V]``); the host
applies each row's processors after each exact prefix, picks the tokens and writes them with :meth:`commit`, between
the captured steps. A repetition penalty alone stays on the device (``seen [B, V]``, each row's tokens so far).

Nothing is rolled back explicitly: the caches hold stale entries past the sequence, which the next steps overwrite
and never read (see :mod:`hf_sparsekv.caches.static`). A round may compute tokens past ``max_length``; the host
drops them, as it drops tokens after a stop (they cannot change the earlier ones). Greedy AR on the same engine
(:func:`~.rounds.graph_greedy_generate`) is one verifier step per token, several steps between syncs.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.nn import Parameter
from tqdm.auto import tqdm
from transformers.utils import logging

from .attention_semantics import served_layers
from ..cache_keyword import cache_keyword
from ..caches.chunk_selection import voting_queries
from ..caches.static import StaticFullCache, StaticQuantCache, mark_length_dynamic
from ..kernels import runtime
from ..kernels.chunk_attention import MAX_QUERIES
from .acceptance import accept_or_resample, accepted_length, walk_tree
from .compile_policy import compile_setting, compiles
from .common import _attention_shape, _text_config, layer_devices
from .controller import ControllerMemory
from .draft_tree import DraftTree, path_nodes
from .draft_weights import attach, drafting, models as models_with_copies, release_model as release_copies
from .drafting import (
    catch_up, catch_up_block, catch_up_copy, catch_up_lag, draft, draft_token, draft_tree, drafter_cache, drafter_input,
)
from .graph_steps import (
    DEVICE_WIDE, CapturedStep, compiled_step, graphs_setting, prefill_compiles, prefill_pays,
    release_generator_after_failed_capture, updates_rotary_per_call,
    static_forward, static_prefill, wait_for,
)
from .model_locks import exclusive
from .regional import decoder_layers, regional_setting
from .retrieval import retrieve
from .sampling import draw, penalized

logger = logging.get_logger(__name__)

CAPACITY_ROUNDING = 256
AR_STEPS_PER_SYNC = 8
LAG_BLOCK = MAX_QUERIES  # adaptive engines: tokens a drafter catches up on per step after rounds without drafts: the
# most a block of the decode kernel takes (a drafter's forward over a short block costs mostly its launches and weight
# reads, so larger blocks cost less per missed position; a longer block ran PyTorch's masked attention, whose traced
# step guards on the cache's capacity: a grown engine traced it again, about 1 s, bundled pair, H200)


def _round_up(n: int, to: int = CAPACITY_ROUNDING) -> int:
    return math.ceil(n / to) * to


@dataclass(frozen=True)
class EngineSpec:
    """What a set of static caches and captured graphs is built for; an engine is reused by calls with the same spec
    (same models with the same weight storage: a graph reads weights by address) and a capacity that suffices."""

    # "ar", "chunk", "window", "full", "int4" (self-speculation on the verifier's quantized store), "int4-drafter" (a
    # separate drafter on its own quantized store, read in the INT4 view), "lookup" (retrieval drafting, no drafter)
    mode: str
    budget: int | None  # chunk/window: the drafter's budget; int4: the group size G; lookup: the longest n-gram
    gamma: int
    dtype: torch.dtype  # the verifier's (a drafter's caches take the drafter's own dtype: drafting.drafter_cache)
    device: torch.device
    batch: int  # rows decoded together (independent sequences)
    kernels: bool  # decode attention through the Triton kernel (runtime.enabled at engine creation)
    compiled: bool  # steps may be compiled with torch.compile before capture (when: :mod:`.compile_policy`)
    weights: tuple  # (data_ptr, dtype) of every parameter of the verifier and the drafter
    sampling: tuple | None = None  # do_sample: the warpers (class, settings), baked into the steps; None: greedy
    penalty: tuple | None = None  # (repetition penalty, leading prompt tokens it ignores), baked into the steps
    # the drafter cache's settings: chunk (chunk_size, ChunkSelection, generated_window or None), window (sink, window)
    layout: tuple = ()
    host: bool = False  # host-side rules (processors, criteria, outputs): verification stops at the logits
    draft_weights: str = "full"  # "int4": the draft steps run the drafting model's 4-bit weight copy (QuantSpec)
    retrieval: int = 0  # chunk/window/full: retrieval beside the drafter, suffixes of up to this many tokens (0: off)
    tree_size: int | None = None  # chunk/window/full: draft nodes per round (draft_tree_size; None: the chain)
    adaptive: bool = False  # rounds may draft fewer than γ, or none (:mod:`.controller`): steps of every width
    token_types: bool = False  # the verifier's forwards get token_type_ids (TOKEN_TYPE_MODELS): the prompt's, then
    # its last one for every generated token, as stock generate() extends them


def warpers_key(warpers) -> tuple | None:
    """What identifies a list of warpers in an :class:`EngineSpec` (their settings are constants of the steps);
    ``None`` (greedy) stays ``None``."""
    if warpers is None:
        return None
    return tuple((type(w).__name__, repr(sorted(vars(w).items()))) for w in warpers)


def _weights(*models) -> tuple:
    """(data_ptr, dtype) of every parameter, module by module (a tensor-parallel shard: of its local tensor; a
    parameter two modules hold, such as tied embeddings, once for each; the order is fixed by the modules; a
    self-drafting call passes its one model once). It runs at every call: a walk of the modules' own dicts, without
    ``Module.parameters()``'s names and de-duplication, and asking a parameter for ``to_local`` only where it is not
    a plain ``Parameter`` (a failed ``hasattr`` raises inside), costs 0.16 ms for the bundled pair on one CPU core
    (0.31 ms asking every parameter)."""
    found, stack = [], list(models)
    while stack:
        module = stack.pop()
        if module is None:
            continue
        for p in module._parameters.values():
            if p is None:
                continue
            if type(p) is not Parameter and hasattr(p, "to_local"):  # (a DTensor shard)
                p = p.to_local()
            found.append((p.data_ptr(), p.dtype))
        stack.extend(module._modules.values())
    return tuple(found)


class _PrefillPlan(NamedTuple):
    """How :meth:`StaticEngine.prefill` fills the caches (:meth:`StaticEngine._plan_prefill`)."""

    separate: bool  # the drafter has a cache of its own
    shared_prefill: bool  # self-drafting: the verifier's prefill fills both caches
    voting: list  # a self-drafter's prompt queries kept per row (counts)
    fills_after: bool  # a self-drafter filled right after the verifier's compiled prefill


class StaticEngine:
    """Static caches, token buffers and (captured) steps for one verifier/drafter pair. See the module docstring."""

    def __init__(self, verifier, drafter, spec: EngineSpec, max_tokens: int, max_new: int, use_graphs: bool,
                 warpers: list | None = None):
        # weak references: the engine is kept in a WeakKeyDictionary keyed by the verifier
        self._verifier = weakref.ref(verifier)
        self._drafter = None if drafter is None else weakref.ref(drafter)
        self.spec = spec
        self.use_graphs = use_graphs
        self.verifier_keyword = cache_keyword(verifier)
        self.drafter_keyword = None if drafter is None else cache_keyword(drafter)
        slack = self._plan_rounds(verifier, drafter)
        self.max_tokens = _round_up(max_tokens)
        self.max_new = _round_up(max_new)
        self._allocate_caches(verifier, drafter, slack, warpers)
        self._allocate_round_state(verifier, drafter, slack, warpers)
        self._start_state(verifier, drafter)

    def _plan_rounds(self, verifier, drafter) -> int:
        """What a round does (a draft tree or one chain, self-drafting, a drafter that lags behind plain rounds);
        the positions a round may write past the last kept token."""
        spec = self.spec
        gamma = spec.gamma
        slack = gamma + 2  # a round may write up to γ + 1 positions past the last kept token
        self.tree = DraftTree.plan(gamma, spec.tree_size, bool(spec.retrieval))  # None: every round one chain
        self.grows_tree = self.tree is not None and self.tree.width > 0  # the drafter grows each round's tree
        if self.tree is not None:  # a tree round writes N + 1 slots from n - 1 (the drafter: its block from n)
            slack = max(self.tree.size, self.tree.block) + 2
        if spec.mode == "ar":  # a row may run up to AR_STEPS_PER_SYNC steps past its end before the host sees it
            slack += AR_STEPS_PER_SYNC
        # self-drafting on a compressed cache: every verifier step also writes its keys/values there
        self.self_drafting = drafter is verifier and spec.mode in ("chunk", "window", "full")
        if spec.adaptive and self.self_drafting and self.grows_tree:  # its tree round does not write the drafter's
            raise ValueError("a self-drafting tree keeps a constant γ: its drafter cannot catch up after plain "
                             "steps")  # cache, and no catch-up copy runs before it (the front never asks for this)
        # an adaptive engine's drafter falls behind in rounds without drafts; catch-ups of LAG_BLOCK tokens bring it
        # back (a separate drafter: its forward on them; self-drafting: the verifier's keys/values copied over, its
        # plain steps then write one cache, not both)
        self.lagging = spec.adaptive and drafter is not None and spec.mode in ("chunk", "window", "full")
        return slack

    def set_caps(self, caps: list[int]) -> None:
        """int4: each row's most drafts kept this round into ``cap``, copied to the device only where they differ from
        what it holds (most rounds keep the last round's)."""
        if caps != self.caps_held:
            self.cap.copy_(torch.tensor(caps), non_blocking=True)
            self.caps_held = caps

    def _allocate_caches(self, verifier, drafter, slack: int, warpers) -> None:
        """The verifier's cache and the drafter's (one quantized store for int4 self-speculation)."""
        spec = self.spec
        gamma, device, dtype = spec.gamma, spec.device, spec.dtype
        self.cap = None  # int4: the most drafts each row may keep this round (its quantization state must not move)
        if spec.mode == "int4":  # one store: the draft reads its INT4 view, verification its INT8 view
            if warpers is not None and spec.batch > 1:  # a row's cap would have to cut a sampled block
                raise NotImplementedError("sampled int4 self-speculation runs one row at a time")
            self.verifier_cache = StaticQuantCache(spec.budget, self.max_tokens + slack, gamma + 1,
                                                   *_attention_shape(verifier), dtype, device, spec.batch,
                                                   layer_devices(verifier))
            self.drafter_cache = self.verifier_cache
            self.cap = torch.full((spec.batch,), gamma, dtype=torch.long, device=device)
            self.caps_held = [gamma] * spec.batch  # what ``cap`` holds (only :meth:`set_caps` writes it)
        else:
            self.verifier_cache = StaticFullCache(*_attention_shape(verifier), self.max_tokens + slack, dtype, device,
                                                  spec.batch, layer_devices(verifier))
            scratch = self.tree.block if self.grows_tree else 0
            ahead = LAG_BLOCK if self.lagging else 0  # a lag catch-up writes that far past the sequence
            self.drafter_cache = None if drafter is None else drafter_cache(drafter, spec, self.max_tokens,
                                                                              self.max_new, slack + ahead, scratch,
                                                                              ahead)

    def _caches(self) -> list:
        """The engine's distinct caches (the verifier's, and the drafter's where it is another)."""
        return list({id(c): c for c in (self.verifier_cache, self.drafter_cache) if c is not None}.values())

    def _allocate_round_state(self, verifier, drafter, slack: int, warpers) -> None:
        """The device tensors the steps read and write: the sequences, the drafts and the report, a tree's and the
        sampling rules' state, the vocabularies' limits."""
        spec = self.spec
        gamma, device = spec.gamma, spec.device
        rows = spec.batch
        self.seq = torch.zeros(rows, self.max_tokens + slack + AR_STEPS_PER_SYNC, dtype=torch.long, device=device)
        mark_length_dynamic(self.seq, dim=1)
        self.n = torch.zeros(rows, dtype=torch.long, device=device)
        self.live = torch.ones(rows, dtype=torch.long, device=device)  # 0: the row has finished, its n stays
        for cache in self._caches():
            cache.live = self.live  # a finished row's steps read (almost) none of its cache
        self.drafts = torch.zeros(rows, gamma, dtype=torch.long, device=device)
        # [a, v_0..v_γ, kind, found] per row: what the host reads (kind: the kind of the last node a tree round
        # kept, draft_tree.CHAIN / RETRIEVED / SIBLING; found: retrieval's next round has a match)
        self.report = torch.zeros(rows, gamma + 4, dtype=torch.long, device=device)
        self.block_offsets = torch.arange(gamma + 1, device=device)
        if self.lagging:
            self.lag_offsets = torch.arange(LAG_BLOCK, device=device)
        if self.tree is not None or self.lagging:  # the drafter holds positions < held (catch-ups)
            self.held = torch.zeros(rows, dtype=torch.long, device=device)
        if self.tree is not None:  # what its last draft step fed it
            self.fed = torch.zeros(rows, gamma, dtype=torch.long, device=device)
            self.fed_at = torch.zeros(rows, dtype=torch.long, device=device)
            self.fed_valid = torch.zeros(rows, dtype=torch.bool, device=device)
            self.tree_constants = self.tree.constants(device)
        if self.tree is not None and spec.host:  # the last tree verified, for the host-side rules: node tokens,
            # parents, depths, ancestor bits, kinds [B, N+1] (see draft_tree)
            self.nodes = torch.zeros(5, rows, self.tree.size + 1, dtype=torch.long, device=device)
        if spec.retrieval:
            self.retrieved = torch.zeros(rows, gamma, dtype=torch.long, device=device)  # grafted into the tree
        if self.grows_tree:  # the drafter's other nodes (draft_tree.DraftTree)
            tree = self.tree
            self.pool_tokens = torch.zeros(rows, tree.pool, dtype=torch.long, device=device)
            self.pool_scores = torch.zeros(rows, tree.pool, dtype=torch.float32, device=device)
            self.frontier = torch.full((rows, max(gamma - 1, 1), tree.width), -1, dtype=torch.long, device=device)
            self.block_tokens = torch.zeros(rows, tree.block, dtype=torch.long, device=device)
            self.block_bits = torch.zeros(rows, tree.block, dtype=torch.long, device=device)
        self._rows = torch.arange(rows, device=device)[:, None]  # [B, 1]
        vocab = verifier.get_output_embeddings().weight.shape[0]
        self.vocab = vocab
        # Vocabularies that differ by padding (front checks the tokenizer stays below the shared range): drafts are
        # limited to the shared ids, and a sequence id the drafter lacks reaches it as id 0
        self.draft_vocab = None  # (the drafter's output ids, its input ids)
        if drafter is not None and drafter is not verifier:
            d_out = drafter.get_output_embeddings().weight.shape[0]
            d_in = drafter.get_input_embeddings().weight.shape[0]
            if (d_out, d_in) != (vocab, vocab):
                self.draft_vocab = (d_out, d_in)
        self.eos_mask = torch.zeros(vocab, dtype=torch.bool, device=device)  # EOS ids, masked below eos_floor
        self.eos_floor = torch.zeros(rows, dtype=torch.long, device=device)  # min_length / min_new_tokens, absolute
        self._eos_rules = ((0,) * rows, ())  # what eos_floor and eos_mask hold (set_min_length's arguments)
        self.warpers = warpers  # None: greedy
        self.penalty = spec.penalty
        if self.penalty is not None:  # the repetition penalty: each row's tokens so far, as a mask over the vocabulary
            self.seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
            self.draft_seen = torch.zeros_like(self.seen)  # and the drafts so far, while drafting
        if warpers is not None:  # the drafter's probabilities of each draft
            self.q = torch.zeros(rows, gamma, vocab, dtype=torch.float32, device=device)
        self.draft_input = torch.zeros(rows, 1, dtype=torch.long, device=device)  # a draft step's input token
        self.draft_index = [torch.full((1,), i, dtype=torch.long, device=device) for i in range(gamma)]
        if spec.host:  # the verify step's raw logits (a tree's: N + 1), for the host-side rules (:mod:`.host_rules`)
            width = gamma + 1 if self.tree is None else self.tree.size + 1
            self.logits = torch.zeros(rows, width, vocab, dtype=torch.float32, device=device)

    def _start_state(self, verifier, drafter) -> None:
        """Graphs, steps, what the controller and the prefills carry across calls, and the compile stage."""
        spec, device, rows = self.spec, self.spec.device, self.spec.batch
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # every CUDA device a step runs on (a model dispatched over several devices: one graph spans them all)
        self.devices = sorted({d.index for c in self._caches() for d in c.layer_devices if d.type == "cuda"}
                              - {device.index})
        self.devices = [device.index] + self.devices if device.type == "cuda" else []
        self.steps: dict = {}  # name, or (name, width) for a width other than γ -> CapturedStep
        self.controller_memory = ControllerMemory(spec.gamma)  # what the draft-length controller learnt so far
        self.attention_switches = {}  # id(model) -> graph_steps.AttentionSwitch of its calls' attention switch
        self.drafter_deferred = False  # the drafter's prefill waits for a round that drafts (:meth:`prefill`)
        self.drafter_prefills = 0  # the drafter's prefills on this engine so far (the first pays one-time costs)
        self.holds_sequence = False  # the verifier's cache holds row 0's sequence up to n - 2 (a call ended)
        # token types (spec.token_types): each row's prompt's [1, P], and the last one [B, 1] for generated tokens
        self.prompt_types: list[torch.Tensor] = []
        self.types = torch.zeros(rows, 1, dtype=torch.long, device=device) if spec.token_types else None
        self.reused = 0  # positions the last prefill found in the verifier's cache (a chat's earlier turns)
        # a separate drafter's full cache: the leading positions of row 0 it holds from the last call (set at a call's
        # end, the rounds knowing what it read), and where this call's prefill of it starts (at most ``reused``)
        self.drafter_holds = 0
        self.drafter_start = 0
        self.drafter_prefill_tokens = 0  # prompt tokens the drafter's prefills read in this call
        self.prompt_queries: list[dict] = []  # a deferred self-drafter's kept prompt queries, per row and layer
        # steps compiled now (compile_policy: from the first call, or once uncompiled calls have taken long enough)
        self.compiled = False
        self.light = False  # the compiled steps are light (graph_steps.light_step_backend), not Inductor's
        # each model's decoder layers, which light steps trace one for all (regional); None: they trace steps whole
        found = [decoder_layers(m) for m in {id(m): m for m in (verifier, drafter) if m is not None}.values()]
        self.layers = None if any(f is None for f in found) else found
        self.compiles_prefill = False  # prefills compiled too (where prefill_pays and their cache allows)
        self.compile_failed = False  # compiling a step raised: the engine's steps stay uncompiled
        self._prefill_pays = {id(m): prefill_pays(m) for m in (verifier, drafter) if m is not None}
        self._compiled_draft_tokens: dict = {}  # reread -> the compiled draft step (:meth:`draft_token`)
        self.compile_if_due()
        self.nbytes = sum(c.nbytes() for c in self._caches()) + self.seq.nbytes  # what keeping it holds, about

    @property
    def verifier(self):
        return self._verifier()

    def prefill_compiled(self, model) -> bool:
        """Whether ``model``'s prefills on this engine run compiled (where their cache allows)."""
        return self.compiles_prefill and self._prefill_pays[id(model)]

    def compile_if_due(self) -> None:
        """At a call's start: what :mod:`.compile_policy` compiles now. Steps that ran uncompiled, or light where
        they are now due to compile fully, are dropped (with their graphs); the call compiles and captures each anew
        on first use."""
        if not self.spec.compiled or self.compile_failed:
            return
        level = compiles(self.verifier, compile_setting(self.use_graphs), len(self.steps),
                         self.layers is not None and regional_setting())
        if level is not None and (not self.compiled or (self.light and level != "light")):
            _release_graphs([self])
            if self.pool is not None:  # (a tensor the old graphs allocated may still hold their pool: CUDA's
                self.pool = torch.cuda.graph_pool_handle()  # allocator refuses to capture into it again)
            self.compiled, self.light = True, level == "light"
            self.controller_memory.samples.clear()  # (round times of the uncompiled steps; acceptances stay)
        self.compiles_prefill = level == "all"

    @property
    def drafter(self):
        return None if self._drafter is None else self._drafter()

    def same_configuration(self, drafter, spec: EngineSpec, use_graphs: bool) -> bool:
        """Whether this engine was built for ``drafter``, ``spec`` and ``use_graphs`` (whatever its lengths)."""
        return self.drafter is drafter and spec == self.spec and use_graphs == self.use_graphs

    def fits(self, drafter, spec: EngineSpec, max_tokens: int, max_new: int, use_graphs: bool) -> bool:
        return (self.same_configuration(drafter, spec, use_graphs) and max_tokens <= self.max_tokens
                and max_new <= self.max_new)

    # ---- device-only steps (captured on CUDA); every tensor has one row per sequence
    def last(self, back: int) -> torch.Tensor:
        """``seq[b, n[b] - back]`` of every row, ``[B, 1]``."""
        return self.seq.gather(1, (self.n - back)[:, None])

    def _draft(self, width: int | None = None) -> None:  # retrieval drafts at the end of the step before
        if self.grows_tree:  # (:meth:`_advance`): no draft step
            draft_tree(self)
        else:
            draft(self, width)

    def draft_token(self, index: torch.Tensor, reread: bool = False) -> None:
        """One draft step (:func:`~.drafting.draft_token`), compiled on its own when the steps are: every width's
        draft step replays the same compiled code (and a queued round's first step, which reads ``seq[n-2]`` too,
        its own), so an adaptive engine compiles one or two draft steps, not one per width."""
        if not self.compiled:
            draft_token(self, index, reread)
            return
        compiled = self._compiled_draft_tokens.get(reread)
        if compiled is None:
            compiled = self._compiled_draft_tokens[reread] = compiled_step(
                functools.partial(draft_token, self, reread=reread), self.spec.draft_weights == "int4", self.light,
                self.layers)
        compiled(index)

    def _queued_draft(self, width: int | None = None) -> None:
        draft(self, width, reread=True)

    def _catch_up(self) -> None:
        catch_up(self)

    def _catch_up_block(self) -> None:
        catch_up_block(self)

    def _catch_up_lag(self) -> None:
        (catch_up_copy if self.self_drafting else catch_up_lag)(self)

    def set_min_length(self, floors: list[int], eos_token_ids: list[int]) -> None:
        """Greedy generate()'s min_length/min_new_tokens: EOS cannot be row b's token at sequence index <
        ``floors[b]``. Written only where they differ from the last call's (a host-to-device copy and two launches
        otherwise; nothing else writes ``eos_floor`` or ``eos_mask``)."""
        rules = (tuple(floors) if eos_token_ids else (0,) * len(floors), tuple(eos_token_ids))
        if rules == self._eos_rules:
            return
        self._eos_rules = None  # (until both are written)
        self.eos_floor.copy_(torch.tensor(rules[0]))
        self.eos_mask.zero_()
        if eos_token_ids:
            self.eos_mask[[e for e in eos_token_ids if 0 <= e < self.eos_mask.numel()]] = True
        self._eos_rules = rules

    def _seen_after(self, drafts: torch.Tensor, length: int) -> torch.Tensor | None:
        """The repetition penalty's masks ``[B, length, V]`` of the positions after each row's sequence and its first
        ``0..length-1`` drafts (None without a penalty)."""
        if self.penalty is None:
            return None
        masks = [self.seen]
        for i in range(length - 1):
            masks.append(masks[-1].scatter(1, drafts[:, i : i + 1], True))
        return torch.stack(masks, 1)

    def _tree_seen(self, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor | None:
        """The repetition penalty's masks ``[B, N+1, V]`` after each node of a tree (the sequence and the node's path),
        None without a penalty."""
        if self.penalty is None:
            return None
        own = torch.zeros(*tokens.shape, self.vocab, dtype=torch.bool, device=tokens.device)
        own[:, 1:].scatter_(2, tokens[:, 1:, None], True)  # the root's token is in seen already
        masks = self.seen[:, None] | own
        for _ in range(self.spec.gamma):
            masks = own | masks.gather(1, parents[..., None].expand_as(masks))
        return masks

    def _floored(self, logits: torch.Tensor, first_index: torch.Tensor, seen: torch.Tensor | None = None,
                 offsets: torch.Tensor | None = None):
        """``logits [B, L, V]`` for the tokens at sequence indices ``first_index[b] + offsets[b]`` (default ``0..L-1``),
        with the repetition penalty where ``seen [B, L, V]`` is given, and EOS masked below ``eos_floor`` (on the
        device: no host branch)."""
        if seen is not None:
            logits = penalized(logits, seen, self.penalty[0])
        index = first_index[:, None] + (self.block_offsets[: logits.shape[1]] if offsets is None else offsets)
        early = (index < self.eos_floor[:, None])[..., None] & self.eos_mask
        return logits.masked_fill(early, float("-inf"))

    def probabilities(self, logits: torch.Tensor, first_index: torch.Tensor, seen: torch.Tensor | None = None,
                      offsets: torch.Tensor | None = None):
        """Sampling: the processed distributions ``[B, L, V]`` (float32) of ``logits [B, L, V]`` (see
        :meth:`_floored`)."""
        scores = self._floored(logits.float(), first_index, seen, offsets)
        flat = scores.flatten(0, 1)
        for warper in self.warpers:
            flat = warper(None, flat)  # the device warpers read only the scores, row by row
        return torch.softmax(flat, -1).view_as(scores)

    def _next(self, logits: torch.Tensor, first_index: torch.Tensor, seen: torch.Tensor | None = None):
        """The verifier's tokens ``[B, L]`` after ``logits [B, L, V]``: argmax, or a draw when sampling."""
        if self.warpers is None:
            return self._floored(logits, first_index, seen).argmax(-1)
        return draw(self.probabilities(logits, first_index, seen))

    def _advance(self, tokens: torch.Tensor, accepted: torch.Tensor) -> None:
        """Write ``tokens [B, L]`` at ``seq[b, n[b]..]``, move the live rows' ``n`` past ``accepted + 1`` of them and
        leave ``[a, tokens]`` in the report (retrieval: then the next round's drafts, :func:`~.retrieval.retrieve`)."""
        # an indexed assignment, which the compiler keeps in place (a scatter_ compiles to a copy of all of seq)
        self.seq[self._rows, self.n[:, None] + self.block_offsets[: tokens.shape[1]]] = tokens
        if self.penalty is not None:  # the kept tokens join each row's seen set (a dropped one repeats token 0)
            kept = self.block_offsets[: tokens.shape[1]] <= accepted[:, None]
            # the value a device tensor: a Python True is a CPU tensor, whose copy a CUDA graph cannot capture
            self.seen[self._rows, torch.where(kept, tokens, tokens[:, :1])] = kept.new_ones(())
        self.n.add_((accepted + 1) * self.live)
        self.report[:, :1].copy_(accepted[:, None])
        self.report[:, 1 : tokens.shape[1] + 1].copy_(tokens)
        if self.tree is not None:
            self._update_held()
        if self.spec.mode == "lookup" or self.spec.retrieval:
            retrieve(self)

    def _update_held(self) -> None:
        """After a verification: the drafter holds the positions its last draft step fed it as long as those tokens
        are the sequence's (never past ``n - 1``, which the next draft step feeds); without a draft step since the
        last verification, ``held`` stays."""
        fed_len = self.fed.shape[1]
        actual = self.seq.gather(1, self.fed_at[:, None] + self.block_offsets[:fed_len])
        lead = (self.fed == actual).long().cumprod(1).sum(1)
        held = torch.minimum(self.fed_at + lead, self.n - 1)
        self.held.copy_(torch.where(self.fed_valid, held, self.held))
        self.fed_valid.zero_()

    def _verify_forward(self, width: int | None = None) -> torch.Tensor:
        """The verifier on ``[seq[n-1], drafts[:, :width]]`` (default: all γ) at positions ``n-1..n-1+width``: its
        logits ``[B, width+1, V]``."""
        width = self.spec.gamma if width is None else width
        block = torch.cat([self.last(1), self.drafts[:, :width]], 1)
        positions = (self.n - 1)[:, None] + self.block_offsets[: width + 1]
        return self._verifier_step(block, positions, 0)

    def _verifier_step(self, tokens: torch.Tensor, positions: torch.Tensor, logits_to_keep: int,
                       companion: bool = True) -> torch.Tensor:
        """The verifier on ``tokens [B, L]`` at ``positions [B, L]`` over its cache. Self-drafting (and
        ``companion``): the keys/values also go to the drafter's cache (as the prefill's do), which so holds every
        kept token without a drafter step (a round's accepted drafts and the token after them, a plain step's token
        unless the engine lags; later slots are written again before they are read)."""
        if not (self.self_drafting and companion):
            return static_forward(self.verifier, tokens, positions, self.verifier_cache, logits_to_keep,
                                  self.verifier_keyword)
        self.drafter_cache.begin_step(positions)
        self.verifier_cache.companion = self.drafter_cache
        try:
            return static_forward(self.verifier, tokens, positions, self.verifier_cache, logits_to_keep,
                                  self.verifier_keyword)
        finally:
            self.verifier_cache.companion = None

    def _tree_forward(self) -> tuple[torch.Tensor, tuple]:
        """The verifier on the round's tree (:mod:`.draft_tree`, built here from the drafts, the drafter's
        alternatives and the retrieved continuations; with host-side rules kept in :attr:`nodes`): its logits ``[B,
        N+1, V]`` and the tree ``(tokens, parents, depths, bits, kinds)``."""
        tree = self.tree
        pool = (self.pool_tokens, self.pool_scores) if self.grows_tree else None
        built = tree.build(self.tree_constants, self.drafts, pool, self.frontier if self.grows_tree else None,
                           self.retrieved[:, : tree.retrieved] if tree.retrieved else None,
                           self.report[:, -1] > 0 if tree.retrieved else None)
        if self.spec.host:
            for buffer, value in zip(self.nodes, built):
                buffer.copy_(value)
        tokens, _, depths, bits, _ = built
        block = torch.cat([self.last(1), tokens[:, 1:]], 1)
        logits = static_forward(self.verifier, block, (self.n - 1)[:, None] + depths, self.verifier_cache, 0,
                                self.verifier_keyword, tree=bits)
        return logits, built

    def _keep(self, node: torch.Tensor, built: tuple) -> torch.Tensor:
        """After a tree forward: each row keeps the path to its ``node [B]`` of the tree ``built``, whose keys/values
        move to the slots of their positions (where the chain's sit), and no row's cache shows the other extra
        nodes' slots. Returns the path's nodes ``[B, γ]`` (past the node's depth: the chain's, which stay)."""
        gamma = self.spec.gamma
        _, _, depths, bits, kinds = built
        path = path_nodes(bits, depths, node, gamma)
        depth = self.tree_constants["depth_of"]
        path = torch.where(depth <= depths.gather(1, node[:, None]), path, depth)
        root = (self.n - 1)[:, None]
        extra = self.tree_constants["slot"] + (gamma + 1)
        self.verifier_cache.keep_path(root + path, root + depth, root + extra)
        self.report[:, -2].copy_(kinds.gather(1, node[:, None])[:, 0])
        return path

    def _verify_tree(self) -> None:
        logits, built = self._tree_forward()
        tokens, parents, depths, _, _ = built
        seen = self._tree_seen(tokens, parents)
        gamma = self.spec.gamma
        if self.warpers is None:
            targets = self._floored(logits, self.n, seen, depths).argmax(-1)
            node, accepted, token = walk_tree(tokens, parents, gamma, targets=targets)
        else:
            p = self.probabilities(logits, self.n, seen, depths)
            node, accepted, token = walk_tree(tokens, parents, gamma, p=p, q=self.q)
        path = tokens.gather(1, self._keep(node, built))
        emitted = torch.where(self.block_offsets < accepted[:, None], torch.cat([path, token[:, None]], 1),
                              token[:, None])
        self._advance(emitted, accepted)

    def _tree_logits(self) -> None:
        """Host-side rules: the tree forward alone, its raw logits left in :attr:`logits`."""
        self.logits.copy_(self._tree_forward()[0].float())

    def _ar_forward(self) -> torch.Tensor:
        """The verifier on ``seq[n-1]`` alone (a round without drafts): its logits ``[B, 1, V]``."""
        return self._verifier_step(self.last(1), (self.n - 1)[:, None], 1, companion=not self.lagging)

    def _verify(self, width: int | None = None) -> None:
        drafts = self.drafts if width is None else self.drafts[:, :width]
        logits = self._verify_forward(width)
        seen = self._seen_after(drafts, logits.shape[1])
        if self.warpers is None:
            verified = self._next(logits, self.n, seen)
            accepted = accepted_length(drafts, verified)
            if self.cap is not None:  # v_0..v_cap saw the row's one quantization state: keep no later token
                accepted = torch.minimum(accepted, self.cap)
        else:  # the accepted drafts, then the token drawn after them (the rest is overwritten later)
            p = self.probabilities(logits, self.n, seen)
            q = self.q[:, : drafts.shape[1]]  # (a sampled int4 batch runs row by row: no cap)
            accepted, token = accept_or_resample(p, q, drafts)
            offsets = self.block_offsets[: drafts.shape[1] + 1]
            verified = torch.where(offsets < accepted[:, None], torch.cat([drafts, token[:, None]], 1), token[:, None])
        self._advance(verified, accepted)

    def _verify_logits(self, width: int | None = None) -> None:
        """Host-side rules: the verify forward alone, its raw logits left in :attr:`logits`."""
        logits = self._verify_forward(width)
        self.logits[:, : logits.shape[1]].copy_(logits.float())

    def _ar_logits(self) -> None:
        """Host-side rules: one verifier step (a round without drafts), its raw logits left in ``logits[:, 0]``."""
        self.logits[:, :1].copy_(self._ar_forward().float())

    def write_back(self, prefix, row: int, length: int) -> None:
        """Extend ``prefix`` (a ``DynamicCache``: the caller's, empty or holding the first tokens of the prompt, or a
        new one for the returned output) with the verifier's keys/values of row ``row`` up to ``length`` tokens (the
        sequence but its last token, as stock ``generate()`` leaves its cache; int4: as verification read them, the
        INT8 view)."""
        start = prefix.get_seq_length()
        for i in range(len(self.verifier_cache.layers)):
            keys, values = self.verifier_cache.sequence(i, row, start, length)
            held = prefix.layers[i] if i < len(prefix.layers) else None  # DynamicCache(config=...): layers start empty
            device = held.keys.device if held is not None and held.is_initialized else keys.device
            prefix.update(keys.to(device, copy=True), values.to(device, copy=True), i)

    def commit(self, emitted: list[list[int]], accepted: list[int], nodes: list[int] | None = None) -> None:
        """Host-side rules: write each row's ``emitted`` tokens (its ``accepted`` drafts and the token after them; an
        empty list for a finished row) as a verify step would (eager, between the captured steps); after a tree
        forward, ``nodes[b]``: the last node row b kept."""
        width = self.spec.gamma + 1
        block = [e + [e[0]] * (width - len(e)) if e else [0] * width for e in emitted]
        device = self.seq.device
        if nodes is not None:
            self._keep(torch.tensor(nodes, device=device), tuple(self.nodes))
        self._advance(torch.tensor(block, device=device), torch.tensor(accepted, device=device))

    def _ar_step(self) -> None:
        logits = self._ar_forward()
        token = self._next(logits, self.n, None if self.penalty is None else self.seen[:, None])
        self._advance(token, torch.zeros_like(self.n))  # a round of no drafts: a = 0, v_0 = the token

    def run_step(self, name: str, width: int | None = None, run: bool = True) -> bool:
        """Run (and on first use, capture) the step ``name`` (``"draft"``, ``"verify"``, ``"verify_logits"``: of
        ``width`` drafts, default γ; ``run=False``: only capture it); the drafter's steps with its 4-bit weights where
        the spec asks for them (:mod:`.draft_weights`). Returns whether the step was new (compiled or captured in
        this call) or replayed its graph for the first time: its time then is no sample of the step's."""
        key = self._key(name, width)
        on_copies = self.spec.draft_weights == "int4" and (name.endswith("draft") or name.startswith("catch_up"))
        with drafting(on_copies):
            step = self.steps.get(key)
            new = step is None
            if new:
                fn = getattr(self, "_" + name)
                # (a chain's draft steps replay one-token steps compiled on their own)
                per_token = name.endswith("draft") and not self.grows_tree
                step = self.steps[key] = CapturedStep(fn if key == name else functools.partial(fn, width), self.pool,
                                                      self.compiled and not per_token, self.devices, on_copies,
                                                      self.light, self.layers)
                if self.use_graphs:
                    self._capture(step)
            if run:
                new |= step()
        return new

    def _key(self, name: str, width: int | None) -> str | tuple:
        return name if width is None or width == self.spec.gamma else (name, width)

    def capture_widths(self, widths: tuple[int, ...], queued: bool = False) -> None:
        """Adaptive engines on CUDA graphs: capture the steps of every width the controller may choose (and the
        catch-ups; ``queued``: the queued rounds' draft steps too) once, right after a prefill, so that no later round
        pays a capture. Their warm-up runs write only past each row's sequence (restored or overwritten later)."""
        if not self.use_graphs:
            return
        if self.lagging:
            self.held.copy_(self.n - 1)  # the catch-up's warm-up then writes past the sequence only
        self.run_step("ar_logits" if self.spec.host else "ar_step", run=False)
        if self.grows_tree:  # a tree of its one size, or a plain step
            verify = "tree_logits" if self.spec.host else "verify_tree"
        else:
            verify = "verify_logits" if self.spec.host else "verify"
        names = [verify] + ([] if self.spec.mode == "lookup" else ["draft"]) + (["queued_draft"] if queued else [])
        steps = [(name, width) for width in widths for name in names]
        if self.lagging:  # what the drafter missed in plain rounds: one token, or blocks of LAG_BLOCK (their warm-ups
            if not (self.grows_tree or self.self_drafting):  # write from the slot of n - 1 on, as every draft
                steps.append(("catch_up", None))  # step's does; a tree's draft step reads up to γ + 1 missed
                # tokens itself; self-drafting copies every missed token)
            steps.append(("catch_up_lag", None))
        new = [(name, width) for name, width in steps if self._key(name, width) not in self.steps]
        for name, width in tqdm(new, desc="hf_sparsekv: compiling and capturing steps", unit="step", leave=False,
                                disable=not self.compiled or len(new) < 2):
            self.run_step(name, width, run=False)

    def _capture(self, step: CapturedStep) -> None:
        # what a step's warm-up changes and a later round reads before writing it again
        restore = tuple(getattr(self, name) for name in ("n", "seq", "seen", "held", "cap")
                        if getattr(self, name, None) is not None)
        if self.compiled:
            logger.warning_once(LIGHT_COMPILE_NOTICE if self.light else COMPILE_NOTICE)
            try:
                step.capture(restore)
                return
            except Exception as err:  # a forward torch.compile cannot take: capture the eager step
                logger.warning_once(f"hf_sparsekv: compiling the static steps failed ({type(err).__name__}: {err}); "
                                    "capturing them uncompiled")
                with DEVICE_WIDE:
                    torch.cuda.synchronize()
                    release_generator_after_failed_capture()
                self.compiled, self.compile_failed = False, True
                step.uncompile()
        try:
            step.capture(restore)
        except Exception as err:  # an architecture whose forward does not capture: run it eagerly
            logger.warning_once(f"hf_sparsekv: CUDA-graph capture failed ({type(err).__name__}: {err}); "
                                "running the static loop without graphs")
            self.use_graphs = False
            with DEVICE_WIDE:
                torch.cuda.synchronize()
                release_generator_after_failed_capture()

    # ---- prefill
    def prefill(self, prompts: list[torch.Tensor], host_first=None, prefixes: list | None = None,
                defer_drafter: bool = False, timer=None, token_types: list | None = None) -> list[int]:
        """Reset the caches and feed ``prompts[b] [1, P_b]`` to row b of both models' caches (one batch-1 forward per
        row and model); returns each row's first token from the verifier (``host_first(row, raw [1, V])``, host-side
        rules: chosen on the host from its float32 logits). ``prefixes[b]``: a ``DynamicCache`` holding the first
        tokens of row b's prompt (prompt caching), copied into the verifier's row, which then reads only the rest.
        ``defer_drafter`` (where :attr:`defers_drafter`): the drafter's cache is left empty, for
        :meth:`prefill_drafter` when a round first drafts (:attr:`drafter_deferred` says whether it was; a
        self-drafter keeps its prompt's voting queries for it, unless they would take more than
        :data:`DEFERRED_QUERY_BYTES`; one not deferred is filled the same way right after the verifier's prefill
        where that prefill compiles, :func:`~.graph_steps.prefill_compiles`). ``timer``: marks the phase
        ``"drafter_prefill"`` around a separate drafter's prefill forwards (``mark(name, start)``), from its second
        prefill on this engine (the first pays one-time costs: lazy initialisation, kernel and plan choice; 150 ms
        once for a 16K prompt on an H200, 20x the next). ``token_types[b]`` ``[1, P_b]``: row b's token types
        (engines with ``spec.token_types``), fed by :meth:`typed_forwards`."""
        if len(prompts) != self.spec.batch:
            raise ValueError(f"an engine of {self.spec.batch} rows was given {len(prompts)} prompts")
        plan = self._plan_prefill(prompts, prefixes, defer_drafter, token_types)
        last = [self._prefill_row(row, prompt, plan, prefixes, timer) for row, prompt in enumerate(prompts)]
        self.drafter_prefills += plan.separate and not self.drafter_deferred and not plan.fills_after
        if plan.fills_after:
            self.prefill_drafter(prompts)
        return self._first_tokens(last, host_first)

    def _plan_prefill(self, prompts: list[torch.Tensor], prefixes: list | None, defer_drafter: bool,
                      token_types: list | None) -> _PrefillPlan:
        """Reset the caches and decide how :meth:`prefill` fills them: what the verifier's cache holds of row 0's
        prompt already, whether the drafter's prefill is deferred, whether a self-drafter keeps its prompt's
        queries."""
        separate = self.drafter_cache is not None and self.drafter_cache is not self.verifier_cache
        shared_prefill = separate and self.drafter is self.verifier  # self-drafting: one prefill fills both caches
        if self.spec.token_types:
            if token_types is None or len(token_types) != len(prompts):
                raise ValueError("an engine built for token types needs each prompt's token_type_ids")
            self.prompt_types = [t.to(self.seq.device) for t in token_types]
            for row, types in enumerate(self.prompt_types):
                self.types[row] = types[0, -1]
        self.reused = 0 if shared_prefill or self.spec.token_types else self._held_prefix(prompts)
        self.drafter_start = min(self.reused, self.drafter_holds) if self.keeps_drafter_prefix else 0
        self.drafter_holds, self.drafter_prefill_tokens = 0, 0
        self.holds_sequence = False
        self.verifier_cache.reset()  # (slot positions only: the buffers keep what a reused prefix needs)
        if separate:
            self.drafter_cache.reset()
        voting = [self._voting_queries(prompt.shape[1]) for prompt in prompts] if shared_prefill else []
        keeps_queries = shared_prefill and not (  # (a prefix: not the whole prompt's keys)
            (prefixes is not None and any(x is not None and x.get_seq_length() > 0 for x in prefixes))
            or sum(voting) * self._query_bytes() > DEFERRED_QUERY_BYTES)
        self.drafter_deferred = defer_drafter and self.defers_drafter and (keeps_queries or not shared_prefill)
        # a self-drafter whose verifier prefill compiles is filled right after it, as a deferred one is later
        fills_after = (keeps_queries and not self.drafter_deferred and self.prefill_compiled(self.verifier)
                       and prefill_compiles(self.verifier_cache))
        self.prompt_queries = [{} for _ in prompts]  # a deferred self-drafter's: row -> layer -> (queries, scaling)
        return _PrefillPlan(separate, shared_prefill, voting, fills_after)

    def _prefill_row(self, row: int, prompt: torch.Tensor, plan: _PrefillPlan, prefixes: list | None,
                     timer) -> torch.Tensor:
        """Row ``row``'s prompt ``[1, P]`` into the verifier's cache (and the drafter's, as ``plan`` says), its
        sequence and length; the verifier's logits at its last position ``[V]``."""
        p = prompt.shape[1]
        fills_drafter = plan.shared_prefill and not (self.drafter_deferred or plan.fills_after)
        if fills_drafter:
            self.drafter_cache.begin_prefill(p, row)
            self.verifier_cache.companion = self.drafter_cache
        elif plan.shared_prefill and plan.voting[row]:
            self.verifier_cache.prompt_queries = functools.partial(_keep_queries, self.prompt_queries[row],
                                                                   plan.voting[row])
        try:
            prefix = None if prefixes is None else prefixes[row]
            start = self.reused if row == 0 else 0
            held = 0 if prefix is None else prefix.get_seq_length()
            if held > start:  # (a prefix the cache does not hold already: copied in)
                start = self.verifier_cache.load_prefix([(layer.keys, layer.values) for layer in prefix.layers], row)
            last = static_prefill(self.verifier, prompt, self.verifier_cache, row, start,
                                  self.prefill_compiled(self.verifier))
        finally:
            self.verifier_cache.companion = self.verifier_cache.prompt_queries = None
        if fills_drafter:
            self.drafter_cache.end_prefill()
        elif plan.separate and not plan.shared_prefill and not self.drafter_deferred:
            timed = timer is not None and self.drafter_prefills > 0
            if timed:
                timer.mark("drafter_prefill", True)
            self._prefill_separate_drafter(prompt, row)
            if timed:
                timer.mark("drafter_prefill", False)
        self.seq[row, :p].copy_(prompt[0])
        self.n[row] = p
        if self.penalty is not None:
            self.seen[row].zero_()
            self.seen[row, prompt[0, self.penalty[1] :]] = True
        return last

    def _first_tokens(self, last: list[torch.Tensor], host_first) -> list[int]:
        """Each row's first new token from its prompt's last logits ``last[b] [V]`` (``host_first``: chosen on the
        host), appended to the sequences; the round state set for the first round."""
        seen = None if self.penalty is None else self.seen[:, None]
        if host_first is None:
            first = self._next(torch.stack(last)[:, None], self.n, seen)[:, 0]
        else:
            first = torch.tensor([host_first(row, raw.float()[None]) for row, raw in enumerate(last)],
                                 device=self.seq.device)
        if self.penalty is not None:
            self.seen.scatter_(1, first[:, None], True)
        self.seq.scatter_(1, self.n[:, None], first[:, None])
        self.n.add_(1)
        self.live.fill_(1)
        if self.tree is not None:
            self.held.copy_(self.n - 1)  # the drafter's prefill: every prompt position
            self.fed_valid.zero_()
        if self.spec.mode == "lookup" or self.spec.retrieval:
            retrieve(self)
        self.holds_sequence = (self.spec.batch == 1 and isinstance(self.verifier_cache, StaticFullCache)
                               and not self.spec.token_types)  # (keys of typed tokens: not reused)
        return first.tolist()

    @contextlib.contextmanager
    def typed_forwards(self):
        """Inside the block (a call on an engine with ``spec.token_types``), every forward of the verifier gets
        ``token_type_ids``: during a prefill the prompt's types of the positions fed, in a step each row's last
        prompt type for every token (captured into the graphs like any other step input)."""
        if not self.spec.token_types:
            yield
            return
        handle = self.verifier.register_forward_pre_hook(self._add_token_types, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def _add_token_types(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None or kwargs.get("token_type_ids") is not None:
            return None
        cache = self.verifier_cache
        if cache.prefilling:
            start = cache.prefill_start
            types = self.prompt_types[cache.prefill_row][:, start : start + ids.shape[1]]
        else:
            types = self.types.expand(-1, ids.shape[1])
        return args, {**kwargs, "token_type_ids": types}

    def _held_prefix(self, prompts: list[torch.Tensor]) -> int:
        """A chat's next turn: how many leading positions of the one-row ``prompts[0]`` the verifier's full cache
        still holds from the engine's last call (its sequence up to ``n - 2``, all but the last token; the tokens
        compared on the device), at most the prompt's length - 2 (the prefill's last position gives the first
        token, and a prefill of one token is a shape a compiled prefill would compile anew); 0 where nothing is
        held."""
        if not self.holds_sequence:
            return 0
        prompt = prompts[0][0].to(self.seq.device)
        m = min(int(self.n[0]) - 1, prompt.shape[0] - 2)
        if m <= 0:
            return 0
        differs = (self.seq[0, :m] != prompt[:m]).nonzero()
        return int(differs[0, 0]) if len(differs) else m

    @property
    def defers_drafter(self) -> bool:
        """Whether :meth:`prefill` may leave the drafter's prefill for later: a drafter that catches up after plain
        steps (a lagging chain; a tree's draft step would read from ``held``)."""
        return self.lagging and not self.grows_tree

    def prefill_drafter(self, prompts: list[torch.Tensor]) -> None:
        """The drafter's prefill that :meth:`prefill` deferred: row b's prompt ``[1, P_b]`` into its empty cache (a
        separate drafter: its forward; a self-drafter: the verifier's own keys/values of the prompt, and its chunks
        selected from the queries kept at the prefill, as the shared prefill would have); the drafter then holds
        positions ``0..P_b-1``, and the host catches it up on the tokens since (eager, mid-call: the captured steps
        read the same buffers)."""
        self.drafter_cache.reset()
        for row, prompt in enumerate(prompts):
            if not self.self_drafting:
                self._prefill_separate_drafter(prompt, row)
                continue
            p = prompt.shape[1]
            self.drafter_cache.begin_prefill(p, row)
            self.drafter_cache.store_prompt_layers(
                [self.verifier_cache.sequence(i, row, 0, p) for i in range(len(self.drafter_cache.layers))],
                self.prompt_queries[row])
            self.drafter_cache.end_prefill()
        self.drafter_deferred = False
        self.drafter_prefills += 1
        self.prompt_queries = []  # (read: not kept past their one use)

    def _prefill_separate_drafter(self, prompt: torch.Tensor, row: int) -> None:
        """A separate drafter's prefill of ``prompt [1, P]`` into row ``row`` of its (reset) cache; row 0 from
        :attr:`drafter_start`, the leading positions its full cache still holds of a chat's earlier turns."""
        start = self.drafter_start if row == 0 else 0
        static_prefill(self.drafter, drafter_input(prompt, self.draft_vocab), self.drafter_cache, row, start,
                       compiled=self.prefill_compiled(self.drafter), kept_only=True)
        self.drafter_prefill_tokens += self.drafter_reads(prompt.shape[1]) - start

    def drafter_reads(self, length: int) -> int:
        """The prompt tokens the drafter's prefill of a ``length``-token prompt reads: a separate drafter's, only
        those its cache keeps where it says which (a sink + window: what its drafts can see of the prompt, its keys
        computed from those alone; ``prefill_reads`` of :mod:`~hf_sparsekv.caches.static`, counted on the host);
        else every one (a self-drafter's cache fill reads the verifier's keys of each)."""
        cache = None if self.self_drafting else self.drafter_cache
        return length if cache is None else cache.prefill_reads(length)

    @property
    def keeps_drafter_prefix(self) -> bool:
        """Whether a separate drafter's cache keeps what it read of the last call's sequence for the next call's
        prefill: one row, a full cache, a chain (a tree's drafter cache holds blocks past ``held`` the host does not
        follow)."""
        return (self.spec.batch == 1 and self.drafter is not None and self.drafter is not self.verifier
                and isinstance(self.drafter_cache, StaticFullCache) and self.tree is None)

    def _voting_queries(self, p: int) -> int:
        """How many of a ``p``-token prompt's last queries a self-drafter's chunk selection reads (0: it selects
        nothing, the prompt fits its budget or the layout keeps a window)."""
        cache = self.drafter_cache
        if getattr(cache, "selection", None) is None or p <= cache.budget:
            return 0
        return voting_queries(cache.selection, p)

    def _query_bytes(self) -> int:
        """Bytes of one prompt position's queries over every layer of the verifier."""
        config = self.verifier.config.get_text_config()
        layers, _, head_dim = _attention_shape(self.verifier)
        return layers * config.num_attention_heads * head_dim * self.spec.dtype.itemsize


def _keep_queries(kept: dict, voting: int, layer_idx: int, query: torch.Tensor, scaling: float) -> None:
    kept[layer_idx] = (query[:, :, -voting:].clone(), scaling)


DEFERRED_QUERY_BYTES = 256 * 2**20  # the most a deferred self-drafter's kept prompt queries may take (all rows)


_engines: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # verifier -> [engines], most recent last
_registry = threading.Lock()  # guards _engines (each list, too)
MAX_ENGINES_PER_MODEL = 16  # configurations a model keeps at most; below that, ENGINE_MEMORY_ENV bounds them
ENGINE_MEMORY_ENV = "HF_SPARSEKV_ENGINE_MEMORY"  # GiB the kept engines' caches of one model may take
ENGINE_MEMORY_SHARE = 0.25  # its default on CUDA: this share of the device's memory (on CPU: 2 GiB)


def engine_memory_budget(device: torch.device) -> int:
    """Bytes the kept engines' caches of one model may take (``HF_SPARSEKV_ENGINE_MEMORY``, in GiB; default: a
    quarter of the CUDA device's memory, 2 GiB on CPU); past it the least recently used engines are freed."""
    value = os.environ.get(ENGINE_MEMORY_ENV, "")
    if value:
        try:
            gib = float(value)
        except ValueError:
            raise ValueError(f"{ENGINE_MEMORY_ENV} must be a number of GiB, got {value!r}") from None
        if gib < 0:
            raise ValueError(f"{ENGINE_MEMORY_ENV} must not be negative, got {value!r}")
        return int(gib * 2**30)
    if device.type == "cuda":
        return int(ENGINE_MEMORY_SHARE * torch.cuda.get_device_properties(device).total_memory)
    return 2 * 2**30


FIRST_CAPACITY = 8192  # positions a configuration's first engine on CUDA graphs holds at least (memory allowing)
FIRST_CAPACITY_SHARE = 1 / 8  # of the kept engines' memory budget (engine_memory_budget) it may take for that


def _position_bytes(*models) -> int:
    """Bytes of one position in a full key/value cache of each of ``models`` (in its own dtype)."""
    total = 0
    for model in {id(m): m for m in models if m is not None}.values():
        layers, heads, head_dim = _attention_shape(model)
        total += 2 * layers * heads * head_dim * next(model.parameters()).element_size()
    return total


def _grown(kept: list, verifier, drafter, spec: EngineSpec, max_tokens: int, use_graphs: bool,
           longest: int | None) -> int:
    """Positions to allocate for a call of ``max_tokens``: where an engine of the same configuration is too short,
    twice its length (a growing sequence of prompts builds O(log n) engines); else, on CUDA graphs, the first of
    :data:`FIRST_CAPACITY` x 1, 2, 4, ... that holds the call, where full caches of the verifier and drafter that long
    (every row) take at most :data:`FIRST_CAPACITY_SHARE` of the memory budget (a chat, or prompts of varying length,
    then captures its steps again rarely or never); else ``max_tokens``. Bounded by ``longest``, the model's
    ``max_position_embeddings``."""
    bound = (lambda n: n) if longest is None else (lambda n: min(n, longest))  # noqa: E731
    shorter = [e.max_tokens for e in kept if e.same_configuration(drafter, spec, use_graphs)]
    if shorter:
        return max(max_tokens, bound(2 * max(shorter)))
    first = FIRST_CAPACITY << max(0, math.ceil(math.log2(max_tokens / FIRST_CAPACITY)))
    if use_graphs and (bound(first) * spec.batch * _position_bytes(verifier, drafter)
                       <= FIRST_CAPACITY_SHARE * engine_memory_budget(spec.device)):
        return max(max_tokens, bound(first))
    return max_tokens


def engine_for(verifier, drafter, mode: str, budget: int | None, gamma: int, max_tokens: int, max_new: int,
               use_graphs: bool, warpers: list | None = None, batch: int = 1,
               penalty: tuple[float, int] | None = None, layout: tuple = (), host: bool = False,
               draft_weights: str = "full", retrieval: int = 0, tree_size: int | None = None,
               adaptive: bool = False, token_types: bool = False) -> StaticEngine:
    """The engine kept on ``verifier`` for this configuration (caches and graphs survive across calls, as
    transformers keeps its static cache), or a new one replacing it. ``warpers``: sampling with these device
    warpers (:func:`~.sampling.device_warpers`); ``None``: greedy. ``batch``: rows decoded together; ``max_tokens``
    bounds every row's length. ``penalty``: the repetition penalty (:func:`~.sampling.repetition_penalty`);
    ``layout``: the drafter cache's settings (:func:`~.draft_modes.draft_mode`; empty: the defaults of ``mode``); ``host``:
    host-side rules (:mod:`.host_rules`); ``draft_weights``: ``"int4"`` drafts on the drafting model's 4-bit weight
    copy (:mod:`.draft_weights`, made here on first use); ``retrieval``: retrieval
    drafting beside the drafter, suffixes of up to this many tokens (:mod:`.retrieval`); ``tree_size``: draft nodes
    per round (:mod:`.draft_tree`; None: one chain); ``adaptive``: each round drafts as many tokens as the controller
    chooses, up to γ (:mod:`.controller`). The caller holds the locks of ``verifier`` and ``drafter``
    (:mod:`.model_locks`) until it is done with the engine: no other call uses or replaces it meanwhile. Under
    tensor parallelism the captured steps hold NCCL all-reduces: :func:`release_engines` must run before
    ``torch.distributed.destroy_process_group()``."""
    # what each model's layers ask of attention: refused here (AttentionNotServed) unless computed exactly
    served = {id(m): served_layers(m) for m in (verifier, drafter) if m is not None}
    dtype = next(verifier.parameters()).dtype
    device = verifier.device
    weights = _weights(verifier, None if drafter is verifier else drafter)
    spec = EngineSpec(mode, budget, gamma, dtype, device, batch, runtime.enabled(device),
                      compile_setting(use_graphs) != "never",
                      weights, warpers_key(warpers), penalty, tuple(layout), host, draft_weights, retrieval, tree_size,
                      adaptive, token_types)
    if draft_weights == "int4" and attach(drafter):  # new copies: no kept step may read the old ones (an engine
        with _registry:  # drafting with ``drafter`` is in use only by a call that holds its lock: this one)
            stale = [e for kept in _engines.values() for e in kept if e.drafter is drafter]
            for kept in _engines.values():
                kept[:] = [e for e in kept if e.drafter is not drafter]
        _release_graphs(stale)
    with _registry:
        kept = _engines.setdefault(verifier, [])
        for engine in kept:
            if engine.fits(drafter, spec, max_tokens, max_new, use_graphs):
                kept.remove(engine)
                kept.append(engine)
                break
        else:
            engine = None
    if engine is not None:
        _keep_within_budget(verifier, device)
        engine.compile_if_due()
        return engine
    with _registry:
        longest = getattr(_text_config(verifier), "max_position_embeddings", None)
        max_tokens = _grown(kept, verifier, drafter, spec, max_tokens, use_graphs, longest)
        # superseded: the same configuration, too short; then the least recently used past the count
        evicted = [e for e in kept if e.same_configuration(drafter, spec, use_graphs)]
        kept[:] = [e for e in kept if e not in evicted]
        evicted += kept[: max(0, len(kept) - MAX_ENGINES_PER_MODEL + 1)]
        kept[:] = [e for e in kept if e not in evicted]
    _release_graphs(evicted)  # now, also where a caller still holds one of them; and before allocating
    engine = StaticEngine(verifier, drafter, spec, max_tokens, max_new, use_graphs, warpers)
    for model, cache in ((verifier, engine.verifier_cache), (drafter, engine.drafter_cache)):
        if cache is not None:
            for layer, rules in zip(cache.layers, served[id(model)], strict=True):
                layer.attention_window, layer.attention_chunk = rules.window, rules.chunk
    with _registry:
        _engines.setdefault(verifier, []).append(engine)
    _keep_within_budget(verifier, device)
    return engine


def _keep_within_budget(verifier, device: torch.device) -> None:
    """Free the least recently used engines of ``verifier`` while the kept ones take more than the budget
    (:func:`engine_memory_budget`); the most recent one stays."""
    budget = engine_memory_budget(device)
    with _registry:
        kept = _engines.get(verifier, [])
        evicted = []
        while len(kept) > 1 and sum(e.nbytes for e in kept) > budget:
            evicted.append(kept.pop(0))
    if evicted:
        logger.warning_once(
            f"hf_sparsekv: the engines kept for {type(verifier).__name__} take more than {budget / 2**30:.1f} GiB "
            f"({ENGINE_MEMORY_ENV}), so the least recently used configurations are freed and rebuilt (their graphs "
            "captured again, nothing recompiled) when a call needs them again")
        _release_graphs(evicted)


def current_engine(verifier) -> StaticEngine | None:
    """The engine ``verifier``'s last static call ran on, if any."""
    with _registry:
        kept = _engines.get(verifier)
        return kept[-1] if kept else None


def forget_sequences(model) -> None:
    """The engines kept on ``model`` hold no earlier call's sequence any more: the next call prefills its whole prompt,
    as a call on an unrelated prompt does (benchmarks time a repeated prompt this way, as HF's static cache does)."""
    with exclusive(model):
        with _registry:
            for engine in _engines.get(model, []):
                engine.holds_sequence = False


def _release_graphs(engines: list[StaticEngine]) -> None:
    """Destroy the CUDA graphs of ``engines`` and drop their steps (a step refers to its engine: without them an
    engine no caller holds is freed at once, its caches with it, not at Python's next cycle collection)."""
    for engine in engines:
        if engine.use_graphs:
            wait_for(engine.devices)  # no replay of its graphs is still running
    for engine in engines:
        for step in engine.steps.values():
            step.release()
        engine.steps.clear()  # (a caller still holding the engine captures its steps again on use)
        engine._compiled_draft_tokens.clear()


def release_engines(model=None) -> None:
    """Free every kept static cache, CUDA graph and 4-bit draft-weight copy (of ``model`` only, if given), one model
    at a time, each once no call holds it (:mod:`.model_locks`). Under tensor parallelism call it before
    ``torch.distributed.destroy_process_group()``: NCCL cannot destroy a communicator that a live CUDA graph still
    uses, and the destroy hangs (PyTorch issue 115388). The graphs are destroyed here, also where a caller still
    holds a reference to an engine (as they are when an engine is replaced)."""
    with _registry:
        models = list(_engines)
    chosen = models + models_with_copies() if model is None else [model]
    for model in {id(m): m for m in chosen}.values():
        with exclusive(model):
            with _registry:
                kept = _engines.pop(model, [])
            _release_graphs(kept)
            release_copies(model)


COMPILE_NOTICE = (
    "hf_sparsekv: compiling the engine's steps (torch.compile) before capturing them as CUDA graphs: seconds to a "
    "minute, once per model and configuration (kept on disk for later processes); calls ran on steps not fully "
    "compiled until now (HF_SPARSEKV_COMPILE=1 compiles from the first call, 0 never; hf_sparsekv.warmup() pays it "
    "ahead)")
LIGHT_COMPILE_NOTICE = (
    "hf_sparsekv: tracing the engine's steps (torch.compile, light: our fused kernels, no code generation) before "
    "capturing them as CUDA graphs: a few seconds, once per model and configuration; they compile fully once "
    "calls have run long enough (HF_SPARSEKV_COMPILE=1 compiles fully from the first call, 0 never; "
    "hf_sparsekv.warmup() pays it ahead)")


def captures(model) -> bool:
    """Whether the engine's steps are captured as CUDA graphs for ``model``: on CUDA unless ``HF_SPARSEKV_GRAPHS=0``
    or its rotary embedding reads each call's positions on the host (:func:`~.graph_steps.updates_rotary_per_call`;
    on CPU, and without graphs, the same steps run eagerly). Checks the engine's other settings too
    (``HF_SPARSEKV_COMPILE``, ``HF_SPARSEKV_COMPILE_AFTER``, ``HF_SPARSEKV_ENGINE_MEMORY``): on every device, a wrong
    value raises ``ValueError``."""
    setting = graphs_setting()
    device = model.device  # (a walk of its parameters to the first: once)
    use_graphs = device.type == "cuda" and setting != "0" and not updates_rotary_per_call(model)
    compile_setting(use_graphs)
    engine_memory_budget(device)
    return use_graphs
