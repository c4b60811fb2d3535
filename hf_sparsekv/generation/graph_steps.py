"""Device-only steps of the static loop, run eagerly or captured once and replayed as CUDA graphs.

A step is a Python function that reads and writes only preallocated device tensors (token and length buffers, the
static caches of :mod:`hf_sparsekv.caches.static`) and never syncs with the host, so a CUDA graph recorded from
one call replays it exactly with whatever those tensors hold at replay time.

Before capture a step may be compiled with ``torch.compile`` (Inductor fuses the pointwise work left between our
kernels, so the captured graph holds several times fewer kernels; the decode attention stays our Triton kernel, as a
custom operator, which also computes the rotary embedding and the cache write (:mod:`.fused_rotary`), and the linear
layers that share an input become one grouped GEMV kernel with the norm before it: :mod:`.projection_groups`). The
compiled code runs only during the warm-up and the capture; a replay is the recorded kernels alone, so dynamo's
guards are never consulted again.

A step of a model dispatched over several devices (``device_map``) is captured as one graph spanning them: during
the capture each other device's current stream is a side stream joined to the capturing one (an event fork, and a
join before the capture ends), so its kernels and the device-to-device copies between the layers become nodes of the
same graph, and its allocations go to a memory pool of that device kept by the step.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import warnings
import weakref

import torch

from ..static_attention import NAME as STATIC_ATTENTION
from ..cache_keyword import cache_keyword
from .draft_weights import compiling_drafts, layer_elements
from .outer_products import outer_products
from .fused_rotary import fuse_rotary_writes
from .projection_groups import gate_projections, group_projections, norm_projections
from .regional import regional_layers, regional_setting

GRAPHS_ENV = "HF_SPARSEKV_GRAPHS"
COMPILE_BACKEND = "inductor"  # tests on CPU use "aot_eager": the same tracing, no code generation
GROUPED_LINEAR_ENV = "HF_SPARSEKV_GROUPED_LINEAR"  # "0": keep each linear layer a cuBLAS call in compiled steps
GATED_LINEAR_ENV = "HF_SPARSEKV_GATED_LINEAR"  # "0": keep gate/up a grouped call and the activation Inductor's
NORMED_LINEAR_ENV = "HF_SPARSEKV_NORMED_LINEAR"  # "0": keep the RMSNorms (and residual adds) Inductor's
PREFILL_COMPILE_ENV = "HF_SPARSEKV_PREFILL_COMPILE"  # "0": the prefill of a compiled engine stays eager
COMBO_KERNELS_ENV = "HF_SPARSEKV_COMBO_KERNELS"  # "0": Inductor launches each independent kernel of a step alone
FUSED_ROTARY_ENV = "HF_SPARSEKV_FUSED_ROTARY"  # "0": keep the rotary embedding and the cache write Inductor's
RECOMPILE_LIMIT = 64  # every engine (mode, γ, capacity) traces its steps anew; dynamo's default stops at 8


def dynamo_settings():
    """Dynamo's configuration while a step or prefill may compile: :data:`RECOMPILE_LIMIT`, and Python floats
    (a layer's ``scaling``, a norm's ``eps``) constants of the graph: as symbolic inputs of a dynamic-shape trace
    they cannot all become tensors, and dynamo then traces the whole forward a second time (a prefill's compilation
    took twice as long)."""
    return torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, specialize_float=True)


def release_generator_after_failed_capture() -> None:
    """Let CUDA's default generator on the current device draw again after a capture that failed.

    PyTorch marks the generator as capturing when a capture begins and unmarks it only when the capture ends cleanly;
    after a capture that CUDA invalidated, every later random draw outside a graph raises "Offset increment outside
    graph capture". If a probe draw raises that, the generator takes a copy of its own state (same seed and offset)
    that is not marked; graphs captured before keep the state they registered."""
    index = torch.cuda.current_device()
    try:
        torch.empty(1, device=torch.device("cuda", index)).uniform_()
    except RuntimeError:
        generator = torch.cuda.default_generators[index]
        generator.graphsafe_set_state(generator.clone_state())


_ROPE_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (its modules' count when walked,
# the modules that have a ``rope_type``)


def updates_rotary_per_call(model) -> bool:
    """Whether ``model``'s rotary embedding chooses its frequencies from each call's positions (transformers'
    ``"dynamic"`` NTK scaling and ``"longrope"``): it compares the largest position with a threshold on the host,
    which a CUDA graph cannot record (the capture would fail), so such a model's steps run uncaptured. Each call
    reads the ``rope_type`` of the modules that had one when the model was first walked (the walk of every module,
    twice a ``generate()`` call, took 0.7-1.4 ms on an H200 host for the bundled pair); a model whose direct children
    changed is walked again."""
    children = len(model._modules)
    kept = _ROPE_MODULES.get(model)
    if kept is None or kept[0] != children:
        kept = _ROPE_MODULES[model] = (children, [m for m in model.modules() if hasattr(m, "rope_type")])
    for module in kept[1]:
        kind = getattr(module, "rope_type", None)
        kinds = kind.values() if isinstance(kind, dict) else [kind]
        if any(isinstance(k, str) and ("dynamic" in k or k == "longrope") for k in kinds):
            return True
    return False


def graphs_setting() -> str:
    """``HF_SPARSEKV_GRAPHS``: ``"0"`` run the engine's steps uncaptured, ``"1"``, unset or ``"auto"``: capture them
    as CUDA graphs on CUDA (on CPU they always run uncaptured)."""
    value = os.environ.get(GRAPHS_ENV, "auto") or "auto"
    if value not in ("0", "1", "auto"):
        raise ValueError(f"{GRAPHS_ENV} must be '0', '1' or 'auto', got {value!r}")
    return value


def step_backend(gm: torch.fx.GraphModule, example_inputs):
    """The ``torch.compile`` backend of the steps: an outer product written as a matmul becomes a product
    (:mod:`.outer_products`); the linear layers that share an input become one grouped kernel, then a gated MLP's
    gate/up and its ``silu(gate) * up`` one gated kernel, then the RMSNorm (and residual add) before a grouped or
    gated call part of that call (:mod:`.projection_groups`; all off with ``HF_SPARSEKV_GROUPED_LINEAR=0``, the
    second with ``HF_SPARSEKV_GATED_LINEAR=0``, the third with ``HF_SPARSEKV_NORMED_LINEAR=0``); a layer's rotary
    embedding and cache write become part of its decode attention call (:mod:`.fused_rotary`; off with
    ``HF_SPARSEKV_FUSED_ROTARY=0``); then :data:`COMPILE_BACKEND` compiles. Inductor compiles with
    ``combo_kernels``: the independent small kernels of a layer run as one launch, a step being a chain of
    launch-bound kernels (bundled pair, H200: an AR step 103 -> 90 kernels, 0.298 -> 0.282 ms);
    ``HF_SPARSEKV_COMBO_KERNELS=0`` compiles without."""
    _fuse(gm)
    return _compile(gm, example_inputs, combo_kernels=os.environ.get(COMBO_KERNELS_ENV, "1") != "0")


def light_step_backend(gm: torch.fx.GraphModule, example_inputs):
    """The light ``torch.compile`` backend of the steps: :func:`step_backend`'s rewrites of dynamo's graph (our
    grouped, gated and normed linear kernels, the rotary embedding and cache write folded into the decode attention),
    then the graph runs as it is, on PyTorch's kernels for the rest: no AOT autograd and no Inductor code generation.
    It traces in about a third of the time Inductor takes and keeps most of its speed on a small model (bundled pair,
    H200, an AR step at 16K: 103 kernels and 0.34 ms, against 66 and 0.27 ms compiled by Inductor and 522 and 1.08 ms
    uncompiled)."""
    _fuse(gm)
    return gm.forward


def light_draft_weights_backend(gm: torch.fx.GraphModule, example_inputs):
    """:func:`light_step_backend` for the steps on 4-bit weight copies (see :func:`draft_weights_backend`)."""
    return light_step_backend(gm, example_inputs)


def _fuse(gm: torch.fx.GraphModule) -> None:
    """The rewrites of :func:`step_backend`, in place."""
    outer_products(gm)
    if os.environ.get(GROUPED_LINEAR_ENV, "1") != "0":
        group_projections(gm)
        if os.environ.get(GATED_LINEAR_ENV, "1") != "0":
            gate_projections(gm)
        if os.environ.get(NORMED_LINEAR_ENV, "1") != "0":
            norm_projections(gm)
    if os.environ.get(FUSED_ROTARY_ENV, "1") != "0":
        fuse_rotary_writes(gm)


def _compile(gm: torch.fx.GraphModule, example_inputs, **inductor_config):
    """``gm`` compiled by :data:`COMPILE_BACKEND` (Inductor with ``inductor_config`` patched in)."""
    if COMPILE_BACKEND == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=inductor_config)
    return torch._dynamo.lookup_backend(COMPILE_BACKEND)(gm, example_inputs)


def static_forward(model, tokens: torch.Tensor, positions: torch.Tensor, cache, logits_to_keep: int,
                   keyword: str, tree: torch.Tensor | None = None) -> torch.Tensor:
    """``model`` on ``tokens [B, L]`` at ``positions [B, L]`` (device int64) over a static cache of B rows; logits
    ``[B, L', V]`` (L' = logits_to_keep, 0 for all), in the model dtype. ``keyword``:
    :func:`~hf_sparsekv.cache_keyword.cache_keyword` of ``model``, resolved by the caller outside the traced step
    (torch.compile cannot take a module as a constant). ``tree``: the tokens are a tree block (see
    :meth:`~hf_sparsekv.caches.static.PreallocatedCache.begin_step`)."""
    cache.begin_step(positions, tree)
    out = model(
        input_ids=tokens, position_ids=positions, use_cache=True, logits_to_keep=logits_to_keep, **{keyword: cache},
    )
    return out.logits


def static_prefill(model, prompt: torch.Tensor, cache, row: int = 0, start: int = 0,
                   compiled: bool = False, kept_only: bool = False) -> torch.Tensor:
    """Feed ``prompt [1, P]`` to the empty row ``row`` of a static cache (``start``: the row already holds the first
    ``start`` tokens, only the rest is fed); the last position's logits ``[V]``. ``compiled``: where
    :func:`prefill_compiles` allows, through :data:`compiled_prefill`, else eager (and eager, with a warning, for
    every later prefill of a model whose compiled prefill raised or took more than :data:`PREFILL_MAX_GRAPHS`
    graphs). ``kept_only``: feed only the positions the cache keeps where it says which
    (:meth:`~hf_sparsekv.caches.static.PreallocatedCache.kept_prompt_positions`)."""
    cache.begin_prefill(prompt.shape[1] - start, row, start, kept_only)
    fed = cache.prefill_fed  # (None: every position from start)
    positions = (torch.arange(start, prompt.shape[1], device=prompt.device) if fed is None
                 else fed.to(prompt.device))[None]
    args = (model, prompt[:, start:] if fed is None else prompt[:, positions[0]], positions, cache,
            cache_keyword(model))
    with cudnn_attention_off:
        logits = _prefill_logits(model, args, compiled, cache)
    cache.end_prefill()
    return logits[0, -1]


class _CudnnAttentionOff:
    """A context in which PyTorch's SDPA does not pick cuDNN's attention, which it prefers for a bf16 prefill on Hopper
    but which builds an execution plan on the host for each new prompt length (about 3.5 ms a layer: a loop of
    prompts of varying lengths on the bundled pair spent 42 ms of a 100 ms call on it, H200).

    PyTorch's switch is one process-wide flag (``torch.backends.cuda.enable_cudnn_sdp``), and
    ``torch.nn.attention.sdpa_kernel`` restores it per context, so two prefills overlapping in threads could restore
    out of order and leave it off. Here the contexts are counted: the first to enter saves the flag and turns it off,
    the last to leave restores it; the other backends' flags are left as the user set them."""

    def __init__(self):
        self._lock, self._inside, self._saved = threading.Lock(), 0, True

    def __enter__(self):
        with self._lock:
            if self._inside == 0:
                self._saved = torch.backends.cuda.cudnn_sdp_enabled()
                torch.backends.cuda.enable_cudnn_sdp(False)
            self._inside += 1

    def __exit__(self, *exc):
        with self._lock:
            self._inside -= 1
            if self._inside == 0:
                torch.backends.cuda.enable_cudnn_sdp(self._saved)


