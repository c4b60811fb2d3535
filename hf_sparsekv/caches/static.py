"""Preallocated ("static") storage of the caches for the CUDA-graph path.

Every buffer is allocated once, to a capacity fixed before the first step; a step writes its tokens in place at
*slots* computed on the device from their logical positions, so a decode step does no ``torch.cat``, allocates
no cache memory, reads no length on the host, and can be captured as a CUDA graph and replayed.

Per cache (shared by its layers):

* ``slot_positions [B, capacity]`` int64: the logical position held by each slot of each row, -1 where nothing was
  written. A query of row b at position p sees slot j iff ``0 <= slot_positions[b, j] <= p`` and the cache's own
  rule (window, sink).
* ``fp_length [B]`` int32: how many leading slots of each row the Triton decode kernel reads (from the device, so
  its launch is captured once and stays right as the sequences grow or roll back): for the caches whose slots are
  in position order (full, chunk budget), the slots the step's last query sees (``slot(last position) + 1``); for
  the sink+window ring, the whole buffer (the kernel then masks by ``slot_positions``).
* ``live [B]`` int64 (optional, set by the engine that drives the cache): 0 marks a row whose sequence has
  finished. Its steps still run (the batch's graph is fixed) but its ``fp_length`` is only the step's query count,
  so the kernel reads almost none of its keys/values; what such a row computes is garbage and must be dropped.

A model dispatched over several devices (``device_map``): each layer's buffers live on its layer's device
(``layer_devices``); the per-cache tensors above live on the *home* device (the model's input device). A layer on
another device reads them through :meth:`PreallocatedCache.local`, a copy made once per step and device (inside the
captured step: one small device-to-device copy per step and device).

Rows (batch size B) are independent sequences: each has its own positions, slots, lengths and (chunk budget) its
own kept chunks, so rows may advance and roll back by different amounts in the same step.

Rollback moves nothing: the next step writes at the slots of its own positions, and slots holding positions
beyond the current one are masked out (``slot_positions > p``) or lie past ``fp_length``. Keys are stored after
RoPE at their real positions, as in the dynamic caches.

The three layouts (``slot(p)``):

* :class:`StaticFullCache` (the verifier): ``slot = p``.
* :class:`StaticChunkBudgetCache` (BudgetDraft): after the prefill selection the kept chunks fill slots
  ``0..K-1`` and a later token goes to ``slot = p - (P - K)`` (P prompt length). The selection is the one of
  :class:`~hf_sparsekv.caches.ChunkBudgetCache` (same scores, same chunks).
* :class:`StaticSinkWindowCache` (StreamingLLM / LongSpec): ``sink`` fixed slots, then a ring of
  ``window + max_rollback + 1`` slots: ``slot = sink + (p - sink) mod ring``. A query at p sees the sinks and
  positions ``p - window .. p``; the ring is long enough that rolling back up to ``max_rollback`` tokens never
  loses a position still in the window.
* :class:`StaticQuantCache` (QuantSpec, self-speculation): positions below ``T_q`` as packed INT4/INT8 codes at
  ``slot = p``, the rest in a full-precision buffer at ``slot = p - T_q``; ``T_q`` moves (quantization) only
  between steps, on the host (``flush_to``).

Mask positions: a chunk-budget slot j is given the position ``j + P - K`` (the stored tokens as if contiguous and
ending at the last one), exactly the positions the dynamic cache's ``get_mask_sizes`` gives the standard mask; the
other layouts use real positions.

Driving a step (what :mod:`hf_sparsekv.generation.graph_steps` does): ``begin_step(positions)`` with the step's
positions ``[B, L]`` (a device tensor), then the model forward (its attention must be the ``"sparsekv_static"``
implementation, :mod:`hf_sparsekv.static_attention`). A prompt is fed to one row with ``begin_prefill(length,
row)`` instead (a batch-1 forward, never captured, eager or compiled:
:func:`~hf_sparsekv.generation.graph_steps.static_prefill`): it attends to the prompt itself and then stores what
the layout keeps in that row.
"""

from __future__ import annotations

import itertools
import threading

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..kernels import runtime
from .chunk_selection import (FILL_ELEMENTS, ChunkSelection, as_selection, kept_token_count, score_block,
                              select_chunks, select_tokens)
from .prefill_quantize import quantize_into, quantized_length, store_quantized_prompt
from .prefill_selection import keep_selected


class _HandOff(threading.local):
    """The hand-off from a static cache layer's ``update`` to the "sparsekv_static" attention that transformers calls
    right after it (the attention function is not given the cache): ``layer``, the layer whose ``update`` ran last on
    this thread, None once the attention took it. Per thread, so that forwards on other threads never see it; a
    ``threading.local`` rather than the context variable of :mod:`.kernel_hook`, because torch.compile traces its
    reads and writes (guarded per thread) where it would break the graph at every layer on a context variable."""

    layer = None


LAST_WRITTEN = _HandOff()


def mark_length_dynamic(*tensors: torch.Tensor, dim: int) -> None:
    """Let ``torch.compile`` treat dimension ``dim`` of ``tensors`` (a length: a cache's capacity, a sequence buffer's)
    as dynamic: a step compiled for one capacity serves every other (a cache grown for a longer prompt, another
    budget) without recompiling. A hint (``maybe_mark_dynamic``): dynamo still specializes a dimension the code
    needs as a constant."""
    for tensor in tensors:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)


