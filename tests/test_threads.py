"""Threads and interrupts. Concurrent generate() calls from several threads (speculative in every mode, int4
self-speculation on 4-bit draft weights, prompt lookup, plain stock calls) on two models and a third that both use as
their drafter and that also serves calls of its own: each output is exactly its stock greedy output, computed before
the threads start, and no call raises. On CPU the engine's steps run eagerly; the CUDA case runs them as captured
graphs. An interrupted prefill leaves the model as it was."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from hf_sparsekv import HierarchicalQuantCache
from hf_sparsekv.caches.static import PreallocatedCache
from hf_sparsekv.generation import engine as static_engine
from hf_sparsekv.generation import model_locks
from hf_sparsekv.generation.rwlock import ReadersWriterLock

from .conftest import prompt, tiny_model

THREADS = 4
NEW_TOKENS = 16


@pytest.fixture
def fresh_engines():
    static_engine.release_engines()
    yield
    static_engine.release_engines()


def _models(device: str, dtype: torch.dtype):
    """Two verifiers of different architectures and a model both draft with, each a copy (the calls attach 4-bit
    draft weights to them)."""
    copies = [copy.deepcopy(tiny_model(arch, role=role)) for arch, role in
              (("llama", "verifier"), ("qwen2", "verifier"), ("llama", "drafter"))]
    return [m.to(device, dtype) for m in copies]


# every kind of engine once, one kind per model (no call rebuilds another's engine), the shared model both a drafter
# and a verifier: their captures run side by side in the threads' first calls
FEW = ("plain-0", "lookup-0", "plain-1", "chunk-1", "int4-2")


def _calls(models, device: str, few: bool = False) -> list[tuple]:
    """``(name, model, ids, kwargs factory, reference)`` of every call: each verifier in every mode, the shared model
    as a verifier too (prompt lookup, int4, plain), the references computed here, on one thread. ``few``: the calls
    of :data:`FEW` only."""
    first, second, shared = models
    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    calls = []
    for i, model in enumerate(models):
        ids = prompt(30 + 7 * i, seed=i).to(device)
        reference = model.generate(ids, **greedy)
        int8_view = model.generate(ids, past_key_values=HierarchicalQuantCache(group_size=16), **greedy)
        calls += [
            (f"plain-{i}", model, ids, dict, reference),
            (f"lookup-{i}", model, ids, lambda: dict(prompt_lookup_num_tokens=3), reference),
            (f"int4-{i}", model, ids, lambda m=model: dict(assistant_model=m, draft_weights="int4",
                                                            draft_cache=HierarchicalQuantCache(group_size=16)),
             int8_view),
        ]
        if model is not shared:
            calls += [
                (f"chunk-{i}", model, ids, lambda: dict(assistant_model=shared, kv_budget=16), reference),
                (f"window-{i}", model, ids, lambda: dict(assistant_model=shared, draft_cache="window", kv_budget=12),
                 reference),
                (f"full-{i}", model, ids, lambda: dict(assistant_model=shared, draft_cache="full"), reference),
            ]
    if few:
        calls = [c for c in calls if c[0] in FEW]
    return [(name, model, ids, kwargs, ref, greedy) for name, model, ids, kwargs, ref in calls]


def _stress(device: str, dtype: torch.dtype, few: bool = False) -> None:
    models = _models(device, dtype)
    calls = _calls(models, device, few)
    barrier = threading.Barrier(THREADS, timeout=300)
    mismatches, errors = [], []

    def worker(t: int) -> None:
        shift = t * len(calls) // THREADS  # at every step the threads run different calls side by side
        order = calls[shift:] + calls[:shift]
        for name, model, ids, kwargs, reference, greedy in order:
            try:
                barrier.wait()
                out = model.generate(ids, **kwargs(), **greedy)
                if not torch.equal(out, reference):
                    mismatches.append((t, name))
            except Exception as err:  # noqa: BLE001  (every failure is reported, with its thread and call)
                errors.append((t, name, f"{type(err).__name__}: {err}"))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert not mismatches, mismatches
    for model in models:  # every call put the model's attention back
        assert model.config._attn_implementation == "sdpa"


def test_concurrent_calls_each_give_stock_greedy(fresh_engines):
    _stress("cpu", torch.float64)


@pytest.mark.cuda
def test_concurrent_calls_each_give_stock_greedy_on_the_graph_path(fresh_engines, exact_cuda_float32):
    """Every kind of engine (prompt lookup, int4 on 4-bit weights, a chunk drafter that is also a verifier) and
    stock's plain calls, four threads on three models: captures side by side take turns (make test-cuda-slow: every
    mode, engines rebuilt call after call)."""
    _stress("cuda", torch.float32, few=True)


@pytest.mark.cuda
@pytest.mark.slow
def test_concurrent_calls_of_every_mode_each_give_stock_greedy_on_the_graph_path(fresh_engines, exact_cuda_float32):
    _stress("cuda", torch.float32)


def test_an_interrupted_prefill_leaves_the_model_as_it_was(fresh_engines):
    """Ctrl-C in the verifier's prefill of a speculative call: both models have their attention back, the locks are
    free, and the next plain and speculative calls are exact."""
    verifier = copy.deepcopy(tiny_model("llama"))
    drafter = tiny_model("llama", role="drafter")
    ids = prompt(40, seed=3)
    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    reference = verifier.generate(ids, **greedy)

    def interrupt(module, args, kwargs):
        handle.remove()
        raise KeyboardInterrupt

    handle = verifier.model.layers[1].register_forward_pre_hook(interrupt, with_kwargs=True)
    with pytest.raises(KeyboardInterrupt):
        verifier.generate(ids, assistant_model=drafter, kv_budget=16, **greedy)
    assert verifier.config._attn_implementation == drafter.config._attn_implementation == "sdpa"
    assert torch.equal(verifier.generate(ids, **greedy), reference)
    assert torch.equal(verifier.generate(ids, assistant_model=drafter, kv_budget=16, **greedy), reference)
    assert not model_locks.lock_for(verifier).held() and not model_locks.lock_for(drafter).held()


def test_the_cache_to_attention_hand_off_is_per_thread(fresh_engines, monkeypatch):
    """Between a static cache layer's update and the attention that reads it back on one thread, a whole engine call
    on another model runs on another thread: both calls are exact."""
    first, second, drafter = tiny_model("llama"), tiny_model("qwen2"), tiny_model("llama", role="drafter")
    ids = prompt(30, seed=1)
    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    references = [model.generate(ids, **greedy) for model in (first, second)]
    update, results = PreallocatedCache.update, {}

    def call_on_another_thread():
        try:
            results["other"] = second.generate(ids, prompt_lookup_num_tokens=3, **greedy)
        except Exception as err:  # noqa: BLE001
            results["other"] = err

    def interleaved(self, *args, **kwargs):
        out = update(self, *args, **kwargs)
        if "other" not in results and threading.current_thread() is threading.main_thread():
            other = threading.Thread(target=call_on_another_thread)
            other.start()
            other.join(60)
        return out

    monkeypatch.setattr(PreallocatedCache, "update", interleaved)
    out = first.generate(ids, assistant_model=drafter, kv_budget=16, **greedy)
    assert torch.equal(results["other"], references[1])
    assert torch.equal(out, references[0])


def test_calls_wait_only_for_engine_calls_on_their_own_models():
    """While an engine call holds one model, calls on another model (plain and speculative) run, and a plain call
    on the held model waits for it."""
    held, other = tiny_model("llama"), tiny_model("qwen2")
    ids = prompt(10, seed=0)
    greedy = dict(max_new_tokens=3, do_sample=False)
    done = {}
    with model_locks.exclusive(held):  # as an engine call on ``held`` does
        free = threading.Thread(target=lambda: done.update(
            plain=other.generate(ids, **greedy), lookup=other.generate(ids, prompt_lookup_num_tokens=2, **greedy)))
        free.start()
        free.join(60)
        assert set(done) == {"plain", "lookup"}
        waiting = threading.Thread(target=lambda: done.update(held=held.generate(ids, **greedy)))
        waiting.start()
        waiting.join(0.3)
        assert "held" not in done
    waiting.join(60)
    assert torch.equal(done["held"], held.generate(ids, **greedy))


def test_the_lock_is_reentrant_and_lets_readers_share():
    lock = ReadersWriterLock()
    with lock.exclusive(), lock.exclusive(), lock.shared():  # an engine call recursing, reading its own model
        assert lock.held()
    assert not lock.held()
    with lock.shared():
        other = threading.Thread(target=lambda: (lock.acquire_shared(), lock.release_shared()))
        other.start()
        other.join(5)
        assert not other.is_alive()  # two readers at once
        with lock.shared():  # a reader nested in itself passes a waiting writer
            pass
    assert not lock.held()


def test_engine_calls_lock_their_models_in_one_order():
    """Two threads locking the same two models, each naming them in the other order (a model drafting for one call
    and verifying in the other), never wait for each other."""
    a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    done = []

    def run(first, second):
        for _ in range(200):
            with model_locks.exclusive(first, second):
                pass
        done.append(True)

    threads = [threading.Thread(target=run, args=pair) for pair in ((a, b), (b, a))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert done == [True, True]


def test_holding_locks_the_models_however_they_are_passed_and_refuses_as_binding_does():
    """``holding`` finds each model by position or keyword (the lock is held inside the call), and a call whose
    arguments do not bind raises ``inspect``'s error before the function runs."""
    a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    seen = []

    @model_locks.holding("model", "other")
    def call(model, x=None, other=None, *, flag=False, **kwargs):
        seen.append((model_locks.lock_for(a).held(), model_locks.lock_for(b).held()))

    call(a, 1, b)
    call(a, other=b, flag=True, extra=2)
    call(model=a, x=1, other=b)
    call(a)
    assert seen == [(True, True)] * 3 + [(True, False)]
    with pytest.raises(TypeError, match="multiple values for argument 'model'"):
        call(a, model=b)
    with pytest.raises(TypeError, match="too many positional arguments"):
        call(a, 1, b, 4)
    assert seen == [(True, True)] * 3 + [(True, False)]
    assert not model_locks.lock_for(a).held() and not model_locks.lock_for(b).held()