cudnn_attention_off = _CudnnAttentionOff()


def _prefill_logits(model, args: tuple, compiled: bool, cache) -> torch.Tensor:
    """:func:`prefill_forward` of ``args``, compiled where :func:`static_prefill` says."""
    logits = None
    if compiled and model not in _eager_prefills and prefill_compiles(cache):
        _prefilling.model = model
        try:  # (a contiguous copy, not a view: a compiled prefill guards on a view's base and strides)
            with dynamo_settings():
                logits = compiled_prefill(model, args[1].clone(memory_format=torch.contiguous_format), *args[2:])
        except Exception as error:  # (a real error of the inputs comes back from the eager forward below)
            _eager_prefill(model, f"failed ({type(error).__name__}: {error})")
        finally:
            _prefilling.model = None
        if _prefill_graphs.get(model, 0) > PREFILL_MAX_GRAPHS:
            _eager_prefill(model, f"compiled {_prefill_graphs[model]} graphs (graph breaks, or recompilations for "
                                  "new prompt lengths)")
    if logits is None:  # (the eager forward rewrites every layer's keys/values and kept queries)
        logits = prefill_forward(*args)
    return logits


def prefill_forward(model, tokens: torch.Tensor, positions: torch.Tensor, cache, keyword: str) -> torch.Tensor:
    """``model`` on a prompt's ``tokens [1, P]`` at ``positions [1, P]`` into ``cache`` (its prefill begun); the
    last position's logits ``[1, 1, V]``."""
    return model(input_ids=tokens, position_ids=positions, use_cache=True, logits_to_keep=1,
                 **{keyword: cache}).logits