def within_window_and_chunk(seen: torch.Tensor, key_positions: torch.Tensor, query_positions: torch.Tensor,
                            sliding_window: int | None, chunk: int | None) -> torch.Tensor:
    """``seen`` (broadcast with the positions) where the key is also within the query's sliding window (transformers'
    sliding masks: key position > query position - sliding_window) and in its chunk (its chunked masks: key position
    // chunk == query position // chunk); either rule None: not applied."""
    if sliding_window is not None:
        seen = seen & (key_positions > query_positions - sliding_window)
    if chunk is not None:
        seen = seen & (key_positions // chunk == query_positions // chunk)
    return seen


class StaticLayer(CacheLayerMixin):
    """Key/value buffers ``[B, Hkv, capacity, D]`` of one layer; the slot arithmetic lives in the owning cache."""

    is_compileable = True
    is_sliding = False
    # set by the engine from what the model's mask asks (generation.attention_semantics): a query sees only keys
    attention_window: int | None = None  # within this many positions (else the attention's sliding_window option)
    attention_chunk: int | None = None  # of its own chunk of this many positions

    def __init__(self, owner: "PreallocatedCache", layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers exist from the start
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.owner.write(self, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.owner.seen

    def get_max_length(self) -> int:
        return self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2], 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("crop the owning cache (PreallocatedCache.crop)")

    def reset(self) -> None:
        raise NotImplementedError("reset the owning cache (PreallocatedCache.reset)")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("static caches do not support beam search")


# Merge counters a KV head of a row: one a block of query rows of a launch (up to 16 blocks: a tree block of 63
# queries at a GQA group of 16 in blocks of 64 rows); a launch with more blocks merges in a kernel of its own.
TICKETS_PER_KV_HEAD = 16


class PreallocatedCache(Cache):
    """Base of the static caches: buffers, per-step slots and mask, prefill. Subclasses define :meth:`slots_of` and
    what a prefill keeps (:meth:`_store_prefill`).

    Args:
        num_layers, kv_heads, head_dim: the model's attention shape.
        capacity: slots per layer and row.
        dtype, device: of the key/value buffers; ``device`` is the home device of the per-cache tensors.
        batch: rows (independent sequences).
        layer_devices: the device of each layer's buffers (a model dispatched over several devices); default: all
            on ``device``.

    Whether decode steps run the Triton kernel is decided once, at construction (:func:`runtime.enabled`), so that
    nothing host-side is asked during a step.
    """

    contiguous = True  # slots are in position order and the first fp_length of them are what a query sees
    takes_trees = False  # a step's tokens may be a tree block (begin_step's tree)
    compiles_prefill = False  # its prefill may run compiled (graph_steps.prefill_compiles)
    takes_prefix = False  # prompt caching: a row may hold a prefix before its prefill (begin_prefill's start)

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device, batch: int = 1,
                 layer_devices=None):
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if batch < 1:
            raise ValueError(f"batch must be positive, got {batch}")
        self.capacity, self.batch = capacity, batch
        device = torch.device(device)
        layer_devices = [device] * num_layers if layer_devices is None else [torch.device(d) for d in layer_devices]
        if len(layer_devices) != num_layers:
            raise ValueError(f"layer_devices names {len(layer_devices)} devices for {num_layers} layers")
        shape = (batch, kv_heads, capacity, head_dim)
        layers = [
            StaticLayer(self, i, torch.zeros(shape, dtype=dtype, device=d), torch.zeros(shape, dtype=dtype, device=d))
            for i, d in enumerate(layer_devices)
        ]
        super().__init__(layers=layers)
        self.layer_devices = layer_devices
        self.slot_positions = torch.full((batch, capacity), -1, dtype=torch.long, device=device)
        self.fp_length = torch.zeros(batch, dtype=torch.int32, device=device)
        self.rows = torch.arange(batch, device=device)[:, None]  # [B, 1]: the row index of a step's writes
        self._local: dict = {}  # (name, device index) -> this step's copy of a per-cache tensor on another device
        self.positions: torch.Tensor | None = None  # the current step's positions [B, L]
        self.tree: torch.Tensor | None = None  # this step's tree block (ancestor bits [L] or [B, L]), None: a chain
        self._offsets: dict = {}  # L -> arange(L) on the home device (a tree block's slots from its root's)
        self.slots: torch.Tensor | None = None  # their slots [B, L]
        self.prefilling = False
        self.prefill_row = 0
        self.prefill_start = 0  # a prefill after a loaded prefix (prompt caching, StaticFullCache): its first position
        self.prefill_fed: torch.Tensor | None = None  # the prompt positions a prefill feeds (None: all, from its start)
        self.filled_rows: set[int] = set()  # rows holding a prompt (host side)
        # a cache filled from this one's prefill and steps without drafts (self-drafting), set for their length
        self.companion: PreallocatedCache | None = None
        # during a prefill: called with each layer's (index, queries [1, Hq, P, D], scaling) (a companion filled later)
        self.prompt_queries = None
        self.live: torch.Tensor | None = None  # [B] int64 on the device, 0 for a finished row (None: every row runs)
        self.kernels = runtime.enabled(device)  # decode steps run the Triton kernel (fixed for the cache's life)
        # the decode kernel's merge counters, zero between launches (decode_core.launch_decode's tickets): one set a
        # device, used by this cache's launches alone, which run one at a time
        self._tickets = {}
        for d in layer_devices:
            t = torch.zeros(batch * kv_heads * TICKETS_PER_KV_HEAD, dtype=torch.int32, device=d)
            self._tickets.setdefault(t.device, t)
        self.seen = 0  # host-side logical length, kept by whoever drives the cache (prefill, crop, set_seen)
        self._mask: dict | None = None  # (sliding window, chunk, device) -> this step's mask
        mark_length_dynamic(*(t for layer in layers for t in (layer.keys, layer.values)), dim=2)
        mark_length_dynamic(self.slot_positions, dim=1)

    # ---- driving a step
    def slots_of(self, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def begin_step(self, positions: torch.Tensor, tree: torch.Tensor | None = None) -> None:
        """Prepare a decode/verify step whose tokens are at ``positions [B, L]`` (int64, on the device, ascending
        along L). ``tree`` (int64 ``[L]`` or one per row ``[B, L]``,
        :func:`~hf_sparsekv.kernels.reference.ancestor_bits`; caches that ``takes_trees``):
        the tokens are a tree block, written at consecutive slots (:meth:`tree_slots`), each seeing what the cache
        shows its position before the block and, within it, the nodes whose bit it has set; several nodes may share a
        position."""
        if tree is not None and not self.takes_trees:
            raise NotImplementedError(f"{type(self).__name__} takes no tree block")
        self.prefilling = False
        self.positions = positions
        self.tree = tree
        self.slots = self.slots_of(positions) if tree is None else self.tree_slots(positions)
        self.slot_positions[self.rows, self.slots] = positions
        # slots in position order: read up to the last query's; otherwise (a ring) the whole buffer
        # (the capacity as the buffer's length, which compiles as a dynamic dimension)
        capacity = self.slot_positions.shape[1]
        ends = self.slots[:, -1] + 1 if self.contiguous else torch.full_like(self.slots[:, -1], capacity)
        if self.live is not None:  # a finished row reads only as many slots as it has queries
            ends = torch.where(self.live > 0, ends, positions.shape[1])
        self.fp_length.copy_(ends)
        self._mask = None
        self._local = {}

    def tree_slots(self, positions: torch.Tensor) -> torch.Tensor:
        """The slots ``[B, L]`` of a tree block at ``positions [B, L]``: consecutive from the first node's own slot
        (its root's, or a drafter's first depth-1 node's), so that the slots before the block hold the sequence."""
        return self.slots_of(positions[:, :1]) + self.block_offsets(positions)

    def forget(self, keep: torch.Tensor) -> None:
        """Mark the current step's slots empty where ``keep [B, L]`` (bool, on the home device) is False: no later
        step sees what this one wrote there (a drafter's stale catch-up tokens past the sequence, a tree block it has
        finished with). In place, on the device (capturable)."""
        self.slot_positions[self.rows, self.slots] = torch.where(keep, self.positions,
                                                                 self.positions.new_full((), -1))

    def block_offsets(self, positions: torch.Tensor) -> torch.Tensor:
        """``[0, 1, ..., L-1]`` for a step of ``positions [B, L]`` (made once per L, outside any captured step's
        allocations after the first)."""
        length = positions.shape[1]
        if length not in self._offsets:
            self._offsets[length] = torch.arange(length, device=positions.device)
        return self._offsets[length]

    def local(self, name: str, device: torch.device) -> torch.Tensor:
        """The per-cache tensor ``name`` (``positions``, ``slots``, ``fp_length``, ...) as a layer on ``device`` reads
        it: the cache's own on the home device, else this step's copy (made on first use, once per step)."""
        tensor = getattr(self, name)
        if tensor.device == device:
            return tensor
        key = (name, device.index)
        copy = self._local.get(key)
        if copy is None:
            copy = self._local[key] = tensor.to(device)
        return copy

    def tickets(self, device: torch.device) -> torch.Tensor | None:
        """The merge counters of the decode kernel's launches on ``device`` (int32, zero between launches); None on a
        device that holds none of the cache's layers (the launch then merges in a kernel of its own)."""
        return self._tickets.get(device)

    def kept_prompt_positions(self, length: int) -> torch.Tensor | None:
        """The positions of a ``length``-token prompt this layout keeps (int64 ``[K]``, increasing, on the cache's
        device), or None where it keeps every one or decides which from the whole prompt (a chunk selection). A
        prefill may feed these alone (:meth:`begin_prefill`'s ``kept_only``) where what the layout keeps need not
        have seen the rest (a drafter's cache)."""
        return None

    def prefill_reads(self, length: int) -> int:
        """How many positions of a ``length``-token prompt a ``kept_only`` prefill feeds (host side, nothing
        launched): :meth:`kept_prompt_positions`'s count, else ``length``."""
        return length

    def begin_prefill(self, length: int, row: int = 0, start: int = 0, kept_only: bool = False) -> None:
        """The next forward (batch 1, not captured) feeds a prompt of ``length`` tokens to the empty row ``row``;
        ``start``: the row already holds positions ``0..start-1`` (:meth:`StaticFullCache.load_prefix`) and the prompt's
        tokens are at ``start..start+length-1``. ``kept_only``: the forward feeds only the positions the layout keeps
        where it says which (:meth:`kept_prompt_positions`, then in :attr:`prefill_fed`), which attend to one
        another alone (after a prefix: every new position, a layout that takes one keeping all)."""
        if not 0 <= row < self.batch:
            raise ValueError(f"{type(self).__name__}.begin_prefill: row {row} of a cache of {self.batch} rows")
        if row in self.filled_rows:
            raise ValueError(f"{type(self).__name__}.begin_prefill: row {row} already holds a prompt (reset())")
        if start and not self.takes_prefix:
            raise NotImplementedError(f"{type(self).__name__} keeps no prefix: a prefill after a prefix needs the full cache")
        self.prefilling = True
        self.prefill_fed = self.kept_prompt_positions(length) if kept_only and not start else None
        self.prefill_length, self.prefill_row, self.prefill_start = length, row, start
        self._mask = None
        self._local = {}
        self._place_prompt(row)

    def _place_prompt(self, row: int) -> None:
        """At :meth:`begin_prefill`: set what row ``row`` shows of the prompt announced (slot positions, length) on
        the host's knowledge of its length, so that the prefill's forward writes only keys and values."""

    def end_prefill(self) -> None:
        self.prefilling = False
        self.prefill_fed = None
        self.filled_rows.add(self.prefill_row)
        self.seen = self.prefill_start + self.prefill_length

    def write(self, layer: StaticLayer, key_states: torch.Tensor, value_states: torch.Tensor,
              companion_layer: StaticLayer | None = None):
        """Store a step's keys/values ``[B, Hkv, L, D]`` (a prefill: ``[1, Hkv, P, D]`` of one row); returns what the
        attention reads (the buffers, or during a prefill the prompt's own keys/values, after the row's prefix if it
        has one). ``companion_layer``: the :attr:`companion`'s layer of the same index (default: looked up by
        ``layer.layer_idx``, which code traced for every layer alike must not read)."""
        if self.companion is not None and companion_layer is None:
            companion_layer = self.companion.layers[layer.layer_idx]
        if self.prefilling:
            fed = self.prefill_length if self.prefill_fed is None else self.prefill_fed.numel()
            if key_states.shape[-2] != fed:
                raise ValueError(f"prefill of {fed} tokens announced, got {key_states.shape[-2]}")
            self._store_prefill(layer, key_states, value_states)
            if self.prefill_start:  # after a prefix: the row's whole prompt, prefix included
                r, end = self.prefill_row, self.prefill_start + self.prefill_length
                key_states, value_states = layer.keys[r : r + 1, :, :end], layer.values[r : r + 1, :, :end]
            if self.companion is not None:  # it gets the whole prompt
                self.companion._store_prefill(companion_layer, key_states, value_states)
            return key_states, value_states
        if self.slots is None or tuple(key_states.shape[::2]) != tuple(self.slots.shape):
            raise RuntimeError(f"{type(self).__name__}: call begin_step(positions) before each forward")
        # An indexed assignment (index_put_), not scatter_: Inductor turns the functionalized index_put back into the
        # in-place write, whereas a scatter_ on a graph input compiles to a copy of the whole buffer every step.
        rows, slots = self.local("rows", layer.keys.device), self.local("slots", layer.keys.device)
        layer.keys[rows, :, slots] = key_states.transpose(1, 2)
        layer.values[rows, :, slots] = value_states.transpose(1, 2)
        if self.companion is not None:  # a self-drafting step without drafts (its begin_step ran): the same there
            self.companion.write(companion_layer, key_states, value_states)
        return layer.keys, layer.values

    def _store_prefill(self, layer: StaticLayer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise NotImplementedError

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        keys, values = layer.update(key_states, value_states)
        LAST_WRITTEN.layer = layer
        return keys, values

    # ---- what a query sees
    def visible(self, query_positions: torch.Tensor, sliding_window: int | None = None,
                chunk: int | None = None) -> torch.Tensor:
        """Boolean ``[B, L, capacity]`` on ``query_positions``' device: query i of row b (at ``query_positions[b, i]``)
        sees slot j of that row. ``sliding_window`` as in transformers' sliding masks (key position > query position -
        sliding_window); ``chunk`` as its chunked masks (key position // chunk == query position // chunk)."""
        sp = self.local("slot_positions", query_positions.device)[:, None, :]
        qp = query_positions[:, :, None]
        seen = (sp >= 0) & (sp <= qp) & self._rule(sp, qp)
        if self.tree is not None:  # a tree block: before it, every slot; within it, the node's ancestors
            tree = self.local("tree", query_positions.device)
            start = self.local("slots", query_positions.device)[:, :1, None]
            rel = torch.arange(sp.shape[-1], device=sp.device)[None, None, :] - start  # [B, 1, C]
            in_block = (rel >= 0) & (rel < tree.shape[-1])
            ancestor = (tree.expand(sp.shape[0], -1)[:, :, None] >> rel.clamp(0, 62)) & 1 == 1
            seen = torch.where(in_block, ancestor, seen & (rel < 0))
        return within_window_and_chunk(seen, sp, qp, sliding_window, chunk)

    def _rule(self, slot_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(slot_pos, dtype=torch.bool)

    def step_mask(self, sliding_window: int | None, device: torch.device, chunk: int | None = None) -> torch.Tensor:
        """The current step's mask ``[B, 1, L, capacity]`` on ``device``, computed once per step, rule and device and
        shared by the layers with that rule there (:meth:`visible`)."""
        key = (sliding_window, chunk, device)
        if self._mask is None or key not in self._mask:
            positions = self.local("positions", device)
            self._mask = {} if self._mask is None else self._mask
            self._mask[key] = self.visible(positions, sliding_window, chunk)[:, None]
        return self._mask[key]

    # ---- host-side bookkeeping
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def set_seen(self, n: int) -> None:
        """Record the logical length (tokens of the sequence the cache holds), known to the host after a round."""
        self.seen = n

    def crop(self, tokens_to_remove: int) -> None:
        """Negative: forget that many most recent tokens (nothing moves; the next step overwrites them)."""
        if tokens_to_remove > 0:
            tokens_to_remove = tokens_to_remove - self.seen
        if -tokens_to_remove > self.seen:
            raise ValueError(f"cannot remove {-tokens_to_remove} tokens from a cache that has seen {self.seen}")
        self.seen += tokens_to_remove

    def reset(self) -> None:
        """Empty, keeping the buffers (and so any CUDA graph captured on them)."""
        self.slot_positions.fill_(-1)
        self.fp_length.zero_()
        self.seen = 0
        self.prefilling = False
        self.filled_rows.clear()
        self._mask = None
        self._local = {}

    def nbytes(self) -> int:
        """Bytes of the cache's per-layer storage (buffers, and a quantized store's codes)."""
        total = self.slot_positions.nbytes
        for layer in self.layers:
            total += layer.keys.nbytes + layer.values.nbytes
            for codes in (getattr(layer, "qkeys", None), getattr(layer, "qvalues", None)):
                if codes is not None:
                    total += sum(t.nbytes for t in (codes.upper, codes.lower, codes.scale, codes.zero))
        return total

    def store_prompt(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor,
                     query: torch.Tensor | None = None, scaling: float | None = None) -> None:
        """Between :meth:`begin_prefill` and :meth:`end_prefill`, without a forward: keep layer ``layer_idx``'s prompt
        keys/values ``[1, Hkv, P, D]`` as the prefill's own writes would (a companion filled later from the verifier's
        cache), and where the layout selects chunks, select them from the prompt's queries ``query [1, Hq, P', D]``
        (at least its voting ones, :func:`~.chunk_selection.voting_queries`) at ``scaling``."""
        layer = self.layers[layer_idx]
        self._store_prefill(layer, keys, values)
        if self.needs_selection():
            self.select(layer, query, keys, values, scaling)

    def store_prompt_layers(self, states: list, queries: dict) -> None:
        """:meth:`store_prompt` of every layer: ``states[i] = (keys, values)`` of layer i, ``queries[i] = (query,
        scaling)`` where the layout selects (:meth:`needs_selection`)."""
        for i, (keys, values) in enumerate(states):
            self.store_prompt(i, keys, values, *queries.get(i, (None, None)))

    def needs_selection(self) -> bool:
        """Whether this prefill selects chunks from the prompt's queries (:meth:`select`; chunk layouts only)."""
        return False

    def stored(self, layer_idx: int, position: int, row: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a query of row ``row`` at ``position`` would see in layer ``layer_idx`` besides its own token, in
        position order: keys/values ``[1, Hkv, n, D]`` and their mask positions ``[n]`` (for tests and inspection)."""
        query = torch.full((self.batch, 1), position, device=self.slot_positions.device)
        seen = self.visible(query)[row, 0] & (self.slot_positions[row] < position)
        slots = seen.nonzero().flatten()
        order = self.slot_positions[row, slots].argsort()
        slots = slots[order]
        layer = self.layers[layer_idx]
        at = slots.to(layer.keys.device)
        return (layer.keys[row : row + 1, :, at], layer.values[row : row + 1, :, at], self.slot_positions[row, slots])


class StaticFullCache(PreallocatedCache):
    """Every token at ``slot = position`` (the verifier's cache); a tree block (:meth:`begin_step`'s ``tree``) at
    consecutive slots from its root's, the kept path then moved to its positions' slots (:meth:`keep_path`)."""

    takes_prefix = True
    takes_trees = True
    compiles_prefill = True

    def keep_path(self, source: torch.Tensor, target: torch.Tensor, stale: torch.Tensor) -> None:
        """After a tree step: copy each layer's keys/values of row b from slots ``source[b]`` to ``target[b]``
        (``[B, K]``; a slot may be its own source) and mark the slots ``stale [B, M]`` empty (slot position -1), so
        that no later step sees a node that was not kept. In place, on the device (capturable)."""
        rows = self.rows
        for layer in self.layers:
            r, src, dst = (t.to(layer.keys.device) for t in (rows, source, target))
            layer.keys[r, :, dst] = layer.keys[r, :, src]
            layer.values[r, :, dst] = layer.values[r, :, src]
        # the value a device tensor: a Python -1 is a CPU tensor, whose copy a CUDA graph cannot capture
        self.slot_positions[rows, stale] = self.slot_positions.new_full((), -1)

    def slots_of(self, positions):
        return positions

    def load_prefix(self, layers: list[tuple[torch.Tensor, torch.Tensor]], row: int = 0) -> int:
        """Prompt caching: copy each layer's keys/values ``[1, Hkv, n, D]`` (a ``DynamicCache`` holding the first n
        tokens of the prompt) into slots ``0..n-1`` of the empty row ``row``; returns n. The prompt's other tokens
        then go through ``begin_prefill(P - n, row, start=n)``."""
        n = layers[0][0].shape[-2]
        if len(layers) != len(self.layers) or n + 1 > self.capacity:
            raise ValueError(f"a prefix of {len(layers)} layers x {n} tokens does not fit this cache")
        for layer, (keys, values) in zip(self.layers, layers):
            layer.keys[row, :, :n].copy_(keys[0].to(layer.keys.device))
            layer.values[row, :, :n].copy_(values[0].to(layer.keys.device))
        return n

    def sequence(self, layer_idx: int, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values ``[1, Hkv, end - start, D]`` of row ``row``'s positions ``start..end-1`` in layer
        ``layer_idx`` (views of its buffers; ``end`` at most the positions the row holds)."""
        layer = self.layers[layer_idx]
        return layer.keys[row : row + 1, :, start:end], layer.values[row : row + 1, :, start:end]

    def begin_prefill(self, length: int, row: int = 0, start: int = 0, kept_only: bool = False) -> None:
        end = start + length
        if end > self.capacity:
            raise ValueError(f"prompt of {end} tokens exceeds the cache capacity {self.capacity}")
        super().begin_prefill(length, row, start, kept_only)

    def _place_prompt(self, row):
        end = self.prefill_start + self.prefill_length
        self.slot_positions[row].fill_(-1)
        self.slot_positions[row, :end] = torch.arange(end, device=self.slot_positions.device)
        self.fp_length[row] = end

    def _store_prefill(self, layer, key_states, value_states):
        s, n, r = self.prefill_start, key_states.shape[-2], self.prefill_row
        layer.keys[r, :, s : s + n].copy_(key_states[0])
        layer.values[r, :, s : s + n].copy_(value_states[0])


def layers_a_batch(device: torch.device, logits: int) -> int:
    """How many layers :meth:`_ChunkSelecting.store_prompt_layers` selects as one batch where one layer's query
    block holds ``logits`` elements: within :data:`~.chunk_selection.FILL_ELEMENTS` on an accelerator, one on a CPU
    (its arithmetic outweighs the calls there: the bundled verifier's 12 layers at 2K took 355 ms batched against
    240 ms one by one)."""
    return 1 if device.type == "cpu" else max(1, FILL_ELEMENTS // logits)


class _ChunkSelecting:
    """What the chunk layouts share: the prefill selection of :class:`~hf_sparsekv.caches.ChunkBudgetCache` (same
    scores, same chunks), the kept prompt tokens stored in slots ``0..K-1`` of the row being prefilled, and their
    positions set by :meth:`_place_kept` when the prefill begins (K known from the prompt's length,
    :func:`~.chunk_selection.kept_token_count`), so that the prefill's forward writes only keys and values (the
    selection itself one opaque op, :mod:`.prefill_selection`) and may run compiled."""

    compiles_prefill = True

    def _init_selection(self, budget: int, chunk_size: int, selection, per_kv_head: bool, score_window):
        if budget < chunk_size:
            raise ValueError(f"budget must be >= chunk_size ({chunk_size}), got {budget}")
        selection = as_selection(selection, per_kv_head, score_window)
        self.budget, self.chunk_size, self.selection = budget, chunk_size, selection

    def _init_rows(self) -> None:
        """After the storage exists: each row's ``offset`` (from position to slot or mask position, set by
        :meth:`_place_kept`) and its count of kept prompt tokens."""
        self.offset = torch.zeros(self.batch, dtype=torch.long, device=self.slot_positions.device)
        self.kept = [0] * self.batch

    def reset(self) -> None:
        super().reset()
        self.offset.zero_()
        self.kept = [0] * self.batch

    def kept_prompt_positions(self, length):
        return None  # (which chunks it keeps, the selection decides from every prompt position's keys)

    def prefill_reads(self, length):
        return length

    def begin_prefill(self, length: int, row: int = 0, start: int = 0, kept_only: bool = False) -> None:
        k = kept_token_count(length, self.budget, self.chunk_size)
        if k + 1 > self.capacity:
            raise ValueError(f"{k} kept tokens leave no room in a cache of capacity {self.capacity}")
        super().begin_prefill(length, row, start, kept_only)

    def _place_prompt(self, row):
        k = self.kept[row] = kept_token_count(self.prefill_length, self.budget, self.chunk_size)
        self.slot_positions[row].fill_(-1)
        self._place_kept(row, k)

    def _store_prefill(self, layer, key_states, value_states):
        p = key_states.shape[-2]
        if p <= self.budget:  # nothing to drop: keep the prompt as it is
            r = self.prefill_row
            layer.keys[r, :, :p].copy_(key_states[0])
            layer.values[r, :, :p].copy_(value_states[0])

    def select(self, layer: StaticLayer, query: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
               scaling: float) -> None:
        """Keep the top chunks of the prompt given its queries ``[1, Hq, P, D]`` in the row being prefilled (called by
        the attention during a prefill longer than the budget)."""
        keep_selected(self.selection, query, key_states, value_states, layer.keys, layer.values, self.prefill_row,
                      scaling, self.budget, self.chunk_size)

    def needs_selection(self) -> bool:
        return self.prefilling and self.prefill_length > self.budget

    def store_prompt_layers(self, states: list, queries: dict) -> None:
        """:meth:`store_prompt` of every layer, the selection of consecutive layers as one batch: the eager
        selection is about seventy host-side torch calls, which for a small model cost more than the arithmetic, so
        layers whose queries, keys, scaling and device agree are scored together, each in the query blocks its own
        prefill scores (:func:`~.chunk_selection.score_block` of one row: every layer keeps what its own selection
        keeps), :func:`layers_a_batch` at a time."""
        if not self.needs_selection():
            super().store_prompt_layers(states, queries)
            return
        r, p = self.prefill_row, states[0][0].shape[-2]

        def agreeing(i):  # what the layers of one batch share
            query, scaling = queries[i]
            return scaling, query.shape, query.device, states[i][0].shape, states[i][0].device

        for (scaling, shape, device, _, _), run in itertools.groupby(range(len(states)), key=agreeing):
            run = list(run)
            block = score_block(shape[1], p)
            size = layers_a_batch(device, shape[1] * min(block, shape[2]) * p)
            for batch in (run[at : at + size] for at in range(0, len(run), size)):
                keys = torch.cat([states[i][0] for i in batch])
                values = torch.cat([states[i][1] for i in batch])
                kept = select_chunks(torch.cat([queries[i][0] for i in batch]), keys, scaling, self.budget,
                                     self.chunk_size, self.selection, block)
                n = kept.shape[-1]
                kept_keys, kept_values = select_tokens(keys, kept), select_tokens(values, kept)
                for at, i in enumerate(batch):
                    self.layers[i].keys[r, :, :n].copy_(kept_keys[at])
                    self.layers[i].values[r, :, :n].copy_(kept_values[at])


class StaticChunkBudgetCache(_ChunkSelecting, PreallocatedCache):
    """BudgetDraft's chunk-budget cache on preallocated storage (see :class:`~hf_sparsekv.caches.ChunkBudgetCache`
    for the selection; the same functions compute it). ``capacity`` must hold the kept prompt tokens (<= budget)
    and every token appended later (and a drafter's tree block after the last)."""

    takes_trees = True

    def __init__(self, budget: int, num_layers, kv_heads, head_dim, capacity, dtype, device, chunk_size: int = 8,
                 per_kv_head: bool = False, score_window: int | None = None, batch: int = 1,
                 selection: ChunkSelection | str = "observed", layer_devices=None):
        self._init_selection(budget, chunk_size, selection, per_kv_head, score_window)
        super().__init__(num_layers, kv_heads, head_dim, capacity, dtype, device, batch, layer_devices)
        self._init_rows()  # offset: P - K of each row

    def slots_of(self, positions):
        return positions - self.offset[:, None]

    def _place_kept(self, row: int, k: int) -> None:
        self.offset[row] = self.prefill_length - k
        self.slot_positions[row, :k] = torch.arange(self.prefill_length - k, self.prefill_length,
                                                    device=self.offset.device)
        self.fp_length[row] = k


class StaticSinkWindowCache(PreallocatedCache):
    """Sink + sliding window on a ring buffer (see :class:`~hf_sparsekv.caches.SinkWindowCache`): a query at p sees
    the first ``sink`` positions and positions ``p - window .. p``; rollback of up to ``max_rollback`` tokens is
    exact. Capacity ``sink + window + max_rollback + 1``, and ``scratch`` slots after the ring for a drafter's tree
    block of up to that many nodes (:meth:`tree_slots`: the last slots, which the kernel reads as the queries' own;
    empty, slot position -1, outside a tree step)."""

    contiguous = False
    compiles_prefill = True

    def __init__(self, sink: int, window: int, max_rollback: int, num_layers, kv_heads, head_dim, dtype, device,
                 batch: int = 1, layer_devices=None, scratch: int = 0):
        if sink < 0 or window < 1 or max_rollback < 0 or scratch < 0:
            raise ValueError(f"need sink >= 0, window >= 1, max_rollback >= 0, scratch >= 0; got {sink}, {window}, "
                             f"{max_rollback}, {scratch}")
        self.sink, self.window, self.ring, self.scratch = sink, window, window + max_rollback + 1, scratch
        self.takes_trees = scratch > 0
        super().__init__(num_layers, kv_heads, head_dim, sink + self.ring + scratch, dtype, device, batch,
                         layer_devices)

    def slots_of(self, positions):
        return torch.where(positions < self.sink, positions, self.sink + (positions - self.sink) % self.ring)

    def tree_slots(self, positions):
        if positions.shape[1] > self.scratch:
            raise ValueError(f"a tree block of {positions.shape[1]} nodes in {self.scratch} scratch slots")
        return (self.capacity - positions.shape[1]) + self.block_offsets(positions)[None].expand_as(positions)

    def _rule(self, slot_pos, query_pos):
        return (slot_pos < self.sink) | (slot_pos >= query_pos - self.window)

    def _kept_spans(self, p: int) -> tuple[int, int]:
        """What a ``p``-token prompt leaves in the ring: positions ``0..s-1`` (its sinks) and ``t..p-1`` (its last
        ``ring`` tokens), as ``(s, t)``."""
        return min(self.sink, p), min(p, max(self.sink, p - self.ring))

    def _kept_positions(self, p: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions :meth:`_kept_spans` gives and their slots, int64 ``[K]`` each on ``device``."""
        s, t = self._kept_spans(p)
        positions = torch.cat([torch.arange(s, device=device), torch.arange(t, p, device=device)])
        return positions, self.slots_of(positions)  # (elementwise: any shape)

    def prefill_reads(self, length):
        s, t = self._kept_spans(length)
        return s + length - t

    def kept_prompt_positions(self, length):
        # (every position of a prompt within the sinks and the ring too: one compiled prefill feeds every prompt)
        return self._kept_positions(length, self.slot_positions.device)[0]

    def _place_prompt(self, row):
        positions, slots = self._kept_positions(self.prefill_length, self.slot_positions.device)
        self.slot_positions[row].fill_(-1)
        self.slot_positions[row].index_copy_(0, slots, positions)

    def _store_prefill(self, layer, key_states, value_states):
        positions, slots = self._kept_positions(self.prefill_length, key_states.device)
        if self.prefill_fed is None:  # (else the states are the kept positions')
            key_states, value_states = key_states[:, :, positions], value_states[:, :, positions]
        r = self.prefill_row
        layer.keys[r].index_copy_(1, slots, key_states[0])
        layer.values[r].index_copy_(1, slots, value_states[0])


class StaticChunkWindowCache(_ChunkSelecting, StaticSinkWindowCache):
    """The chunk budget with a bounded generation (``ChunkBudgetCache(B, generated_window=W)`` on the static engine):
    the prompt chunks the selection keeps fill the first ``budget`` slots and stay visible, as the sinks of the
    sink+window ring; the tokens appended after the prefill go to a ring of ``W + max_rollback + 1`` slots, of which
    a query at p sees positions ``p - W .. p``. Capacity ``budget + W + max_rollback + 1`` however long the
    generation; rollback of up to ``max_rollback`` tokens is exact (what a query sees depends on p alone).

    Visibility is decided on *mask positions* (``slot_positions``, ``positions``): kept prompt token j has j; the
    token at position p >= P (P the row's prompt length) has ``budget + p - P`` (``offset = P - budget`` per row).
    Keys keep their real positions (stored after RoPE). Unlike the dynamic cache, whose window of generated tokens
    moves by whole chunks, the window here moves by single tokens: the two keep the same prompt chunks and may
    differ in the oldest generated tokens they still show, which changes drafts, never the output."""

    def __init__(self, budget: int, window: int, max_rollback: int, num_layers, kv_heads, head_dim, dtype, device,
                 chunk_size: int = 8, batch: int = 1, selection: ChunkSelection | str = "observed",
                 layer_devices=None, scratch: int = 0):
        self._init_selection(budget, chunk_size, selection, False, None)
        super().__init__(budget, window, max_rollback, num_layers, kv_heads, head_dim, dtype, device, batch,
                         layer_devices, scratch)
        self._init_rows()  # offset: P - budget of each row

    def begin_step(self, positions: torch.Tensor, tree: torch.Tensor | None = None) -> None:
        super().begin_step(positions - self.offset[:, None], tree)  # real -> mask positions

    def _place_kept(self, row: int, k: int) -> None:
        self.offset[row] = self.prefill_length - self.budget
        self.slot_positions[row, :k] = torch.arange(k, device=self.offset.device)


class StaticQuantCache(PreallocatedCache):
    """QuantSpec's hierarchical INT4/INT8 store (see :class:`~hf_sparsekv.caches.HierarchicalQuantCache`) on
    preallocated storage: one store, read in the ``"int8"`` view by verification and the ``"int4"`` view by the
    self-speculative draft (``view``, fixed per captured step).

    Per row, positions ``0..T_q-1`` are quantized (codes at ``slot = position``, key scale/zero per group of G);
    later positions sit in the full-precision buffer (the ``keys``/``values`` of each layer) at ``slot = p - T_q``.
    A step whose first position is p sees ``T_q = G * max(0, p // G - 1)``, exactly the state of the dynamic cache
    fed one token at a time; :meth:`flush_to` brings a row there (host side, outside any graph, when the host knows
    p). Of a step's tokens, only the first :meth:`room` see that one state; the driver keeps no later ones.
    ``quant_length [B]`` int32 holds each row's T_q on the device for the kernel (0 for a finished row, see ``live``).

    Args:
        group_size: G (a multiple of 8).
        max_tokens: positions each row must hold.
        max_block: the longest step (γ + 1); the buffer holds 2G + max_block slots.
        batch: rows.
    """

    compiles_prefill = True  # the host sets T_q at begin_prefill; the forward's writes are one opaque op a layer

    def __init__(self, group_size: int, max_tokens: int, max_block: int, num_layers, kv_heads, head_dim, dtype,
                 device, batch: int = 1, layer_devices=None):
        if group_size < 8 or group_size % 8:
            raise ValueError(f"group_size must be a positive multiple of 8, got {group_size}")
        if head_dim % 2:
            raise ValueError(f"head_dim must be even to pack INT4 codes, got {head_dim}")
        super().__init__(num_layers, kv_heads, head_dim, 2 * group_size + max_block, dtype, device, batch,
                         layer_devices)
        self.group_size, self.view = group_size, "int8"
        t = -(-max_tokens // group_size) * group_size
        for layer in self.layers:
            # keys: scale/zero per channel per group of G tokens; values: per token
            layer.qkeys = self._codes(kv_heads, t, head_dim, dtype, (t // group_size, head_dim), layer.keys.device)
            layer.qvalues = self._codes(kv_heads, t, head_dim, dtype, (t, 1), layer.keys.device)
            for codes in (layer.qkeys, layer.qvalues):  # (tokens, or key groups of G tokens, in dimension 2)
                mark_length_dynamic(codes.upper, codes.lower, codes.scale, codes.zero, dim=2)
        device = self.slot_positions.device
        self.offset = torch.zeros(batch, dtype=torch.long, device=device)  # T_q of each row
        self.quant_length = torch.zeros(batch, dtype=torch.int32, device=device)
        self.quantized = [0] * batch  # T_q of each row on the host

    def _codes(self, heads, tokens, head_dim, dtype, param_shape: tuple[int, int], device):
        """Empty packed codes ``[B, H, tokens, D/2]`` and scale/zero ``[B, H, *param_shape]`` on ``device``."""
        from ..kernels.quant_reference import QuantizedTensor

        b = self.batch
        return QuantizedTensor(
            torch.zeros(b, heads, tokens, head_dim // 2, dtype=torch.uint8, device=device),
            torch.zeros(b, heads, tokens, head_dim // 2, dtype=torch.uint8, device=device),
            torch.ones(b, heads, *param_shape, dtype=dtype, device=device),
            torch.zeros(b, heads, *param_shape, dtype=dtype, device=device),
        )

    def quantized_length(self, position: int) -> int:
        """T_q seen by a step starting at ``position``."""
        return quantized_length(position, self.group_size)

    def room(self, position: int) -> int:
        """Tokens a step starting at ``position`` may carry with one quantization state (T_q first moves at 2G, then
        at every multiple of G)."""
        g = self.group_size
        return 2 * g - position if position < 2 * g else g - position % g

    def slots_of(self, positions):
        return positions - self.offset[:, None]

    def begin_step(self, positions: torch.Tensor, tree: torch.Tensor | None = None) -> None:
        super().begin_step(positions, tree)
        quant = self.offset if self.live is None else self.offset * (self.live > 0)  # a finished row reads no codes
        self.quant_length.copy_(quant)

    def begin_prefill(self, length: int, row: int = 0, start: int = 0, kept_only: bool = False) -> None:
        capacity = self.layers[0].qkeys.upper.shape[-2]
        if self.quantized_length(length) > capacity:
            raise ValueError(f"prompt of {length} tokens exceeds the store's capacity {capacity}")
        super().begin_prefill(length, row, start, kept_only)

    def _place_prompt(self, row):
        p = self.prefill_length
        t = self.quantized_length(p)
        self._set_quantized(row, t)
        self.slot_positions[row].fill_(-1)
        self.slot_positions[row, : p - t] = torch.arange(t, p, device=self.offset.device)
        self.fp_length[row] = p - t

    def _store_prefill(self, layer, key_states, value_states):
        k, v = layer.qkeys, layer.qvalues
        store_quantized_prompt(key_states, value_states, layer.keys, layer.values, k.upper, k.lower, k.scale, k.zero,
                               v.upper, v.lower, v.scale, v.zero, self.prefill_row, self.group_size)

    def _set_quantized(self, row: int, t: int) -> None:
        self.quantized[row] = t
        self.offset[row] = t
        self.quant_length[row] = t

    def flush_to(self, position: int, row: int = 0) -> None:
        """Before a step whose tokens of row ``row`` start at ``position`` (positions ``< position`` are the row's
        stored sequence): quantize the row's oldest buffered tokens up to ``T_q(position)`` and move the rest to the
        front of its buffer. Eager, never inside a captured step."""
        target = self.quantized_length(position)
        moved = target - self.quantized[row]
        if moved <= 0:
            return
        keep = position - target
        for layer in self.layers:
            quantize_into(layer.qkeys, layer.qvalues, row, layer.keys[row : row + 1, :, :moved],
                          layer.values[row : row + 1, :, :moved], self.quantized[row], self.group_size)
            layer.keys[row, :, :keep] = layer.keys[row, :, moved : moved + keep].clone()
            layer.values[row, :, :keep] = layer.values[row, :, moved : moved + keep].clone()
        shifted = self.slot_positions[row, moved : moved + keep].clone()
        self.slot_positions[row].fill_(-1)
        self.slot_positions[row, :keep] = shifted
        self._set_quantized(row, target)

    def reference_attention_inputs(self, layer, sliding_window: int | None, chunk: int | None = None):
        """Keys/values ``[B, Hkv, T + capacity, D]`` (the whole code store dequantized in the current view, then the
        buffer) and the step's mask ``[B, 1, L, T + capacity]``: the PyTorch path (CPU, shapes the kernel does not
        take), from device tensors only."""
        from ..kernels.quant_reference import dequantize_keys, dequantize_values

        int8, dtype = self.view == "int8", layer.keys.dtype
        keys = torch.cat([dequantize_keys(layer.qkeys, self.group_size, int8, dtype), layer.keys], -2)
        values = torch.cat([dequantize_values(layer.qvalues, int8, dtype), layer.values], -2)
        code_positions = torch.arange(layer.qkeys.upper.shape[-2], device=keys.device)
        positions = self.local("positions", keys.device)
        qp = positions[:, :, None]  # [B, L, 1]
        quant_seen = code_positions < self.local("offset", keys.device)[:, None, None]
        quant_seen = within_window_and_chunk(quant_seen, code_positions, qp, sliding_window, chunk)
        mask = torch.cat([quant_seen.expand(-1, qp.shape[1], -1), self.visible(positions, sliding_window, chunk)],
                         -1)
        return keys, values, mask[:, None]

    def sequence(self, layer_idx: int, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values ``[1, Hkv, end - start, D]`` of row ``row``'s positions ``start..end-1`` in layer
        ``layer_idx`` as verification reads them (the INT8 view): positions below the row's T_q dequantized from its
        codes, later ones from its full-precision buffer (``end`` at most the positions the row holds)."""
        from ..kernels.quant_reference import QuantizedTensor, dequantize_keys, dequantize_values

        layer, t, r, g = self.layers[layer_idx], self.quantized[row], slice(row, row + 1), self.group_size
        # only the groups of codes that hold start..min(end, t) - 1 are dequantized (t is a multiple of G)
        first, last = start // g * g, max(start, min(end, t))
        groups, tokens = slice(first // g, -(-last // g)), slice(first, -(-last // g) * g)
        k, v = layer.qkeys, layer.qvalues
        keys = dequantize_keys(QuantizedTensor(k.upper[r, :, tokens], k.lower[r, :, tokens], k.scale[r, :, groups],
                                               k.zero[r, :, groups]), g, True, layer.keys.dtype)
        values = dequantize_values(QuantizedTensor(v.upper[r, :, tokens], v.lower[r, :, tokens], v.scale[r, :, tokens],
                                                   v.zero[r, :, tokens]), True, layer.values.dtype)
        held = slice(max(start, t) - t, max(end - t, 0))  # positions t.. are in the full-precision buffer
        return (torch.cat([keys[:, :, start - first : last - first], layer.keys[r, :, held]], -2),
                torch.cat([values[:, :, start - first : last - first], layer.values[r, :, held]], -2))

    def reset(self) -> None:
        super().reset()
        for row in range(self.batch):
            self._set_quantized(row, 0)
        self.view = "int8"
