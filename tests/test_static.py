"""The engine on CPU: preallocated caches against the dynamic caches (stored keys/values and mask positions, bit for
bit), device-side acceptance, and the speculative loop against greedy AR (on CPU its steps run uncaptured; the
captured path is tested in test_cuda.py)."""

from __future__ import annotations

import copy
import random
import re
import types

import pytest
import torch
from transformers import (
    DynamicCache,
    StaticCache,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import hf_sparsekv
from hf_sparsekv import ChunkBudgetCache, HierarchicalQuantCache, SinkWindowCache
from hf_sparsekv.caches.chunk_selection import ChunkSelection
from hf_sparsekv.caches.static import (
    StaticChunkBudgetCache, StaticChunkWindowCache, StaticFullCache, StaticQuantCache, StaticSinkWindowCache,
)
from hf_sparsekv.generation import engine as static_engine, graph_steps, rounds
from hf_sparsekv.generation.acceptance import accepted_length

from .conftest import ARCHS, left_padded, prompt, record_plain_reads, stock_generate, tiny_model

H, D = 2, 8


@pytest.fixture
def fresh_engines():
    static_engine.release_engines()
    yield
    static_engine.release_engines()


def _states(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, H, n, D, generator=g, dtype=torch.float64), torch.randn(1, H, n, D, generator=g, dtype=torch.float64)


def _dynamic_view(kind, cache):
    """What the dynamic cache's next query sees in layer 0: keys, values, mask positions (from get_mask_sizes)."""
    layer = cache.layers[0]
    if kind == "window":
        r = layer._visible_recent()
        keys = torch.cat([layer.keys, layer.recent_keys[..., layer.recent_keys.shape[-2] - r :, :]], dim=-2)
        values = torch.cat([layer.values, layer.recent_values[..., layer.recent_values.shape[-2] - r :, :]], dim=-2)
        sink = layer.keys.shape[-2]
        positions = torch.cat([torch.arange(sink), torch.arange(layer.seen - r, layer.seen)])
        return keys, values, positions
    stored = layer.keys.shape[-2]
    return layer.keys, layer.values, torch.arange(layer.seen - stored, layer.seen)


def _make(kind, budget, gamma):
    if kind.startswith("chunk"):
        per_head = kind == "chunk-per-kv-head"  # each KV head keeps its own chunks
        return (ChunkBudgetCache(budget, per_kv_head=per_head),
                StaticChunkBudgetCache(budget, 1, H, D, budget + 200, torch.float64, "cpu", per_kv_head=per_head))
    window = budget - 4
    return (
        SinkWindowCache(4, window, max_rollback=gamma + 1),
        StaticSinkWindowCache(4, window, gamma + 1, 1, H, D, torch.float64, "cpu"),
    )


@pytest.mark.parametrize("kind", ["chunk", "chunk-per-kv-head", "window"])
@pytest.mark.parametrize("prompt_len,budget,gamma", [(3, 16, 2), (40, 16, 3), (203, 64, 5), (64, 64, 1), (9, 24, 8)])
def test_static_cache_stores_what_the_dynamic_cache_stores(kind, prompt_len, budget, gamma):
    dynamic, static = _make(kind, budget, gamma)
    rng = random.Random(prompt_len * 31 + budget)
    k, v = _states(prompt_len, seed=prompt_len)
    query = torch.randn(1, 2 * H, prompt_len, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    dynamic.update(k, v, 0)
    if kind != "window" and prompt_len > budget:
        dynamic.layers[0].select(query, D**-0.5)
    static.begin_prefill(prompt_len)
    static.update(k, v, 0)
    if kind != "window" and static.needs_selection():
        static.select(static.layers[0], query, k, v, D**-0.5)
    static.end_prefill()
    seen = prompt_len
    for step in range(40):
        keys, values, positions = static.stored(0, seen)
        ref_keys, ref_values, ref_positions = _dynamic_view(kind, dynamic)
        assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values), f"step {step}"
        assert torch.equal(positions, ref_positions), f"step {step}"
        # one token appended (as a drafter step does), then now and then a rollback of up to gamma tokens
        k1, v1 = _states(1, seed=1000 + step)
        dynamic.update(k1, v1, 0)
        static.begin_step(torch.tensor([[seen]]))
        static.update(k1, v1, 0)
        seen += 1
        if rng.random() < 0.3:
            back = rng.randint(1, min(gamma, seen - prompt_len) or 1)
            if seen - back >= prompt_len:
                dynamic.crop(-back)
                seen -= back


@pytest.mark.parametrize("kind", ["full", "chunk", "window"])
def test_rows_of_a_batched_cache_are_independent(kind):
    """Each row of a batch-3 static cache holds exactly what a batch-1 cache fed that row's prompt and steps holds,
    while the rows advance and roll back by different amounts in the same steps."""
    rng = random.Random(3)
    budget, gamma, rows, lengths = 16, 3, 3, [5, 40, 23]

    def make(batch):
        if kind == "full":
            return StaticFullCache(1, H, D, 128, torch.float64, "cpu", batch)
        if kind == "chunk":
            return StaticChunkBudgetCache(budget, 1, H, D, budget + 80, torch.float64, "cpu", batch=batch)
        return StaticSinkWindowCache(4, budget - 4, gamma + 1, 1, H, D, torch.float64, "cpu", batch)

    batched, singles = make(rows), [make(1) for _ in range(rows)]
    for row, n in enumerate(lengths):
        k, v = _states(n, seed=n)
        query = torch.randn(1, 2 * H, n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
        for cache, r in ((batched, row), (singles[row], 0)):
            cache.begin_prefill(n, r)
            cache.update(k, v, 0)
            if kind == "chunk" and cache.needs_selection():
                cache.select(cache.layers[0], query, k, v, D**-0.5)
            cache.end_prefill()
    seen = list(lengths)
    for step in range(30):
        block = [torch.arange(m, m + gamma + 1) for m in seen]
        states = [_states(gamma + 1, seed=100 * step + row) for row in range(rows)]
        batched.begin_step(torch.stack(block))
        batched.update(torch.cat([k for k, _ in states]), torch.cat([v for _, v in states]), 0)
        for row in range(rows):
            singles[row].begin_step(block[row][None])
            singles[row].update(*states[row], 0)
            seen[row] += rng.randint(1, gamma + 1)  # each row keeps its own share of the block
            got = batched.stored(0, seen[row], row)
            want = singles[row].stored(0, seen[row])
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (step, row)
        assert batched.fp_length.tolist() == [int(c.fp_length) for c in singles]


@pytest.mark.parametrize("kind", ["full", "chunk"])
def test_a_finished_row_reads_only_its_step(kind):
    """With ``live`` set, a finished row's kernel length is the step's query count while the other rows keep theirs
    (the rows go on independently: the live rows' lengths equal those of a cache without ``live``)."""
    def make():
        if kind == "full":
            return StaticFullCache(1, H, D, 256, torch.float64, "cpu", 3)
        return StaticChunkBudgetCache(16, 1, H, D, 256, torch.float64, "cpu", batch=3)

    gated, plain = make(), make()
    for cache in (gated, plain):
        for row, n in enumerate((5, 40, 23)):
            k, v = _states(n, seed=n)
            cache.begin_prefill(n, row)
            cache.update(k, v, 0)
            if kind == "chunk" and cache.needs_selection():
                q = torch.randn(1, 2 * H, n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
                cache.select(cache.layers[0], q, k, v, D**-0.5)
            cache.end_prefill()
    gated.live = torch.tensor([1, 0, 1])
    positions = torch.tensor([[5, 6, 7, 8], [40, 41, 42, 43], [23, 24, 25, 26]])
    for cache in (gated, plain):
        cache.begin_step(positions)
        states = [_states(4, seed=20 + row) for row in range(3)]
        cache.update(torch.cat([k for k, _ in states]), torch.cat([v for _, v in states]), 0)
    want = plain.fp_length.tolist()
    assert gated.fp_length.tolist() == [want[0], 4, want[2]] and want[1] > 4


def test_static_full_cache_is_position_indexed():
    cache = StaticFullCache(1, H, D, 32, torch.float64, "cpu")
    k, v = _states(5, seed=0)
    cache.begin_prefill(5)
    cache.update(k, v, 0)
    cache.end_prefill()
    k2, v2 = _states(3, seed=1)
    cache.begin_step(torch.tensor([[5, 6, 7]]))
    keys, values = cache.update(k2, v2, 0)
    assert int(cache.fp_length) == 8
    assert torch.equal(keys[:, :, :8], torch.cat([k, k2], dim=-2))
    visible = cache.visible(torch.tensor([[5, 6, 7]]))[0]
    assert visible[:, :8].tolist() == [[j <= i + 5 for j in range(8)] for i in range(3)] and not visible[:, 8:].any()
    cache.begin_step(torch.tensor([[6]]))  # rollback to 6 tokens: the next step overwrites position 6
    k3, v3 = _states(1, seed=2)
    keys, _ = cache.update(k3, v3, 0)
    assert int(cache.fp_length) == 7 and torch.equal(keys[:, :, 6], k3[:, :, 0])


def test_static_caches_refuse_bad_use():
    cache = StaticFullCache(1, H, D, 8, torch.float64, "cpu")
    k, v = _states(1, seed=0)
    with pytest.raises(RuntimeError, match="begin_step"):
        cache.update(k, v, 0)
    cache.begin_prefill(3)
    with pytest.raises(ValueError, match="prefill of 3"):
        cache.update(k, v, 0)
    with pytest.raises(ValueError, match="capacity"):
        cache.begin_prefill(9)
        cache.update(*_states(9, seed=1), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("prompt_len,gamma", [(5, 3), (40, 1), (97, 5), (130, 7)])
def test_static_quant_store_equals_the_dynamic_store(dtype, prompt_len, gamma):
    """Codes, scales and full-precision buffer of StaticQuantCache equal HierarchicalQuantCache's, bit for bit,
    through a prefill, steps of up to γ+1 tokens that never cross a multiple of G, rollbacks and flushes."""
    g_size, rng = 16, random.Random(prompt_len)
    total = prompt_len + 120
    keys, values = (x.to(dtype) for x in _states(total + gamma + 1, seed=prompt_len))
    dynamic = HierarchicalQuantCache(group_size=g_size)
    static = StaticQuantCache(g_size, total + gamma + 1, gamma + 1, 1, H, D, dtype, "cpu")
    dynamic.update(keys[:, :, :prompt_len], values[:, :, :prompt_len], 0)
    static.begin_prefill(prompt_len)
    static.update(keys[:, :, :prompt_len], values[:, :, :prompt_len], 0)
    static.end_prefill()
    seen = prompt_len
    while seen < total:
        static.flush_to(seen)
        n = min(rng.randint(1, gamma + 1), static.room(seen), dynamic.uniform_room())
        assert static.room(seen) == dynamic.uniform_room()
        block = slice(seen, seen + n)
        dynamic.update(keys[:, :, block], values[:, :, block], 0)
        static.begin_step(torch.arange(seen, seen + n)[None])
        static.update(keys[:, :, block], values[:, :, block], 0)
        d, s = dynamic.layers[0], static.layers[0]
        t = d.quantized_length
        assert static.quantized == [t] and int(static.quant_length) == t and int(static.fp_length) == seen + n - t
        if t:
            for ours, theirs in ((s.qkeys, d.qkeys), (s.qvalues, d.qvalues)):
                rows = t // g_size if ours is s.qkeys else t
                assert torch.equal(ours.upper[:, :, :t], theirs.upper) and torch.equal(ours.lower[:, :, :t], theirs.lower)
                assert torch.equal(ours.scale[:, :, :rows], theirs.scale) and torch.equal(ours.zero[:, :, :rows], theirs.zero)
        assert torch.equal(s.keys[:, :, : seen + n - t], d.keys) and torch.equal(s.values[:, :, : seen + n - t], d.values)
        keep = rng.randint(1, n)  # roll back the rejected part of the block
        dynamic.crop(keep - n)
        seen += keep


def test_rows_of_a_batched_quant_store_are_independent():
    """Each row of a batch-3 StaticQuantCache holds, bit for bit, what a HierarchicalQuantCache fed that row's
    prompt and kept tokens holds, while the rows flush at their own points and every step writes the whole block
    (γ + 1 tokens) into every row, also past where a row may keep tokens."""
    g_size, gamma, rng = 16, 3, random.Random(11)
    lengths, total = [5, 40, 97], 200
    states = [_states(2 * total, seed=n) for n in lengths]
    dynamic = [HierarchicalQuantCache(group_size=g_size) for _ in lengths]
    static = StaticQuantCache(g_size, 2 * total, gamma + 1, 1, H, D, torch.float64, "cpu", batch=3)
    for row, n in enumerate(lengths):
        keys, values = states[row]
        dynamic[row].update(keys[:, :, :n], values[:, :, :n], 0)
        static.begin_prefill(n, row)
        static.update(keys[:, :, :n], values[:, :, :n], 0)
        static.end_prefill()
    seen = list(lengths)
    while min(seen) < total - gamma - 1:
        for row in range(3):
            static.flush_to(seen[row], row)
        static.begin_step(torch.stack([torch.arange(m, m + gamma + 1) for m in seen]))
        static.update(torch.cat([k[:, :, m : m + gamma + 1] for (k, _), m in zip(states, seen)]),
                      torch.cat([v[:, :, m : m + gamma + 1] for (_, v), m in zip(states, seen)]), 0)
        for row in range(3):
            keep = min(rng.randint(1, gamma + 1), static.room(seen[row]))
            keys, values = states[row]
            dynamic[row].update(keys[:, :, seen[row] : seen[row] + keep], values[:, :, seen[row] : seen[row] + keep], 0)
            seen[row] += keep
            d, s, t = dynamic[row].layers[0], static.layers[0], dynamic[row].layers[0].quantized_length
            assert static.quantized[row] == t == int(static.quant_length[row])
            for ours, theirs in ((s.qkeys, d.qkeys), (s.qvalues, d.qvalues)) if t else ():
                n = t // g_size if ours is s.qkeys else t
                assert torch.equal(ours.upper[row : row + 1, :, :t], theirs.upper)
                assert torch.equal(ours.lower[row : row + 1, :, :t], theirs.lower)
                assert torch.equal(ours.scale[row : row + 1, :, :n], theirs.scale)
                assert torch.equal(ours.zero[row : row + 1, :, :n], theirs.zero)
            fp = seen[row] - t
            assert torch.equal(s.keys[row : row + 1, :, :fp], d.keys[:, :, :fp]), row
            assert torch.equal(s.values[row : row + 1, :, :fp], d.values[:, :, :fp]), row


def test_device_acceptance_equals_a_python_loop():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        gamma, rows = (int(torch.randint(1, 9, (1,), generator=g)) for _ in range(2))
        drafts = torch.randint(0, 3, (rows, gamma), generator=g)
        verified = torch.randint(0, 3, (rows, gamma + 1), generator=g)
        expected = []
        for d, v in zip(drafts.tolist(), verified.tolist()):
            a = 0
            while a < gamma and d[a] == v[a]:
                a += 1
            expected.append(a)
        assert accepted_length(drafts, verified).tolist() == expected


def _static_cases(seed=0):
    rng = random.Random(seed)
    cases = []
    for arch in ARCHS:
        for i, mode in enumerate(["chunk", "window", "full"] * 3):
            cases.append(dict(
                arch=arch, mode=mode, prompt_len=rng.choice([1, 3, 33, 120, 257, 400]), budget=rng.choice([8, 16, 64, 512]),
                gamma=[1, 3, 8][i // 3], copy_drafter=rng.random() < 0.5, eos=rng.random() < 0.3, seed=i,
            ))
    return cases


@pytest.mark.parametrize("case", _static_cases(), ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_static_loop_is_lossless(fresh_engines, case):
    verifier = tiny_model(case["arch"])
    drafter = copy.deepcopy(verifier) if case["copy_drafter"] else tiny_model(case["arch"], role="drafter")
    ids = prompt(case["prompt_len"], seed=case["seed"])
    kwargs = dict(max_new_tokens=40, do_sample=False)
    if not case["eos"]:
        kwargs.update(eos_token_id=None, pad_token_id=0)
    reference = verifier.generate(ids, **kwargs)
    budget = max(case["budget"], 8) if case["mode"] != "window" else max(case["budget"], 12)
    spec = dict(assistant_model=drafter, draft_cache=case["mode"], kv_budget=None if case["mode"] == "full" else budget)
    out = verifier.generate(ids, num_assistant_tokens=case["gamma"], return_dict_in_generate=True, **spec, **kwargs)
    assert torch.equal(out.sequences, reference)
    engine = static_engine.current_engine(verifier)
    assert engine.spec.mode == case["mode"] and engine.use_graphs is False  # the static loop ran (no capture on CPU)
    stats = out.spec_stats
    assert stats["new_tokens"] == reference.shape[1] - ids.shape[1]
    if case["copy_drafter"] and case["mode"] == "full" and stats["drafted"]:
        assert stats["acceptance_rate"] == 1.0


@pytest.mark.parametrize("arch", ARCHS)
def test_static_int4_self_speculation_equals_ar_on_the_int8_view(fresh_engines, arch):
    """QuantSpec self-speculation on the static loop: the output is greedy AR on the INT8 view of the same store
    (γ 1/3/8, prompts shorter than 2G and longer, rounds near group boundaries without drafts)."""
    verifier = tiny_model(arch)
    kwargs = dict(max_new_tokens=70, do_sample=False, eos_token_id=None, pad_token_id=0)
    for length, gamma in ((5, 3), (70, 8), (300, 1), (333, 3)):
        ids = prompt(length, seed=length)
        reference = verifier.generate(ids, past_key_values=HierarchicalQuantCache(group_size=32), **kwargs)
        out = verifier.generate(ids, assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=32),
                                num_assistant_tokens=gamma, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, reference), (length, gamma)
        engine = static_engine.current_engine(verifier)
        assert engine.spec.mode == "int4" and engine.spec.budget == 32 and engine.drafter_cache is engine.verifier_cache
        assert out.spec_stats.drafted > 0


def test_engine_is_reused_and_rebuilt_when_needed(fresh_engines):
    verifier, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    outs = []
    for length in (50, 30, 50):
        ids = prompt(length, seed=length)
        outs.append(verifier.generate(ids, assistant_model=drafter, kv_budget=16, **kwargs))
        assert torch.equal(outs[-1], verifier.generate(ids, **kwargs))
        if length == 50 and len(outs) == 1:
            first = static_engine.current_engine(verifier)
    assert static_engine.current_engine(verifier) is first  # same spec, capacity suffices: caches (and graphs) reused
    verifier.generate(prompt(20, 0), assistant_model=drafter, kv_budget=32, **kwargs)
    assert static_engine.current_engine(verifier) is not first  # another budget: a new engine


def test_alternating_configurations_keep_their_engines_within_the_memory_budget(fresh_engines, monkeypatch):
    """Calls alternating between configurations find their engines again (nothing rebuilt); under a memory budget
    that holds one engine, each switch frees the least recently used one, with one warning naming the setting; each
    call's tokens are stock greedy's."""
    warned = []  # (warning_once: a message of an earlier test would not show again)
    monkeypatch.setattr(static_engine.logger, "warning_once", warned.append)
    verifier, drafter = copy.deepcopy(tiny_model("llama")), tiny_model("llama", role="drafter")
    ids = prompt(40, seed=2)
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = verifier.generate(ids, **kwargs)
    calls = [dict(static_engine=True), dict(assistant_model=drafter, kv_budget=16)] * 2
    engines = []
    for extra in calls:
        assert torch.equal(verifier.generate(ids, **extra, **kwargs), expected)
        engines.append(static_engine.current_engine(verifier))
    assert engines[2] is engines[0] and engines[3] is engines[1] and engines[0] is not engines[1]
    assert not warned
    monkeypatch.setenv(static_engine.ENGINE_MEMORY_ENV, "0")
    for extra in calls:
        assert torch.equal(verifier.generate(ids, **extra, **kwargs), expected)
        assert len(static_engine._engines[verifier]) == 1
    assert len(warned) == len(calls) and all(static_engine.ENGINE_MEMORY_ENV in w for w in warned)
    # it states this machine's budget, not figures measured on another device
    assert all("0.0 GiB" in w and not re.search(r"H[12]00|\d+K\b|\d s\b", w) for w in warned)
    monkeypatch.setenv(static_engine.ENGINE_MEMORY_ENV, "lots")
    with pytest.raises(ValueError, match="GiB"):  # (a call with the engine's options: no hand-back to stock)
        verifier.generate(ids, assistant_model=drafter, kv_budget=16, **kwargs)


def test_an_engine_is_rebuilt_when_a_weight_is_replaced(fresh_engines):
    """The engine's key holds every parameter's storage: a parameter replaced by a new one or a module swapped for a
    new one gives a new engine, whose output follows the new
    weights (stock greedy with them); unchanged weights keep the engine."""
    # (copies: tiny_model's models are shared by the tests, and this one replaces their weights)
    verifier, drafter = copy.deepcopy(tiny_model("llama")), copy.deepcopy(tiny_model("llama", role="drafter"))
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = prompt(40, seed=9)
    verifier.generate(ids, assistant_model=drafter, kv_budget=16, **kwargs)
    first = static_engine.current_engine(verifier)
    verifier.generate(ids, assistant_model=drafter, kv_budget=16, **kwargs)
    assert static_engine.current_engine(verifier) is first
    mlp = verifier.model.layers[1].mlp
    g = torch.Generator().manual_seed(3)
    mlp.down_proj.weight = torch.nn.Parameter(mlp.down_proj.weight.detach() + 0.05 * torch.randn(
        mlp.down_proj.weight.shape, generator=g, dtype=mlp.down_proj.weight.dtype), requires_grad=False)
    out = verifier.generate(ids, assistant_model=drafter, kv_budget=16, **kwargs)
    assert static_engine.current_engine(verifier) is not first
    assert torch.equal(out, verifier.generate(ids, **kwargs))
    second = static_engine.current_engine(verifier)
    old = drafter.model.layers[0].self_attn.o_proj
    drafter.model.layers[0].self_attn.o_proj = torch.nn.Linear(old.in_features, old.out_features, bias=False,
                                                                dtype=old.weight.dtype)
    out = verifier.generate(ids, assistant_model=drafter, kv_budget=16, **kwargs)
    assert static_engine.current_engine(verifier) is not second
    assert torch.equal(out, verifier.generate(ids, **kwargs))


def test_the_attention_switch_is_recorded_once_and_leaves_each_model_as_it_was(fresh_engines, monkeypatch):
    """A call runs both models on the engine's attention and leaves each with its own: transformers'
    ``set_attn_implementation`` runs at an engine's first call only (later calls write the recorded values), again
    after the user changed a model's implementation (which the call then keeps); every output is stock greedy."""
    from hf_sparsekv.static_attention import NAME

    # (copies: tiny_model's models are shared by the tests, and this one changes the verifier's attention)
    verifier, drafter = copy.deepcopy(tiny_model("qwen2")), copy.deepcopy(tiny_model("qwen2", role="drafter"))
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = prompt(30, seed=4)
    reference = verifier.generate(ids, **kwargs)
    switched, inside = [], []
    real_switch = type(verifier).set_attn_implementation
    monkeypatch.setattr(type(verifier), "set_attn_implementation",
                        lambda self, value, **kw: (switched.append(value), real_switch(self, value, **kw))[1])
    real_prefill = static_engine.StaticEngine.prefill
    monkeypatch.setattr(static_engine.StaticEngine, "prefill", lambda self, *a, **kw: (
        inside.append((verifier.config._attn_implementation, drafter.config._attn_implementation)),
        real_prefill(self, *a, **kw))[1])
    before = (verifier.config._attn_implementation, drafter.config._attn_implementation)
    for user_value, expected_switches in ((None, [NAME, NAME]), (None, []), ("eager", [NAME])):
        if user_value is not None:
            real_switch(verifier, user_value)
            before = (user_value, before[1])
        switched.clear()
        out = verifier.generate(ids, assistant_model=drafter, kv_budget=16, **kwargs)
        assert torch.equal(out, reference)
        assert switched == expected_switches and inside[-1] == (NAME, NAME)
        assert (verifier.config._attn_implementation, drafter.config._attn_implementation) == before


def test_graph_greedy_generate_equals_generate(arch):
    verifier = tiny_model(arch)
    for length in (1, 77, 300):
        ids = prompt(length, seed=length)
        for eos in (None, 2):
            kwargs = dict(eos_token_id=eos) if eos is not None else dict(eos_token_id=None, pad_token_id=0)
            reference = verifier.generate(ids, max_new_tokens=30, do_sample=False, **kwargs)
            out = hf_sparsekv.graph_greedy_generate(verifier, ids, max_new_tokens=30, eos_token_id=eos if eos else [])
            assert torch.equal(out, reference)


def test_greedy_ar_queues_each_burst_before_it_waits_for_the_last(fresh_engines, monkeypatch):
    """Plain steps run in bursts of QUEUED_BURST, the host waiting for a burst's tokens only once the next burst is
    queued behind it (so the device does not wait for the host), the last burst cut to the room left; the tokens are
    stock greedy's."""
    verifier = tiny_model("llama")
    ids = prompt(50, seed=2)
    reads, _ = record_plain_reads(monkeypatch)
    clock, counted = [0.0], static_engine.StaticEngine.run_step  # the round loop's clock: 1 s a plain step, else still

    def timed(engine, name, width=None, run=True):
        new = counted(engine, name, width, run)
        clock[0] += 1.0 if run and name == "ar_step" else 0.0
        return new

    monkeypatch.setattr(static_engine.StaticEngine, "run_step", timed)
    monkeypatch.setattr(rounds, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    out = hf_sparsekv.graph_greedy_generate(verifier, ids, max_new_tokens=30, eos_token_id=[])
    assert torch.equal(out, verifier.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None,
                                              pad_token_id=0))
    assert rounds.QUEUED_BURST == 4  # the prefill gives the first token, 29 steps the rest:
    assert reads == [(8, 4), (12, 4), (16, 4), (20, 4), (24, 4), (28, 4), (29, 4), (29, 1)]  # each read after the
    # next burst is queued; each burst's time per step is its own (on CPU a step runs as it is queued: the next
    # burst's queueing is not this one's time), on the clock above exactly 1 s. The first burst is no sample (its
    # step's first run)
    seconds = static_engine.current_engine(verifier).controller_memory.samples[0]
    assert seconds == pytest.approx([1.0] * len(seconds)) and len(seconds) >= 6, seconds


def test_a_call_that_stops_at_eos_wastes_less_than_two_bursts(fresh_engines, monkeypatch):
    """A greedy call that ends at EOS: its tokens are stock's, and the steps run past its last token (the rest of
    the burst that held it and the burst queued then) are fewer than 2 * QUEUED_BURST."""
    verifier = tiny_model("qwen2")
    ids = prompt(40, seed=4)
    free = verifier.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    launched = [0]
    run_step = static_engine.StaticEngine.run_step

    def counted(engine, name, width=None, run=True):
        launched[0] += run and name == "ar_step"
        return run_step(engine, name, width, run)
    monkeypatch.setattr(static_engine.StaticEngine, "run_step", counted)
    for stop in (3, 9, 22):  # the EOS id: the token generated at that step (unless it came earlier)
        eos = int(free[0, ids.shape[1] + stop])
        launched[0] = 0
        out = hf_sparsekv.graph_greedy_generate(verifier, ids, max_new_tokens=40, eos_token_id=eos)
        assert torch.equal(out, verifier.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=eos))
        steps = out.shape[1] - ids.shape[1] - 1  # (the prefill gave the first token)
        assert steps <= launched[0] < steps + 2 * rounds.QUEUED_BURST, (stop, steps, launched[0])


@pytest.mark.parametrize("arch", ARCHS)
def test_graph_greedy_generate_on_a_left_padded_batch(arch):
    """Rows of very different lengths decode together (one engine of 4 rows); each row is its prompt's greedy
    generate() alone, then padding where it stopped before the longest row."""
    verifier = tiny_model(arch)
    prompts = [prompt(n, seed=n) for n in (1, 77, 300, 40)]
    free = [verifier.generate(p, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)[0, p.shape[1]:]
            for p in prompts]
    eos = int(free[1][5])  # row 1 stops early; the others stop there too if they produce it
    references = [verifier.generate(p, max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=0)
                  for p in prompts]
    ids, mask = left_padded(prompts)
    width = ids.shape[1]
    out = hf_sparsekv.graph_greedy_generate(verifier, ids, max_new_tokens=24, eos_token_id=eos,
                                            attention_mask=mask, pad_token_id=0)
    assert static_engine.current_engine(verifier).spec.batch == len(prompts)
    assert out.shape[0] == len(prompts) and references[1].shape[1] < prompts[1].shape[1] + 24
    for b, (p, ref) in enumerate(zip(prompts, references)):
        row = out[b, width - p.shape[1]:]
        assert torch.equal(row[: ref.shape[1]], ref[0]) and not row[ref.shape[1]:].any(), b
        assert torch.equal(out[b, : width - p.shape[1]], ids[b, : width - p.shape[1]]), b
    with pytest.raises(ValueError, match="attention_mask has shape"):
        hf_sparsekv.graph_greedy_generate(verifier, ids, max_new_tokens=4, attention_mask=mask[:, 1:])


def test_a_users_logits_processor_runs_on_the_host_between_the_steps(fresh_engines):
    verifier, drafter = tiny_model("qwen2"), tiny_model("qwen2", role="drafter")
    ids = prompt(40, seed=3)
    processors = LogitsProcessorList([MinLengthLogitsProcessor(48, eos_token_id=2)])
    reference = verifier.generate(ids, max_new_tokens=20, do_sample=False, logits_processor=processors)
    out = verifier.generate(ids, assistant_model=drafter, kv_budget=16, max_new_tokens=20, do_sample=False,
                            logits_processor=processors)
    assert torch.equal(out, reference)
    assert static_engine.current_engine(verifier).spec.host  # the static engine, the processor applied on the host


def test_a_captured_step_reports_its_graphs_first_replay():
    """Calling a step says whether it replayed its graph for the first time (the controller's round holding it is no
    time sample); an uncaptured step never does. (The graph here is a stand-in; test_cuda captures a real one.)"""
    ran = []
    step = graph_steps.CapturedStep(lambda: ran.append(1))
    assert [step(), step()] == [False, False] and ran == [1, 1]

    class Graph:
        replays = 0

        def replay(self):
            self.replays += 1

    step.graph, step.replayed = Graph(), False
    assert [step() for _ in range(3)] == [True, False, False] and step.graph.replays == 3 and ran == [1, 1]


def test_graphs_off_runs_the_engine_uncaptured(monkeypatch):
    """HF_SPARSEKV_GRAPHS=0: the same engine and steps, never captured; a wrong value is refused, naming it."""
    monkeypatch.setenv("HF_SPARSEKV_GRAPHS", "0")
    static_engine.release_engines()
    verifier, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    ids = prompt(30, seed=1)
    out = verifier.generate(ids, assistant_model=drafter, kv_budget=16, max_new_tokens=10, do_sample=False)
    assert torch.equal(out, verifier.generate(ids, max_new_tokens=10, do_sample=False))
    engine = static_engine.current_engine(verifier)
    assert engine is not None and not engine.use_graphs
    monkeypatch.setenv("HF_SPARSEKV_GRAPHS", "yes")
    with pytest.raises(ValueError, match="HF_SPARSEKV_GRAPHS"):
        verifier.generate(ids, assistant_model=drafter, kv_budget=16, max_new_tokens=10, do_sample=False)


@pytest.mark.compiled
@pytest.mark.parametrize("arch,mode,gamma", [("llama", "chunk", 3), ("qwen2", "full", 1), ("mistral", "window", 5),
                                             ("qwen2", "int4", 3)])
def test_compiled_static_loop_is_lossless(compiled_steps, arch, mode, gamma):
    from torch._dynamo.utils import counters

    verifier, drafter = tiny_model(arch), tiny_model(arch, role="drafter")
    kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    for length in (5, 300):
        ids = prompt(length, seed=length + gamma)
        if mode == "int4":
            reference = verifier.generate(ids, past_key_values=HierarchicalQuantCache(group_size=32), **kwargs)
            spec = dict(assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=32))
        else:
            reference = verifier.generate(ids, **kwargs)
            spec = dict(assistant_model=drafter, draft_cache=mode, kv_budget=None if mode == "full" else 24)
        out = verifier.generate(ids, num_assistant_tokens=gamma, **spec, **kwargs)
        assert torch.equal(out, reference)
        engine = static_engine.current_engine(verifier)
        # every step compiled; a chain's draft step replays its one-token drafter step, compiled once for all widths
        assert engine.compiled and all(step.fn is not step.eager_fn for key, step in engine.steps.items()
                                       if "draft" not in key)
        graphs = counters["stats"]["unique_graphs"]
        with torch.no_grad(), graph_steps.static_attention_for(verifier, engine.drafter):
            engine.run_step("draft", 1)  # another width: the same compiled code
        assert engine._compiled_draft_tokens and counters["stats"]["unique_graphs"] == graphs


@pytest.mark.compiled
def test_compiled_queued_drafts_are_lossless(compiled_steps, monkeypatch):
    """Drafts queued behind each verify step (CUDA's default, forced on here), compiled: a queued round's first draft
    step, which reads ``seq[n-2]`` too, compiles on its own beside the one-token step; stock greedy with a window
    and a chunk drafter under a constant γ (every round after the first verifies queued drafts)."""
    from hf_sparsekv.generation import rounds

    monkeypatch.setattr(rounds, "QUEUE_DRAFTS", True)
    verifier, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    ids = prompt(200, seed=7)
    kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    reference = verifier.generate(ids, **kwargs)
    for mode in ("window", "chunk"):
        out = verifier.generate(ids, assistant_model=drafter, draft_cache=mode, kv_budget=24, num_assistant_tokens=3,
                                num_assistant_tokens_schedule="constant", **kwargs)
        assert torch.equal(out, reference), mode
        assert set(static_engine.current_engine(verifier)._compiled_draft_tokens) == {False, True}, mode


_TRACE_CASES = [  # (mode, sampling, batch, engine_for's further settings); the later ones are extended
    ("chunk", False, 1, {}), ("window", False, 1, {}), ("chunk", True, 1, {}), ("chunk", False, 3, {}),
    pytest.param("full", False, 2, {}, marks=pytest.mark.extended, id="full-batch"),
    pytest.param("chunk", True, 2, dict(penalty=(1.3, 0)), marks=pytest.mark.extended, id="penalty"),
    pytest.param("chunk", False, 2, dict(host=True), marks=pytest.mark.extended, id="host"),
    pytest.param("chunk", True, 1, dict(host=True, layout="bounded"), marks=pytest.mark.extended, id="bounded-host"),
]


@pytest.mark.parametrize("mode,sampled,batch,extra", _TRACE_CASES)
def test_static_steps_trace_without_graph_breaks(fresh_engines, mode, sampled, batch, extra):
    """Each step is one graph for torch.compile (a break would split the fused kernels around it): every mode, with
    sampling, batches, the repetition penalty, host-side rules and the bounded chunk cache."""
    import torch._dynamo

    from hf_sparsekv.caches import ChunkSelection

    verifier, drafter = tiny_model("mistral"), tiny_model("mistral", role="drafter")
    warpers = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(8), TopPLogitsWarper(0.9), MinPLogitsWarper(0.05)] \
        if sampled else None
    if extra.get("layout") == "bounded":  # ChunkBudgetCache(16, generated_window=8): StaticChunkWindowCache
        extra = dict(extra, layout=(8, ChunkSelection(), 8))
    engine = static_engine.engine_for(verifier, drafter, mode, 16, 3, 80, 20, use_graphs=False, warpers=warpers,
                                   batch=batch, **extra)
    host = extra.get("host", False)
    steps = ("draft", "verify_logits", "catch_up", "ar_logits") if host else ("draft", "verify", "catch_up", "ar_step")
    with torch.no_grad(), graph_steps.static_attention_for(verifier, drafter):
        engine.prefill([prompt(40 - 9 * row, seed=2 + row) for row in range(batch)],
                       (lambda row, raw: int(raw.argmax())) if host else None)
        for name in steps:
            explained = torch._dynamo.explain(getattr(engine, "_" + name))()
            assert explained.graph_break_count == 0, (name, explained.break_reasons)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["chunk", "window"])
def test_static_self_drafting_is_lossless_with_one_prefill(fresh_engines, arch, mode, monkeypatch):
    """assistant_model=model with a chunk-budget or window cache on the static loop: the drafter's cache is filled
    from the model's own prefill (the same keys and chunk selection as a second prefill of the whole prompt would
    give), and the output is greedy AR."""
    # (a separate drafter's window reads only the positions it keeps; the twin below reads the whole prompt, as the
    # shared prefill does)
    monkeypatch.setattr(StaticSinkWindowCache, "kept_prompt_positions", lambda self, length: None)
    verifier = tiny_model(arch)
    kwargs = dict(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    for length, gamma in ((9, 3), (250, 5)):
        ids = prompt(length, seed=length + 7)
        spec = dict(draft_cache=mode, kv_budget=32, num_assistant_tokens=gamma)
        out = verifier.generate(ids, assistant_model=verifier, return_dict_in_generate=True, **spec, **kwargs)
        assert torch.equal(out.sequences, verifier.generate(ids, **kwargs))
        engine = static_engine.current_engine(verifier)
        assert engine.drafter is verifier and engine.spec.mode == mode and out.spec_stats.drafted > 0
        twin = copy.deepcopy(verifier)  # the same weights as a separate drafter: its own prefill
        with torch.no_grad(), graph_steps.static_attention_for(verifier, twin):
            shared = static_engine.engine_for(verifier, verifier, mode, 32, gamma, length + 64, 64, use_graphs=False)
            shared.prefill([ids])
            single = static_engine.StaticEngine(verifier, twin, shared.spec, length + 64, 64, use_graphs=False)
            single.prefill([ids])
        stored = single.drafter_cache.slot_positions[0] >= 0  # (the shared engine's other slots: the last call's tokens)
        assert torch.equal(shared.drafter_cache.slot_positions[0] >= 0, stored) and stored.any()
        assert torch.equal(shared.drafter_cache.slot_positions[0, stored], single.drafter_cache.slot_positions[0, stored])
        for a, b in zip(shared.drafter_cache.layers, single.drafter_cache.layers):
            assert torch.equal(a.keys[:, :, stored], b.keys[:, :, stored])
            assert torch.equal(a.values[:, :, stored], b.values[:, :, stored])


@pytest.mark.parametrize("mode", ["chunk", "window", "int4"])
def test_static_loop_suppresses_eos_like_stock_min_length(fresh_engines, mode):
    """min_new_tokens / min_length on the static loop (EOS masked on the device below the floor): the same tokens
    as stock greedy generate(), EOS included once the floor is passed."""
    verifier = tiny_model("llama")
    drafter = verifier if mode == "int4" else copy.deepcopy(verifier)
    ids = prompt(30, seed=4)
    free = verifier.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 30:]
    for eos_at, floor in ((0, dict(min_new_tokens=5)), (2, dict(min_length=38)), (3, dict(min_new_tokens=2))):
        kwargs = dict(max_new_tokens=15, do_sample=False, eos_token_id=int(free[eos_at]), pad_token_id=0, **floor)
        reference = verifier.generate(ids, **kwargs)
        spec = dict(draft_cache="int4") if mode == "int4" else dict(draft_cache=mode, kv_budget=16)
        out = verifier.generate(ids, assistant_model=drafter, num_assistant_tokens=3, **spec, **kwargs)
        assert torch.equal(out, reference), floor
        assert static_engine.current_engine(verifier).spec.mode == mode  # served by the static loop


def test_a_model_dispatched_over_several_devices_stays_on_the_static_loop(fresh_engines):
    """A verifier spread by ``device_map`` (several devices in its ``hf_device_map``) keeps the static loop, its caches
    placed by each layer's parameters (here all on the CPU; two GPUs: tests/test_multi_gpu.py)."""
    verifier, drafter = copy.deepcopy(tiny_model("llama")), tiny_model("llama", role="drafter")
    ids = prompt(40, seed=8)
    reference = verifier.generate(ids, max_new_tokens=12, do_sample=False)
    verifier.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": 1}
    out = verifier.generate(ids, assistant_model=drafter, kv_budget=16, max_new_tokens=12, do_sample=False)
    engine = static_engine.current_engine(verifier)
    assert torch.equal(out, reference) and engine is not None
    assert engine.verifier_cache.layer_devices == [torch.device("cpu")] * 2


def _post_grad_recorder(graphs: list):
    """A torch.compile backend that traces like Inductor (AOT autograd with Inductor's decompositions, input mutations
    kept in the graph) and runs Inductor's post-grad passes, reinplacing included, then runs that graph eagerly; each
    graph is appended to ``graphs``. What it records is what Inductor generates kernels from."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.post_grad import post_grad_passes
    from torch._inductor.virtualized import V

    def inference(gm, example_inputs):
        with V.set_fake_mode(detect_fake_mode(example_inputs)):
            post_grad_passes(gm, is_inference=True)
        graphs.append(gm.graph)
        return gm

    return aot_autograd(fw_compiler=inference, decompositions=select_decomp_table(), keep_inference_input_mutations=True)


_IN_PLACE = ("index_put_", "_unsafe_index_put_", "_inplace_generalized_scatter")
_VIEWS = ("view", "_unsafe_view", "slice", "select", "unsqueeze", "expand", "permute", "transpose", "t", "as_strided",
          "alias", "squeeze")


def _op_name(node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def _written_base(node):
    """The tensor an in-place op (chain) writes into: ``index_put_(index_put_(x, ...), ...)`` -> ``x``."""
    while node.op == "call_function" and _op_name(node) in _IN_PLACE:
        node = node.args[0]
    return node


def _sizes(value: torch.Tensor) -> tuple[int, ...]:
    """``value``'s shape, a symbolic size (a compiled prefill's dynamic shapes) as the size it was traced with."""
    return tuple(d.node.hint if isinstance(d, torch.SymInt) else d for d in value.shape)


def _buffer_copies(graph, buffer_shapes: set) -> list[str]:
    """Nodes of a post-grad ``graph`` that produce a new tensor shaped like one of the preallocated buffers (a copy of
    the buffer, or an out-of-place write into it), or copy such a tensor back into a graph input. A ``copy_`` of an
    input into itself (the epilogue after in-place writes; Inductor lowers it to nothing) is not one."""
    found = []
    for node in graph.nodes:
        value = node.meta.get("val")
        if node.op != "call_function" or not isinstance(value, torch.Tensor) or _sizes(value) not in buffer_shapes:
            continue
        name = _op_name(node)
        if name == "copy_" and _written_base(node.args[1]) is node.args[0]:
            continue
        if name not in _IN_PLACE + _VIEWS:
            found.append(f"{node.target}{tuple(value.shape)}")
    return found


@pytest.mark.compiled
@pytest.mark.parametrize("mode,batch,warpers,steps,tree", [
    ("full", 1, False, ("ar_step", "verify"), None), ("chunk", 2, False, ("draft", "catch_up"), None),
    ("int4", 1, False, ("draft", "verify"), None), ("window", 1, True, ("draft", "verify_tree"), 8),
    pytest.param("window", 1, True, ("draft", "verify"), None, marks=pytest.mark.extended, id="window-chain"),
    pytest.param("chunk", 2, False, ("draft", "verify_tree"), 8, marks=pytest.mark.extended, id="chunk-tree-batch"),
])
def test_compiled_steps_write_caches_in_place(fresh_engines, monkeypatch, mode, batch, warpers, steps, tree):
    """No compiled step copies a preallocated buffer: a step's write of its tokens into the key/value buffers, the
    slot positions, the token sequence and the draft probabilities (and a tree round's kept path moved within the
    buffers, its drafter's tree block) stays in place after Inductor's passes (a
    ``scatter_`` on the buffers compiled to a whole-buffer copy per layer and token). The post-grad graph is what
    Inductor generates its kernels from, so a buffer-shaped result there is a buffer-sized kernel on the GPU."""
    from hf_sparsekv.generation import graph_steps

    graphs = []
    monkeypatch.setenv("HF_SPARSEKV_COMPILE", "1")
    monkeypatch.setattr(graph_steps, "COMPILE_BACKEND", _post_grad_recorder(graphs))
    # a backend of this test's own: dynamo would replay a prefill another test compiled with the same backend
    monkeypatch.setattr(graph_steps, "compiled_prefill",
                        graph_steps.compile_prefill(lambda gm, inputs: graph_steps.prefill_backend(gm, inputs)))
    verifier = tiny_model("llama", layers=1)
    drafter = verifier if mode == "int4" else tiny_model("llama", role="drafter")
    sampling = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(8)] if warpers else None
    # (a window wider than the prompts: a longer prompt's prefill feeds exactly the ring's positions, as many as the
    # ring's slots, and the compiler then gives its keys the buffers' symbolic length: their rotary embedding would
    # look like a copy of a buffer here)
    budget = {"int4": 32, "window": 128}.get(mode, 16)
    engine = static_engine.engine_for(verifier, drafter, mode, budget, 2, 300, 40, use_graphs=False,
                                   warpers=sampling, batch=batch, tree_size=tree)
    assert engine.compiled
    with torch.no_grad(), graph_steps.static_attention_for(verifier, drafter):
        engine.prefill([prompt(90 - 7 * row, seed=row) for row in range(batch)])
        for name in steps:
            engine.run_step(name)
    caches = {id(c): c for c in (engine.verifier_cache, engine.drafter_cache)}.values()
    shapes = {tuple(t.shape) for c in caches for layer in c.layers for t in (layer.keys, layer.values)}
    shapes |= {tuple(c.slot_positions.shape) for c in caches} | {tuple(engine.seq.shape)}
    if warpers:
        shapes.add(tuple(engine.q.shape))
    prefills = sum(c.compiles_prefill and c.batch == 1 for c in caches)  # a one-row full cache's prefill compiles
    assert len(graphs) == len(steps) + prefills
    for graph in graphs:
        assert _buffer_copies(graph, shapes) == [], "\n".join(_buffer_copies(graph, shapes))


@pytest.mark.parametrize("self_drafting", [False, True], ids=["drafter", "self"])
@pytest.mark.parametrize("make", [
    pytest.param(lambda: ChunkBudgetCache(24, chunk_size=4, selection="cumulative"), id="chunk-cumulative-s4"),
    pytest.param(lambda: ChunkBudgetCache(32), id="chunk-default"),
    pytest.param(lambda: ChunkBudgetCache(32, generated_window=12), id="chunk-generated-window"),
    pytest.param(lambda: SinkWindowCache(sink=2, window=20), id="window-2-20"),
])
def test_draft_cache_instances_configure_the_static_cache(make, self_drafting, fresh_engines):
    """A ChunkBudgetCache / SinkWindowCache instance as draft_cache runs on the static loop with its own settings
    (chunk size and selection; sink and window), lossless; a chunk cache keeps the prompt tokens the dynamic cache
    keeps under stock generate() (the same keys, stored after RoPE at their real positions)."""
    verifier = tiny_model("llama")
    drafter = verifier if self_drafting else tiny_model("llama", role="drafter")
    ids = prompt(90, seed=12)
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0, num_assistant_tokens=3)
    out = verifier.generate(ids, assistant_model=drafter, draft_cache=make(), **kwargs)
    reference = verifier.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, reference)
    template = make()
    cache = static_engine.current_engine(verifier).drafter_cache
    if isinstance(template, SinkWindowCache):
        assert isinstance(cache, StaticSinkWindowCache) and (cache.sink, cache.window) == (2, 20)
        return
    bounded = template.generated_window is not None
    assert isinstance(cache, StaticChunkWindowCache if bounded else StaticChunkBudgetCache)
    assert (cache.budget, cache.chunk_size, cache.selection) == (template.budget, template.chunk_size,
                                                                template.selection)
    if bounded:  # the kept chunks, then a ring of the generated window: bounded whatever the generation's length
        assert cache.window == 12 and cache.capacity == 32 + 12 + (3 + 1) + 1  # rollback: γ + 1
    drafter.generate(ids, past_key_values=template, max_new_tokens=1, do_sample=False)  # stock, the dynamic cache
    k = cache.kept[0]
    assert k == template.layers[0].prefix_stored < ids.shape[1]  # the same number of kept prompt tokens, and the same
    torch.testing.assert_close(cache.layers[0].keys[0, :, :k], template.layers[0].keys[0, :, :k])  # tokens


def test_draft_cache_instances_every_kind_on_the_engine():
    """A plain DynamicCache as draft_cache is the drafter's full cache; a per-KV-head chunk selection and a separate
    drafter's HierarchicalQuantCache configure their static caches. All lossless; another Cache class is refused
    naming draft_cache."""
    verifier, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    ids = prompt(60, seed=13)
    reference = verifier.generate(ids, max_new_tokens=16, do_sample=False)
    for cache, kind in ((ChunkBudgetCache(32, per_kv_head=True), StaticChunkBudgetCache),
                        (DynamicCache(), StaticFullCache), (HierarchicalQuantCache(group_size=16), StaticQuantCache)):
        out = verifier.generate(ids, assistant_model=drafter, draft_cache=cache, max_new_tokens=16, do_sample=False)
        engine = static_engine.current_engine(verifier)
        assert torch.equal(out, reference) and isinstance(engine.drafter_cache, kind), type(cache)
        static_engine.release_engines()
    with pytest.raises(NotImplementedError, match="draft_cache"):
        verifier.generate(ids, assistant_model=drafter, draft_cache=StaticCache(config=drafter.config, max_cache_len=99),
                          max_new_tokens=4)


def test_chunk_window_cache_shows_the_kept_prompt_and_the_last_generated_tokens():
    """StaticChunkWindowCache, driven step by step with rollbacks: a query at p sees every kept prompt token and the
    generated positions p - W .. p (its own included), whatever was written past p before (exact rollback)."""
    budget, window, rollback, prompt_len = 16, 6, 3, 10
    cache = StaticChunkWindowCache(budget, window, rollback, 1, 1, 4, torch.float64, "cpu", chunk_size=4)
    layer = cache.layers[0]

    def marked(positions):  # keys carrying their real position, to read back what a query sees
        return torch.tensor(positions, dtype=torch.float64)[None, None, :, None].expand(1, 1, -1, 4)

    cache.begin_prefill(prompt_len, 0)
    cache.write(layer, marked(range(prompt_len)), marked(range(prompt_len)))
    cache.end_prefill()
    schedule = list(range(prompt_len, prompt_len + 30))
    schedule[12:12] = [prompt_len + 9, prompt_len + 10]  # roll back 3 tokens and rewrite them
    for p in schedule:
        cache.begin_step(torch.tensor([[p]]))
        cache.write(layer, marked([p]), marked([p]))
        seen = cache.visible(cache.positions)[0, 0].nonzero().flatten()
        real = sorted(int(x) for x in layer.keys[0, 0, seen, 0])
        want = list(range(prompt_len)) + [q for q in range(max(prompt_len, p - window), p + 1)]
        assert real == want, p
    assert cache.capacity == budget + window + rollback + 1


def test_bounded_chunk_cache_batch_rows_equal_each_prompt_alone(fresh_engines):
    """ChunkBudgetCache(generated_window=...) on a left-padded batch (one engine row per prompt, each with its own
    prompt length and offset): every row is its prompt's greedy output alone."""
    verifier, drafter = tiny_model("qwen2"), tiny_model("qwen2", role="drafter")
    prompts = [prompt(n, 50 + n) for n in (70, 9, 33)]
    ids, mask = left_padded(prompts)
    width = ids.shape[1]
    kwargs = dict(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = verifier.generate(ids, attention_mask=mask, assistant_model=drafter, num_assistant_tokens=4,
                            draft_cache=ChunkBudgetCache(16, generated_window=8), **kwargs)
    engine = static_engine.current_engine(verifier)
    assert isinstance(engine.drafter_cache, StaticChunkWindowCache) and engine.spec.batch == 3
    for b, p in enumerate(prompts):
        assert torch.equal(out[b, width:], verifier.generate(p, **kwargs)[0, p.shape[1]:]), b


def _attention_shape(model) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a tiny model, as the static caches take them."""
    config = model.config
    return config.num_hidden_layers, config.num_key_value_heads, config.hidden_size // config.num_attention_heads


def _full_cache(model) -> StaticFullCache:
    return StaticFullCache(*_attention_shape(model), 320, model.dtype, "cpu")


def _recorded_prefill(monkeypatch) -> list:
    """The compiled prefill traced by dynamo and run as traced (no compiler), under a backend of the test's own;
    returns the list its graphs are appended to."""
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(graph_steps, "compiled_prefill", graph_steps.compile_prefill(backend))
    return graphs


def _prefilled(model, ids: torch.Tensor, compiled: bool, prefix: int = 0, cache=None,
               kept_only: bool = False) -> list[torch.Tensor]:
    """``ids [1, P]`` prefilled into ``cache`` (default: a fresh one-row full cache of ``model``; ``prefix``: its
    first tokens loaded from a ``DynamicCache`` first) through
    :func:`~hf_sparsekv.generation.graph_steps.static_prefill` (``kept_only`` passed on): the logits, slot
    positions, length, a chunk layout's offset and kept count, and every layer's keys and values."""
    cache = _full_cache(model) if cache is None else cache
    start = 0
    with torch.no_grad():
        if prefix:
            held = DynamicCache()
            model(ids[:, :prefix], past_key_values=held, use_cache=True)
            start = cache.load_prefix([(layer.keys, layer.values) for layer in held.layers])
    with torch.no_grad(), graph_steps.static_attention_for(model):
        logits = graph_steps.static_prefill(model, ids, cache, start=start, compiled=compiled, kept_only=kept_only)
    chunks = [cache.offset, torch.tensor(cache.kept)] if hasattr(cache, "kept") else []
    return [logits, cache.slot_positions, cache.fp_length] + chunks + [t for layer in cache.layers
                                                                       for t in (layer.keys, layer.values)]


@pytest.mark.compiled
@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_prefill_fills_the_cache_as_the_eager_one_compiled_once_for_every_length(arch, monkeypatch):
    """A one-row full cache's prefill through the compiled forward (dynamo's trace with dynamic shapes, run by
    aot_eager: PyTorch's own kernels) returns the eager forward's logits and leaves the same keys, values, slot
    positions and length in the cache, for prompts of every length (Mistral's 300 past its sliding window of 256)
    and after a loaded prefix; one compilation serves every length, another the prefills after a prefix (and
    Mistral's prompts past its window a third)."""
    graphs = _recorded_prefill(monkeypatch)
    model = tiny_model(arch)

    for length, prefix in ((37, 0), (90, 0), (300, 0), (23, 0), (120, 40), (61, 20)):
        ids = prompt(length, seed=length)
        eager, compiled = _prefilled(model, ids, False, prefix), _prefilled(model, ids, True, prefix)
        for a, b in zip(eager, compiled):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert len(graphs) == 2 + (arch == "mistral")  # (and Mistral's prompts within / past its window)


@pytest.mark.compiled
@pytest.mark.parametrize("arch,layout,selection", [
    ("llama", "chunk", ChunkSelection()),
    pytest.param("qwen2", "chunk", ChunkSelection(method="cumulative"), marks=pytest.mark.extended, id="cumulative"),
    ("mistral", "chunk", ChunkSelection(per_kv_head=True, observe=24, pool=3)),
    ("llama", "chunk-window", ChunkSelection(recent=12, sink=5)), ("qwen2", "window", None),
])
def test_a_drafter_cache_prefill_compiles_once_for_every_length_and_keeps_what_the_eager_one_keeps(
        arch, layout, selection, monkeypatch):
    """A chunk layout's or a sink+window ring's prefill through the compiled forward (dynamic shapes, aot_eager)
    keeps the same prompt tokens as the eager one: the same logits, keys, values, slot positions, length (and a chunk
    layout's offset and kept count), for prompts within the budget (the ring: within its sinks) and past it (with and
    without a partial trailing chunk; Mistral's past its sliding window). The chunk selection runs behind one opaque
    op, so one graph serves the short prompts and one the long ones (a third Mistral's past its window), whatever
    their lengths."""
    graphs = _recorded_prefill(monkeypatch)
    model = tiny_model(arch)
    shape = _attention_shape(model)

    def cache():
        if layout == "chunk":
            return StaticChunkBudgetCache(48, *shape, 80, model.dtype, "cpu", chunk_size=8, selection=selection)
        if layout == "chunk-window":
            return StaticChunkWindowCache(48, 16, 4, *shape, model.dtype, "cpu", chunk_size=8, selection=selection)
        return StaticSinkWindowCache(4, 24, 4, *shape, model.dtype, "cpu")

    for length in (30, 44, 97, 160, 203, 300, 121) if selection else (3, 30, 44, 97, 300, 121):
        ids = prompt(length, seed=length)
        eager, compiled = _prefilled(model, ids, False, cache=cache()), _prefilled(model, ids, True, cache=cache())
        for a, b in zip(eager, compiled):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        if selection:  # past the budget, chunks were dropped
            assert (int(eager[4]) < length) == (length > 48)
    assert len(graphs) == 2 + (arch == "mistral")


@pytest.mark.parametrize("arch,sliding", [("llama", None), ("qwen2", None), ("mistral", 20)])
def test_a_ring_prefill_of_the_kept_positions_alone_holds_what_a_forward_of_those_tokens_computes(arch, sliding):
    """``kept_only``: a sink + window ring's prefill of a prompt longer than its sinks and ring feeds only those
    positions. Each layer then holds, in their slots, the keys and values that a plain forward of those tokens alone
    at their own positions computes (transformers' SDPA with an explicit mask from the positions: causal, and past
    Mistral's sliding window of 20 nothing), and the last logits agree. A prompt within the ring feeds every token,
    as a prefill without ``kept_only`` does."""
    model = copy.deepcopy(tiny_model(arch, "drafter", layers=2))
    model.config.sliding_window = sliding
    shape = _attention_shape(model)
    for length in (19, 33, 34, 100):
        ids = prompt(length, seed=length)
        cache = StaticSinkWindowCache(4, 24, 4, *shape, model.dtype, "cpu")  # a ring of 29 slots after 4 sinks
        logits, slot_positions, *_ = _prefilled(model, ids, False, cache=cache, kept_only=True)
        kept = torch.cat([torch.arange(4), torch.arange(max(4, length - 29), length)])
        q, k = kept[:, None], kept[None, :]
        mask = (k <= q) & (k > q - (sliding or 1 << 30))
        held = DynamicCache()
        with torch.no_grad():
            reference = model(ids[:, kept], position_ids=kept[None], attention_mask=mask[None, None],
                              past_key_values=held, use_cache=True).logits[0, -1]
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-10)
        slots = cache.slots_of(kept)
        assert torch.equal(slot_positions[0, slots], kept) and int((slot_positions[0] >= 0).sum()) == len(kept)
        for layer, (keys, values) in zip(cache.layers, ((l.keys, l.values) for l in held.layers)):
            torch.testing.assert_close(layer.keys[0][:, slots], keys[0], rtol=0, atol=1e-10)
            torch.testing.assert_close(layer.values[0][:, slots], values[0], rtol=0, atol=1e-10)
        if length <= 33:  # within sinks + ring: the prefill of every token
            whole = _prefilled(model, ids, False, cache=StaticSinkWindowCache(4, 24, 4, *shape, model.dtype, "cpu"))
            for a, b in zip(whole, [logits, slot_positions, *_]):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_window_drafter_reads_only_the_positions_it_keeps_and_decodes_as_greedy(arch):
    """On the engine a separate drafter's sink + window prefill reads a long prompt's kept positions alone
    (``drafter_prefill_tokens``: the sinks and the ring), a short one whole; the output is stock greedy's."""
    verifier, drafter = tiny_model(arch), tiny_model(arch, "drafter")
    for length in (9, 90, 200):
        ids = prompt(length, seed=length)
        out = verifier.generate(ids, assistant_model=drafter, draft_cache="window", kv_budget=16,
                                num_assistant_tokens=3, num_assistant_tokens_schedule="constant", max_new_tokens=24,
                                do_sample=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, stock_generate(verifier, ids, max_new_tokens=24, do_sample=False)), length
        cache = static_engine.current_engine(verifier).drafter_cache
        assert isinstance(cache, StaticSinkWindowCache)
        assert out.spec_stats.drafter_prefill_tokens == min(length, cache.sink + cache.ring) < 90, length
        assert out.spec_stats.drafted > 0


@pytest.mark.compiled
def test_a_compiled_ring_prefill_of_the_kept_positions_keeps_what_the_eager_one_keeps(monkeypatch):
    """The ``kept_only`` ring prefill through the compiled forward keeps what the eager one keeps (logits, keys,
    values, slot positions), prompts within the ring and past it, all through one graph."""
    graphs = _recorded_prefill(monkeypatch)
    model = tiny_model("qwen2", "drafter")
    shape = _attention_shape(model)
    for length in (20, 97, 300, 121):
        ids = prompt(length, seed=length)
        eager, compiled = (_prefilled(model, ids, c, cache=StaticSinkWindowCache(4, 24, 4, *shape, model.dtype, "cpu"),
                                      kept_only=True) for c in (False, True))
        for a, b in zip(eager, compiled):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert len(graphs) == 1


def test_a_full_cache_prefill_feeds_every_position_with_or_without_a_prefix():
    model = tiny_model("llama", "drafter")
    cache = StaticFullCache(*_attention_shape(model), 64, model.dtype, "cpu")
    assert cache.kept_prompt_positions(50) is None  # (a full cache keeps every position)
    cache.begin_prefill(10, 0, 5, kept_only=True)
    assert cache.prefill_fed is None


def _quant_state(cache: StaticQuantCache) -> list[torch.Tensor]:
    """What a quantized store holds: T_q (host and device), slot positions, buffer length, and every layer's codes,
    scales, zero points and full-precision buffer."""
    held = [torch.tensor(cache.quantized), cache.offset, cache.quant_length, cache.slot_positions, cache.fp_length]
    for layer in cache.layers:
        held += [layer.keys, layer.values] + [getattr(q, part) for q in (layer.qkeys, layer.qvalues)
                                              for part in ("upper", "lower", "scale", "zero")]
    return held


@pytest.mark.compiled
@pytest.mark.parametrize("arch", ARCHS)
def test_a_quantized_store_prefill_compiles_once_for_every_length_and_stores_what_the_eager_one_stores(
        arch, monkeypatch):
    """The quantized store's prefill through the compiled forward (dynamic shapes, aot_eager): the quantization
    and buffer writes run behind one opaque op a layer, T_q set on the host, so one graph serves prompts of every
    length (within the first 2G, which quantize nothing, and past it, at and between group boundaries; Mistral's
    past its sliding window a second); the logits, codes, scales, zero points, buffer, slot positions and T_q are the
    eager prefill's."""
    graphs = _recorded_prefill(monkeypatch)
    model = tiny_model(arch)
    shape = _attention_shape(model)
    for length in (23, 31, 32, 48, 97, 300, 121):
        ids = prompt(length, seed=length)
        filled = []
        for compiled in (False, True):
            cache = StaticQuantCache(16, 320, 4, *shape, model.dtype, "cpu")
            with torch.no_grad(), graph_steps.static_attention_for(model):
                logits = graph_steps.static_prefill(model, ids, cache, compiled=compiled)
            filled.append([logits] + _quant_state(cache))
        for a, b in zip(*filled):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        assert int(filled[0][1]) == 16 * max(0, length // 16 - 1)  # (T_q as the store defines it)
    assert len(graphs) == 1 + (arch == "mistral")


def test_the_quantized_prompt_op_declares_what_it_writes():
    """``hf_sparsekv::store_quantized_prompt`` writes only the buffers it declares (``torch.library.opcheck``: schema
    and fake-tensor registration), and fills one layer of a store as the reference quantizer does: T_q codes, the rest
    in the buffer from slot 0."""
    from hf_sparsekv.caches.prefill_quantize import store_quantized_prompt
    from hf_sparsekv.kernels.quant_reference import quantize_keys, quantize_values

    gen = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(1, 2, 53, 8, generator=gen) for _ in range(2))
    store = StaticQuantCache(16, 64, 4, 1, 2, 8, torch.float32, "cpu", batch=2)
    layer = store.layers[0]
    args = (keys, values, layer.keys, layer.values, *(getattr(q, part) for q in (layer.qkeys, layer.qvalues)
                                                      for part in ("upper", "lower", "scale", "zero")), 1, 16)
    torch.library.opcheck(store_quantized_prompt, args, test_utils=("test_schema", "test_faketensor"))
    store_quantized_prompt(*args)
    t = 32  # 16 * (53 // 16 - 1)
    k, v = quantize_keys(keys[:, :, :t], 16), quantize_values(values[:, :, :t])
    for ours, theirs in ((layer.qkeys, k), (layer.qvalues, v)):
        for part in ("upper", "lower", "scale", "zero"):
            held = getattr(ours, part)[1, :, : getattr(theirs, part).shape[2]]
            assert torch.equal(held, getattr(theirs, part)[0]), part
    assert torch.equal(layer.keys[1, :, : 53 - t], keys[0, :, t:])
    assert torch.equal(layer.values[1, :, : 53 - t], values[0, :, t:])
    assert not layer.keys[0].any()  # (the other row untouched)


@pytest.mark.compiled
@pytest.mark.extended  # (29 s of CPU; the quantized store's compiled prefill alone: the tests above)
def test_int4_self_speculation_compiles_its_prefill_and_decodes_as_after_the_eager_one(compiled_steps, monkeypatch):
    """int4 self-speculation under a compiled engine: its quantized store's prefill runs through the compiled forward
    (one graph for two prompt lengths) and the call returns the tokens it returns after an eager prefill
    (``HF_SPARSEKV_PREFILL_COMPILE=0``); part of each prompt is quantized (T_q > 0)."""
    verifier = tiny_model("llama")
    kwargs = dict(assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=16), num_assistant_tokens=3,
                  num_assistant_tokens_schedule="constant", max_new_tokens=20, do_sample=False)
    prompts = [prompt(70, seed=5), prompt(93, seed=6)]
    monkeypatch.setenv("HF_SPARSEKV_PREFILL_COMPILE", "0")
    eager = [verifier.generate(ids, **kwargs) for ids in prompts]
    monkeypatch.setenv("HF_SPARSEKV_PREFILL_COMPILE", "1")
    graphs = _recorded_prefill(monkeypatch)
    static_engine.release_engines()
    for ids, expected in zip(prompts, eager):
        assert torch.equal(verifier.generate(ids, **kwargs), expected)
        assert static_engine.current_engine(verifier).verifier_cache.quantized[0] > 0
    assert len(graphs) == 1


def test_only_a_one_row_cache_filling_nothing_else_compiles_its_prefill(monkeypatch):
    full = StaticFullCache(1, 1, 4, 8, torch.float32, "cpu")
    assert graph_steps.prefill_compiles(full)
    assert not graph_steps.prefill_compiles(StaticFullCache(1, 1, 4, 8, torch.float32, "cpu", batch=2))
    assert graph_steps.prefill_compiles(StaticChunkBudgetCache(8, 1, 1, 4, 16, torch.float32, "cpu"))
    assert graph_steps.prefill_compiles(StaticSinkWindowCache(2, 8, 3, 1, 1, 4, torch.float32, "cpu"))
    assert graph_steps.prefill_compiles(StaticQuantCache(8, 16, 4, 1, 1, 8, torch.float32, "cpu"))
    full.companion = StaticFullCache(1, 1, 4, 8, torch.float32, "cpu")  # a self-drafting prefill fills both
    assert not graph_steps.prefill_compiles(full)
    full.companion = None
    monkeypatch.setenv("HF_SPARSEKV_PREFILL_COMPILE", "0")
    assert not graph_steps.prefill_compiles(full)
    monkeypatch.setenv("HF_SPARSEKV_PREFILL_COMPILE", "yes")
    with pytest.raises(ValueError, match="HF_SPARSEKV_PREFILL_COMPILE"):
        graph_steps.prefill_compiles(full)


@pytest.mark.compiled
@pytest.mark.parametrize("draft_cache", [pytest.param("full", marks=pytest.mark.extended), "chunk", "window", "int4"])
def test_a_compiled_engine_compiles_the_prefill_of_small_models_only(compiled_steps, monkeypatch, draft_cache):
    """Under a compiled engine the verifier's and a drafter's prefills (its full, chunk, ring or quantized cache) go
    through the compiled forward
    while their decoder layers hold fewer than PREFILL_MAX_LAYER_ELEMENTS weights, and stay eager from there on;
    the tokens are stock greedy's either way."""
    from hf_sparsekv.generation import draft_weights

    verifier, drafter = tiny_model("qwen2"), tiny_model("qwen2", role="drafter")
    per_layer = draft_weights.layer_elements(verifier)
    assert draft_weights.layer_elements(drafter) < per_layer
    ids = prompt(40, seed=3)
    expected = stock_generate(verifier, ids, max_new_tokens=12, do_sample=False)
    fed = []

    def counted(model, *args):
        fed.append(model)
        return graph_steps.prefill_forward(model, *args)

    monkeypatch.setattr(graph_steps, "compiled_prefill", counted)
    for bound, compiled in [(per_layer + 1, [verifier, drafter]), (per_layer, [drafter]), (0, [])]:
        monkeypatch.setattr(graph_steps, "PREFILL_MAX_LAYER_ELEMENTS", bound)
        static_engine.release_engines()
        fed.clear()
        out = verifier.generate(ids, assistant_model=drafter, draft_cache=draft_cache, num_assistant_tokens=3,
                                num_assistant_tokens_schedule="constant", max_new_tokens=12, do_sample=False,
                                **({} if draft_cache in ("full", "int4") else {"kv_budget": 16}))
        assert torch.equal(out, expected)
        assert fed == compiled, bound


@pytest.mark.compiled
@pytest.mark.parametrize("layout", ["chunk", pytest.param("window", marks=pytest.mark.extended)])
def test_a_self_drafter_is_filled_after_a_compiled_prefill_as_the_shared_prefill_fills_it(compiled_steps, monkeypatch,
                                                                                          layout):
    """Self-drafting on a compiled engine: the verifier's prefill compiles and the drafter's cache is then filled from
    the verifier's keys/values and the kept prompt queries; it holds what the eager shared prefill (the companion
    written by the same forward) puts there, slot by slot, and the call is stock greedy with the same accepted
    drafts."""
    verifier = tiny_model("llama")
    ids = prompt(60, seed=9)
    kw = dict(assistant_model=verifier, draft_cache=layout, kv_budget=24, num_assistant_tokens=3,
              num_assistant_tokens_schedule="constant", max_new_tokens=20, do_sample=False,
              return_dict_in_generate=True)
    expected = stock_generate(verifier, ids, max_new_tokens=20, do_sample=False)
    filled, accepted = [], []
    for setting in ("1", "0"):
        monkeypatch.setenv("HF_SPARSEKV_PREFILL_COMPILE", setting)
        out = verifier.generate(ids, **kw)
        assert torch.equal(out.sequences, expected)
        accepted.append(out.spec_stats.accepted)
        engine = static_engine.current_engine(verifier)
        with torch.no_grad(), graph_steps.static_attention_for(verifier):
            engine.prefill([ids])
        cache = engine.drafter_cache
        filled.append([cache.slot_positions.clone(), cache.fp_length.clone(), getattr(cache, "offset", None)]
                      + [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)])
    assert accepted[0] == accepted[1] > 0
    for a, b in zip(*filled):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.compiled
def test_a_compiled_prefill_that_fails_warns_and_runs_eagerly_from_then_on(compiled_steps, monkeypatch):
    """Where the compiled prefill raises (a model the compiler does not take), the call warns once, prefills eagerly
    and is stock greedy; later prefills of that model do not try the compiled one again."""
    verifier = copy.deepcopy(tiny_model("llama"))
    ids = prompt(30, seed=4)
    tried = []

    def broken(*args):
        tried.append(1)
        raise RuntimeError("no such lowering")

    monkeypatch.setattr(graph_steps, "compiled_prefill", broken)
    kwargs = dict(max_new_tokens=8, do_sample=False)
    with pytest.warns(UserWarning, match="compiled prefill of LlamaForCausalLM failed .*no such lowering"):
        out = verifier.generate(ids, static_engine=True, **kwargs)
    assert torch.equal(out, stock_generate(verifier, ids, **kwargs)) and tried == [1]
    assert torch.equal(verifier.generate(ids, static_engine=True, **kwargs), out) and tried == [1]


@pytest.mark.compiled
def test_a_prefill_that_recompiles_for_new_lengths_goes_eager_after_a_few_graphs(monkeypatch):
    """A model whose compiled prefill compiles anew for each prompt length (here: compiled without dynamic shapes)
    warns once it has taken more than PREFILL_MAX_GRAPHS graphs and prefills eagerly from then on, each prefill
    filling the cache as the eager forward does."""
    monkeypatch.setattr(graph_steps, "compiled_prefill", torch.compile(
        graph_steps.prefill_forward, backend=lambda gm, inputs: graph_steps.prefill_backend(gm, inputs), dynamic=False))
    monkeypatch.setattr(graph_steps, "COMPILE_BACKEND", "aot_eager")
    model = tiny_model("qwen2")

    counts, most = [], graph_steps.PREFILL_MAX_GRAPHS
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        for length in range(20, 23 + most):
            ids = prompt(length, seed=length)
            if length == 20 + most:
                with pytest.warns(UserWarning, match=f"compiled {most + 1} graphs"):
                    compiled = _prefilled(model, ids, True)
            else:
                compiled = _prefilled(model, ids, True)
            counts.append(graph_steps._prefill_graphs[model])
            for a, b in zip(_prefilled(model, ids, False), compiled):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert counts == list(range(1, most + 2)) + [most + 1] * 2 and model in graph_steps._eager_prefills


@pytest.mark.parametrize("layout,selection", [
    ("chunk", ChunkSelection()), ("chunk", ChunkSelection(method="cumulative")),
    ("chunk", ChunkSelection(per_kv_head=True, observe=24, pool=3)),
    ("chunk-window", ChunkSelection(recent=12, sink=5)),
])
def test_the_layers_of_a_filled_prompt_selected_as_one_batch_keep_what_each_keeps_alone(monkeypatch, layout, selection):
    """``store_prompt_layers`` (a self-drafter's cache filled from the verifier's) selects consecutive layers together
    (here three a batch, and a layer of another scaling on its own): every layer's keys, values, slot positions and
    kept count equal those of :meth:`store_prompt` one layer at a time, with fewer selections; within the budget
    nothing is selected and the prompt is stored as it is."""
    from hf_sparsekv.caches import chunk_selection, static as static_caches

    layers, kv_heads, heads, head_dim = 7, 2, 4, 8
    monkeypatch.setattr(static_caches, "layers_a_batch", lambda device, logits: 3)
    calls = []
    real = static_caches.select_chunks
    monkeypatch.setattr(static_caches, "select_chunks", lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k))[1])

    def cache():
        if layout == "chunk":
            return StaticChunkBudgetCache(48, layers, kv_heads, head_dim, 80, torch.float32, "cpu", chunk_size=8,
                                          selection=selection, batch=2)
        return StaticChunkWindowCache(48, 16, 4, layers, kv_heads, head_dim, torch.float32, "cpu", chunk_size=8,
                                      selection=selection, batch=2)

    for length in (30, 97, 160, 203):
        g = torch.Generator().manual_seed(length)
        states = [(torch.randn(1, kv_heads, length, head_dim, generator=g),
                   torch.randn(1, kv_heads, length, head_dim, generator=g)) for _ in range(layers)]
        voting = chunk_selection.voting_queries(selection, length)
        queries = {i: (torch.randn(1, heads, voting, head_dim, generator=g), 0.3 if i != 4 else 0.2)
                   for i in range(layers)}
        alone, together = cache(), cache()
        for target in (alone, together):
            target.begin_prefill(length, row=1)
        for i, (keys, values) in enumerate(states):
            alone.store_prompt(i, keys, values, *queries[i])
        calls.clear()
        together.store_prompt_layers(states, queries)
        for target in (alone, together):
            target.end_prefill()
        assert calls == ([3, 1, 1, 2] if length > 48 else [])  # layers 0-2, 3, 4 (its own scaling), 5-6
        assert alone.kept == together.kept and (alone.kept[1] < length) == (length > 48)
        assert torch.equal(alone.slot_positions, together.slot_positions)
        assert torch.equal(alone.offset, together.offset)
        for a, b in zip(alone.layers, together.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