def _eager_prefill(model, why: str) -> None:
    _eager_prefills.add(model)
    warnings.warn(f"hf_sparsekv: the compiled prefill of {type(model).__name__} {why}; its prefills run eagerly from "
                  "now on", stacklevel=3)


def prefill_backend(gm: torch.fx.GraphModule, example_inputs):
    """The ``torch.compile`` backend of a prefill: :data:`COMPILE_BACKEND` as it is (a prefill's linear layers are
    matrix products of P rows, not the one-row products :func:`step_backend` groups); counts the graphs of the
    model whose prefill this thread compiles."""
    model = getattr(_prefilling, "model", None)
    if model is not None:  # (dynamo calls a backend under its compile lock: one thread at a time)
        _prefill_graphs[model] = _prefill_graphs.get(model, 0) + 1
    return _compile(gm, example_inputs)


# One compilation per model for prompts of every length (dynamic shapes): an eager prefill of a small model is bound
# by the host's launches of its eager ops (bundled verifier at 16K, H200: 19 ms of wall time for 8.6 ms of kernels,
# about 800 ops); the compiled forward launches Inductor's fused kernels from generated code.
def compile_prefill(backend=prefill_backend):
    """:func:`prefill_forward` compiled under ``backend``, once for prompts of every length (dynamic shapes)."""
    return torch.compile(prefill_forward, backend=backend, dynamic=True)


compiled_prefill = compile_prefill()


PREFILL_MAX_LAYER_ELEMENTS = 1 << 25  # from these weights per decoder layer on, a prefill compiles no more


_eager_prefills: "weakref.WeakSet" = weakref.WeakSet()  # models whose compiled prefill failed or recompiled too often
_prefill_graphs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> graphs its prefill compiled
_prefilling = threading.local()  # .model: the model whose compiled prefill this thread runs (None: none)
PREFILL_MAX_GRAPHS = 6  # a model's prefill compiles 1-5 (a cache kind each: full, kept queries, quantized store;
# a prefix; a sliding window); beyond, it goes eager


def prefill_pays(model) -> bool:
    """Whether compiling ``model``'s prefill pays: decoder layers of fewer than :data:`PREFILL_MAX_LAYER_ELEMENTS`
    weight elements (:func:`~.draft_weights.layer_elements`; the bundled verifier holds 0.8M, Llama-3.2-1B 61M).
    A prompt's kernels in a layer that size take longer than the host's launches of the eager ops (a 16K prompt:
    about 2 TFLOP a layer at 1B), and the compilation of a larger model's dynamic-shape forward costs the more."""
    return layer_elements(model) < PREFILL_MAX_LAYER_ELEMENTS


def prefill_compiles(cache) -> bool:
    """Whether a prefill of ``cache`` (begun) runs compiled: a one-row cache whose layout ``compiles_prefill`` (the
    full cache, the chunk layouts, the sink+window ring, the quantized store) on one device that fills no
    companion (a full cache's kept queries, ``prompt_queries``, trace as the forward's side effect), outside tensor
    parallelism, unless ``HF_SPARSEKV_PREFILL_COMPILE=0``. (A cache of several rows stays eager: Inductor's in-place
    pass specializes the written row, a compilation per row.)"""
    setting = os.environ.get(PREFILL_COMPILE_ENV, "1") or "1"
    if setting not in ("0", "1"):
        raise ValueError(f"{PREFILL_COMPILE_ENV} must be '0' or '1', got {setting!r}")
    return (setting == "1" and cache.compiles_prefill and cache.batch == 1 and cache.companion is None
            and len(set(cache.layer_devices)) == 1
            and not (torch.distributed.is_available() and torch.distributed.is_initialized()))


def draft_weights_backend(gm: torch.fx.GraphModule, example_inputs):
    """:func:`step_backend` for the steps that draft on 4-bit weight copies (:mod:`.draft_weights`): the same
    compilation under a backend of its own, so that dynamo never replays a step traced on the copies where the full
    weights are meant, nor the reverse (:func:`~.draft_weights.active`)."""
    return step_backend(gm, example_inputs)


def regional_light_backend(gm: torch.fx.GraphModule, example_inputs):
    """:func:`light_step_backend` for one decoder layer's trace (:mod:`.regional`), under a backend of its own."""
    return light_step_backend(gm, example_inputs)


def compiled_step(fn, on_copies: bool = False, light: bool = False, layers: list | None = None):
    """``fn`` compiled as the engine compiles its steps (:func:`step_backend`, static shapes; ``light``:
    :func:`light_step_backend`); ``on_copies``: a drafter's step on 4-bit weight copies, compiled under
    :func:`draft_weights_backend` (:func:`light_draft_weights_backend`) and traced inside
    :func:`~.draft_weights.compiling_drafts` (its traces alone read the copies). ``layers``: the decoder layers of
    each model the step runs (:func:`~.regional.decoder_layers`); given, a light step on the full weights runs
    uncompiled around its layers, each traced once for all (:func:`~.regional.regional_layers`) unless
    ``HF_SPARSEKV_REGIONAL=0``."""
    if light and layers and not on_copies and regional_setting():
        def around_regional_layers(*args):
            with regional_layers(layers, regional_light_backend):
                return fn(*args)

        return around_regional_layers
    if light:
        backend = light_draft_weights_backend if on_copies else light_step_backend
    else:
        backend = draft_weights_backend if on_copies else step_backend
    compiled = torch.compile(fn, backend=backend, dynamic=None)
    if not on_copies:
        return compiled

    def on_the_copies(*args):
        with compiling_drafts():
            return compiled(*args)

    return on_the_copies


class CapturedStep:
    """``fn`` (device ops on static tensors only), compiled by :func:`compiled_step` (``on_copies``: a drafter's
    step on 4-bit weight copies; ``light``: by the light backend, ``layers`` traced one for all) when ``compiled``, replayed as a
    CUDA graph once :meth:`capture` succeeded, else run as it is. ``restore``: tensors whose contents the warm-up
    and capture may change and must be put back (the warm-up really runs ``fn``). Calling it returns whether this
    was a graph's first replay (which uploads the graph to the device: slower than every later one)."""

    def __init__(self, fn, pool=None, compiled: bool = False, devices: list[int] = (), on_copies: bool = False,
                 light: bool = False, layers: list | None = None):
        self.eager_fn, self.pool = fn, pool
        self.fn = compiled_step(fn, on_copies, light, layers) if compiled else fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.replayed = False  # whether :attr:`graph` ran once
        self.devices = list(devices)  # CUDA device indices, the current (capturing) one first
        self.pools: dict[int, torch.cuda.MemPool] = {}  # the other devices' memory for the graph

    def run(self) -> None:
        with dynamo_settings():
            self.fn()

    def uncompile(self) -> None:
        self.fn = self.eager_fn

    def capture(self, restore: tuple[torch.Tensor, ...] = (), warmup: int = 2) -> None:
        # Python's cycle collector must not run inside the capture: freeing an unreachable engine there destroys its
        # CUDA graphs, which CUDA forbids while a stream captures (the capture fails; seen at real model sizes). It is
        # held off rather than run first: a full collection after compilations walks about a million objects (0.5-1 s
        # a capture), and the engines that replace others free them themselves (:func:`~.engine._release_graphs`).
        with DEVICE_WIDE:
            was_enabled = gc.isenabled()
            gc.disable()
            try:
                self._capture(restore, warmup)
            finally:
                if was_enabled:
                    gc.enable()

    def _capture(self, restore: tuple[torch.Tensor, ...], warmup: int) -> None:
        saved = [t.clone() for t in restore]
        home = torch.cuda.current_device()
        others = [d for d in self.devices if d != home]
        streams = {d: torch.cuda.Stream(d) for d in [home, *others]}  # one side stream per device, warm-up and capture
        for s in streams.values():
            s.wait_stream(torch.cuda.current_stream(s.device))
        # the warm-up draws from the generators as a replay does: put them back, so that a call which captures a
        # step samples what every later call from the same seed samples
        generators = [torch.cuda.get_rng_state(d) for d in [home, *others]]
        with _current_streams(streams):
            for _ in range(warmup):  # compilation, cuBLAS handles, allocator warm-up: outside the graph
                self.run()
                for t, s in zip(restore, saved):
                    t.copy_(s)
        for d, state in zip([home, *others], generators):
            torch.cuda.set_rng_state(state, d)
        for s in streams.values():
            torch.cuda.current_stream(s.device).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        # thread_local: what other threads do meanwhile (their own steps, plain forwards) cannot break the capture
        with torch.cuda.graph(graph, pool=self.pool, stream=streams[home], capture_error_mode="thread_local"):
            with contextlib.ExitStack() as joined:
                for d in others:  # the other devices' streams join the capture; their memory comes from our pools
                    streams[d].wait_stream(streams[home])
                    if d not in self.pools:
                        with torch.cuda.device(d):  # a pool belongs to the device current at its creation
                            self.pools[d] = torch.cuda.MemPool()
                    joined.enter_context(torch.cuda.use_mem_pool(self.pools[d], device=d))
                joined.enter_context(_current_streams({d: streams[d] for d in others}))
                self.run()
            for d in others:
                streams[home].wait_stream(streams[d])
        for t, s in zip(restore, saved):
            t.copy_(s)
        self.graph, self.replayed = graph, False

    def release(self) -> None:
        """Destroy the captured graph now (not when the last reference goes); the step runs uncaptured after."""
        if self.graph is not None:
            with DEVICE_WIDE:
                self.graph.reset()
            self.graph = None

    def __call__(self) -> bool:
        if self.graph is None:
            self.run()
            return False
        self.graph.replay()
        first, self.replayed = not self.replayed, True
        return first


# One thread at a time captures a CUDA graph or does what would break another thread's capture: torch.cuda.graph's
# entry synchronizes the device and frees cached memory, and destroying a graph frees its memory. Other work (steps,
# replays, plain forwards) runs beside a capture: it is captured in thread_local mode.
DEVICE_WIDE = threading.RLock()


def wait_for(devices: list[int]) -> None:
    """The host waits for the work queued on the current stream of each CUDA device in ``devices`` (not a
    device-wide synchronize, which fails while another thread captures a CUDA graph on the device)."""
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


@contextlib.contextmanager
def _current_streams(streams: dict):
    """Make ``streams[d]`` the current stream of each CUDA device ``d`` inside the block (the current device stays)."""
    home = torch.cuda.current_device()
    previous = [torch.cuda.current_stream(d) for d in streams]
    try:
        for s in streams.values():
            torch.cuda.set_stream(s)
        torch.cuda.set_device(home)
        yield
    finally:
        for s in previous:
            torch.cuda.set_stream(s)
        torch.cuda.set_device(home)


class AttentionSwitch:
    """What ``set_attn_implementation(STATIC_ATTENTION)`` changed in one model: every config it may set (the model's,
    its sub-configs', its sub-models') with their implementations before and after. A later switch of the same
    model whose configs still hold the ``before`` values writes the ``after`` values directly: the switch in and out
    then costs a few attribute writes instead of two walks over every module (about 0.5 ms of a call's front end on
    one CPU core for the bundled pair)."""

    def __init__(self, model):
        configs, stack = {}, [m.config for m in model.modules() if hasattr(m, "set_attn_implementation")]
        while stack:  # (PreTrainedModel sub-models and nested sub-configs, each config once)
            config = stack.pop()
            if id(config) not in configs:
                configs[id(config)] = config
                stack.extend(c for c in (getattr(config, k, None) for k in getattr(config, "sub_configs", {}))
                             if c is not None)
        self.configs = tuple(configs.values())
        self.before = self.values()
        model.set_attn_implementation(STATIC_ATTENTION)  # transformers' checks, once
        self.after = self.values()

    def values(self) -> tuple:
        return tuple(c._attn_implementation for c in self.configs)

    def apply(self, values: tuple) -> None:
        for config, value in zip(self.configs, values):
            config._attn_implementation_internal = value  # (what set_attn_implementation itself writes)


@contextlib.contextmanager
def static_attention_for(*models, switches: dict | None = None):
    """Run ``models`` with the ``"sparsekv_static"`` attention inside the block (each model once); each leaves it
    with the implementations its configs had before. ``switches``: id(model) -> :class:`AttentionSwitch`, kept by
    the caller across calls with the same models (an engine's): a model switched before, whose configs hold what they
    held then, is switched by direct writes."""
    switches = {} if switches is None else switches
    switched = []
    try:
        for m in {id(m): m for m in models}.values():
            if m.config._attn_implementation == STATIC_ATTENTION:
                continue
            switch = switches.get(id(m))
            if switch is not None and switch.values() == switch.before:
                switch.apply(switch.after)
            else:
                switch = switches[id(m)] = AttentionSwitch(m)
            switched.append(switch)
        yield
    finally:
        for switch in switched:
            switch.apply(switch.before)
