"""What a user pays between warm calls: a longer prompt than any before grows the engine's caches (geometrically)
and captures its steps again without compiling them again; the steps are compiled with the caches' lengths as
dynamic dimensions. Counted with dynamo's counters, the steps compiled by torch.compile's tracing (aot_eager)."""

from __future__ import annotations

import copy
import gc
import threading
import weakref

import pytest
import torch
from torch._dynamo.utils import counters

from hf_sparsekv.generation import engine as static_engine

from .conftest import assert_drafter_holds, prompt, tiny_model

LENGTHS = (60, 300, 700, 120, 900)  # each of the first three outgrows the engine before it


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("call", [dict(static_engine=True), dict(kv_budget=16),
                                  pytest.param(dict(draft_cache="int4"), marks=pytest.mark.extended, id="int4")],
                         ids=["ar", "chunk", "int4"])  # (int4: 27 s of CPU; its compiled steps: test_static.py)
def test_longer_prompts_compile_nothing_again(compiled_steps, call):
    """After a configuration's first call, prompts of other lengths (longer than any before included) compile no
    graph: no step, no prefill; every call's tokens are stock greedy's (int4: greedy on the same quantized cache is
    the engine's own AR, checked elsewhere; here the first call's tokens against stock greedy where they agree)."""
    model = copy.deepcopy(tiny_model("llama"))
    spec = dict(call)
    if "static_engine" not in spec:
        spec["assistant_model"] = model
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0, num_assistant_tokens=3)
    if "static_engine" in spec:
        del kwargs["num_assistant_tokens"]
    before, capacities = None, []
    for n in LENGTHS:
        ids = prompt(n, seed=n)
        out = model.generate(ids, **spec, **kwargs)
        if call.get("draft_cache") != "int4":
            assert torch.equal(out, model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None,
                                                   pad_token_id=0))
        if before is None:
            before = _graphs()
        capacities.append(static_engine.current_engine(model).max_tokens)
    assert _graphs() == before
    assert capacities[1] >= 2 * capacities[0] and capacities[2] >= 2 * capacities[1]  # grown geometrically
    assert len(static_engine._engines[model]) == 1  # a grown engine supersedes the shorter one


def test_a_separate_drafters_light_steps_recompile_once_at_most_over_longer_prompts(compiled_steps, monkeypatch):
    """A separate drafter, steps traced light (one decoder layer for all): over prompts of growing and shrinking
    lengths after the first call, one call at most compiles graphs (the first growth: a trace that guarded on the
    capacity is traced again with it dynamic), and no later growth compiles any; the tokens are stock greedy's."""
    monkeypatch.setenv("HF_SPARSEKV_COMPILE", "light")
    model = copy.deepcopy(tiny_model("llama"))
    drafter = tiny_model("llama", role="drafter")
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    compiled, capacities = [], []
    for n in LENGTHS:
        ids = prompt(n, seed=n)
        before = _graphs()
        out = model.generate(ids, assistant_model=drafter, **kwargs)
        compiled.append(_graphs() - before)
        capacities.append(static_engine.current_engine(model).max_tokens)
        assert torch.equal(out, model.generate(ids, **kwargs))
    assert compiled[0] > 0 and sum(1 for c in compiled[1:] if c) <= 1, compiled
    assert compiled[2] == 0 and capacities[2] > capacities[1] > capacities[0]  # the second growth: nothing


def test_alternating_configurations_compile_and_build_nothing_after_the_first_round(compiled_steps):
    """Plain decoding, a separate drafter on the full cache, a chunk budget, prompt lookup and sampling, called in
    turn on one model: once each was seen (the second round also compiles the prefill that continues a held
    sequence), another round compiles no graph and builds no engine (each configuration keeps its engine); greedy
    calls' tokens are stock greedy's."""
    model = copy.deepcopy(tiny_model("llama"))
    drafter = tiny_model("llama", role="drafter")
    common = dict(max_new_tokens=8, eos_token_id=None, pad_token_id=0, num_assistant_tokens=3,
                  num_assistant_tokens_schedule="constant")
    configurations = [dict(static_engine=True), dict(assistant_model=drafter), dict(assistant_model=drafter,
                      kv_budget=16), dict(prompt_lookup_num_tokens=3), dict(static_engine=True, do_sample=True)]
    ids = prompt(120, seed=5)
    reference = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    engines = []
    for round_ in range(3):  # (the same prompt: from the second round on, each prefill continues a held sequence)
        if round_ == 2:
            graphs = _graphs()
        for config in configurations:
            out = model.generate(ids, **{"do_sample": False, **config}, **common)
            if not config.get("do_sample"):
                assert torch.equal(out, reference), config
            engines.append(static_engine.current_engine(model))
    n = len(configurations)
    assert _graphs() == graphs
    assert len({id(e) for e in engines[:n]}) == n and engines[n:] == 2 * engines[:n]  # each kept, and reused


def test_an_engine_grows_geometrically_within_the_models_positions(fresh_engines):
    model = copy.deepcopy(tiny_model("llama"))  # max_position_embeddings 1024
    kwargs = dict(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0, static_engine=True)
    model.generate(prompt(300, 0), **kwargs)
    first = static_engine.current_engine(model).max_tokens
    model.generate(prompt(first, 1), **kwargs)  # just past it
    assert static_engine.current_engine(model).max_tokens == 1024  # doubled, capped by max_position_embeddings
    model.generate(prompt(1100, 2), **kwargs)  # past the model's positions: what the call needs
    assert static_engine.current_engine(model).max_tokens >= 1104


@pytest.mark.parametrize("call", [dict(static_engine=True), dict(kv_budget=16)], ids=["ar", "chunk"])
def test_a_superseded_engine_is_freed_without_a_cycle_collection(fresh_engines, call):
    """A grown engine frees the shorter one's caches at once (no step keeps it alive through a reference cycle):
    the captures hold Python's cycle collector off instead of running it, 0.5-1 s each after compilations."""
    model = copy.deepcopy(tiny_model("llama"))
    spec = dict(call)
    if "static_engine" not in spec:
        spec["assistant_model"] = model
    kwargs = dict(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0, **spec)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        model.generate(prompt(60, 0), **kwargs)
        shorter = weakref.ref(static_engine.current_engine(model))
        model.generate(prompt(400, 1), **kwargs)
        assert static_engine.current_engine(model) is not shorter()
        assert shorter() is None
    finally:
        if was_enabled:
            gc.enable()


@pytest.fixture
def fresh_engines():
    static_engine.release_engines()
    yield
    static_engine.release_engines()


@pytest.fixture
def compiled_later(monkeypatch, fresh_engines):
    """Steps compiled as on CUDA by default (``HF_SPARSEKV_COMPILE`` "auto" there; "later" here, on CPU), traced as
    :func:`compiled_steps` traces them; due after ``HF_SPARSEKV_COMPILE_AFTER`` = 0 s: at the second call."""
    from hf_sparsekv.generation import graph_steps

    monkeypatch.setenv("HF_SPARSEKV_COMPILE", "later")
    monkeypatch.setenv("HF_SPARSEKV_COMPILE_AFTER", "0")
    monkeypatch.setattr(graph_steps, "COMPILE_BACKEND", "aot_eager")


@pytest.mark.parametrize("call", [dict(static_engine=True), dict(kv_budget=16, num_assistant_tokens=3)],
                         ids=["ar", "chunk"])
def test_steps_compile_once_uncompiled_calls_have_taken_long_enough(compiled_later, call):
    """A model's first calls run uncompiled steps and compile nothing; once their time passes
    ``HF_SPARSEKV_COMPILE_AFTER`` the next call compiles the steps (not the prefill), and later calls compile nothing
    more. (A constant γ: every call runs the same steps; the controller may run a step in a later call that the
    compiling call did not, which compiles on its first run.)
    Every call's tokens are stock greedy's (float32)."""
    model = copy.deepcopy(tiny_model("llama"))
    spec = dict(call)
    if "static_engine" not in spec:
        spec["assistant_model"] = model
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    graphs, compiled = [], []
    for n in (60, 90, 70):
        ids = prompt(n, seed=n)
        before = _graphs()
        out = model.generate(ids, **spec, **kwargs)
        assert torch.equal(out, model.generate(ids, **kwargs))
        graphs.append(_graphs() - before)
        engine = static_engine.current_engine(model)
        steps = [step.fn is not step.eager_fn for key, step in engine.steps.items()  # (a draft step's one-token
                 if "draft" not in (key if isinstance(key, tuple) else (key,))]  # forwards compile on their own)
        compiled.append((engine.compiled, bool(steps) and all(steps)))
    assert compiled == [(False, False), (True, True), (True, True)]  # (every step the call ran: compiled or not)
    assert graphs[0] == 0 and graphs[2] == 0  # (the second call's may come from dynamo's cache of an earlier test)
    assert not static_engine.current_engine(model).compiles_prefill  # (prefills compile only from the start)


@pytest.mark.parametrize("call", [dict(static_engine=True), dict(kv_budget=16, num_assistant_tokens=3)],
                         ids=["ar", "chunk"])
def test_steps_compile_light_first_then_fully(compiled_later, monkeypatch, call):
    """Two stages of the rule: past what tracing its steps light costs (here 0 s) a configuration's next call traces
    them through the light backend (our rewrites, no Inductor); past ``HF_SPARSEKV_COMPILE_AFTER``, the next call
    drops them and compiles them fully; a call after compiles nothing. Every call's tokens are stock greedy's
    (float32)."""
    from hf_sparsekv.generation import compile_policy, graph_steps

    backends = []
    for name in ("light_step_backend", "step_backend"):
        real = getattr(graph_steps, name)
        monkeypatch.setattr(graph_steps, name, lambda gm, inputs, real=real, name=name: (backends.append(name),
                                                                                          real(gm, inputs))[1])
    monkeypatch.setattr(compile_policy, "LIGHT_FIXED_S", 0.0)
    monkeypatch.setattr(compile_policy, "LIGHT_STEP_S", 0.0)
    monkeypatch.setenv("HF_SPARSEKV_COMPILE_AFTER", "3600")
    model = copy.deepcopy(tiny_model("llama"))
    spec = dict(call)
    if "static_engine" not in spec:
        spec["assistant_model"] = model
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    stages = []
    for n in (60, 90, 70, 80):
        if n == 90:  # (the charge at the end of a call decides the next call's stage)
            monkeypatch.setenv("HF_SPARSEKV_COMPILE_AFTER", "0")
        ids = prompt(n, seed=n)
        del backends[:]
        out = model.generate(ids, **spec, **kwargs)
        assert torch.equal(out, model.generate(ids, **kwargs))
        engine = static_engine.current_engine(model)
        stages.append((engine.compiled, engine.light, sorted(set(backends))))
    assert stages[0] == (False, False, [])
    assert stages[1][:2] == (True, True) and "step_backend" not in stages[1][2]
    assert stages[2][:2] == (True, False) and "light_step_backend" not in stages[2][2]
    assert stages[3] == (True, False, [])


def test_uncompiled_calls_are_charged_until_the_threshold(compiled_later, monkeypatch):
    """Below ``HF_SPARSEKV_COMPILE_AFTER`` nothing compiles; the charge is the model's, over its configurations."""
    from hf_sparsekv.generation import compile_policy

    monkeypatch.setenv("HF_SPARSEKV_COMPILE_AFTER", "3600")
    model = copy.deepcopy(tiny_model("llama"))
    kwargs = dict(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    before = _graphs()
    model.generate(prompt(50, 0), static_engine=True, **kwargs)
    first = compile_policy.charged(model)
    model.generate(prompt(50, 1), assistant_model=model, kv_budget=16, **kwargs)
    assert 0 < first < compile_policy.charged(model)
    assert _graphs() == before and not static_engine.current_engine(model).compiled
    monkeypatch.setenv("HF_SPARSEKV_COMPILE_AFTER", "x")
    with pytest.raises(ValueError, match="HF_SPARSEKV_COMPILE_AFTER"):
        model.generate(prompt(50, 2), static_engine=True, **kwargs)


def test_warmup_compiles_at_once(compiled_later, monkeypatch):
    import hf_sparsekv

    monkeypatch.setenv("HF_SPARSEKV_COMPILE_AFTER", "3600")
    model = copy.deepcopy(tiny_model("llama"))
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, static_engine=True)
    hf_sparsekv.warmup(model, max_length=128, max_new_tokens=8, **kwargs)
    assert static_engine.current_engine(model).compiled and static_engine.current_engine(model).compiles_prefill
    before = _graphs()
    ids = prompt(100, 3)
    assert torch.equal(model.generate(ids, max_new_tokens=8, **kwargs),
                       model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0))
    assert _graphs() == before


def test_warmup_pays_the_first_call_ahead(compiled_steps):
    """After ``hf_sparsekv.warmup`` for a configuration and a length, calls with prompts up to it compile nothing and
    build no engine; their tokens are stock greedy's."""
    import hf_sparsekv

    model = copy.deepcopy(tiny_model("llama"))
    drafter = tiny_model("llama", role="drafter")
    # (a fixed γ: on CPU the controller's other widths compile when first chosen; on CUDA the first call captures all)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, num_assistant_tokens=3,
                  num_assistant_tokens_schedule="constant")
    seconds = hf_sparsekv.warmup(model, max_length=600, max_new_tokens=16, assistant_model=drafter, kv_budget=16,
                                 **kwargs)
    assert seconds > 0
    engine, graphs = static_engine.current_engine(model), _graphs()
    for n in (100, 580):
        ids = prompt(n, seed=n)
        out = model.generate(ids, assistant_model=drafter, kv_budget=16, max_new_tokens=16, **kwargs)
        assert torch.equal(out, model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None,
                                               pad_token_id=0))
    assert static_engine.current_engine(model) is engine and _graphs() == graphs
    with pytest.raises(ValueError, match="max_length"):
        hf_sparsekv.warmup(model, max_length=16, max_new_tokens=16)


def test_the_compile_cache_follows_hf_home_unless_set_or_off(monkeypatch, tmp_path):
    from hf_sparsekv import compile_cache

    monkeypatch.delenv(compile_cache.INDUCTOR_ENV, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert compile_cache.configure() == str(tmp_path / "hf_sparsekv" / "torchinductor")
    monkeypatch.setenv(compile_cache.INDUCTOR_ENV, "/somewhere/else")
    assert compile_cache.configure() is None
    assert compile_cache.default_dir() == tmp_path / "hf_sparsekv" / "torchinductor"
    monkeypatch.delenv(compile_cache.INDUCTOR_ENV)
    monkeypatch.setenv(compile_cache.CACHE_ENV, "0")
    assert compile_cache.configure() is None and compile_cache.INDUCTOR_ENV not in __import__("os").environ
    monkeypatch.setenv(compile_cache.CACHE_ENV, "yes")
    with pytest.raises(ValueError, match=compile_cache.CACHE_ENV):
        compile_cache.configure()


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("call", [dict(static_engine=True), dict(kv_budget=16), dict(prompt_lookup_num_tokens=3),
                                  dict(assistant_model="self", kv_budget=16)], ids=["ar", "chunk", "lookup", "self"])
def test_a_chat_prefills_only_its_new_tokens(fresh_engines, arch, call):
    """Turns that append to the previous output (the multi-turn idiom): each turn's tokens are a fresh call's (stock
    greedy's), and the verifier's prefill reads only what the engine's cache does not hold (a self-drafter's shared
    prefill reads all); a turn that edits the history reuses the part before the edit; the returned cache passed back
    is not copied in again."""
    model = copy.deepcopy(tiny_model(arch))
    spec = dict(call)
    if "kv_budget" in spec:
        spec["assistant_model"] = model if spec.get("assistant_model") == "self" else tiny_model(arch, role="drafter")
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    history = prompt(80, seed=1)
    prefilled = []
    for turn in range(3):
        out = model.generate(history, return_dict_in_generate=True, **spec, **kwargs)
        assert torch.equal(out.sequences, model.generate(history, **kwargs)), turn
        prefilled.append(out.spec_stats.prefill_tokens)
        history = torch.cat([out.sequences, prompt(30, seed=10 + turn)], 1)
    if call.get("assistant_model") == "self":
        assert prefilled == [80, 80 + 42, 80 + 84]
    else:
        assert prefilled == [80, 31, 31]  # the new tokens and the last output token (never fed to the verifier)
    edited = history.clone()
    edited[0, 50] = (edited[0, 50] + 1) % 96
    out = model.generate(edited, return_dict_in_generate=True, **spec, **kwargs)
    assert torch.equal(out.sequences, model.generate(edited, **kwargs))
    if call.get("assistant_model") != "self":
        assert out.spec_stats.prefill_tokens == edited.shape[1] - 50


@pytest.mark.parametrize("schedule", ["constant", "controller"])
def test_a_chat_turn_prefills_only_the_new_tokens_of_a_separate_drafter_too(fresh_engines, schedule):
    """A separate drafter on its full cache (the mode of the routed ``assistant_model=`` call): a turn that appends to
    the previous output feeds the drafter's prefill only what its cache does not hold (with a constant γ, at most three
    tokens more than the verifier's prefill reads), what it holds is what a fresh forward keeps, and a drafter with
    the verifier's weights has every draft accepted. Tokens: stock greedy's (float64)."""
    model = copy.deepcopy(tiny_model("llama"))
    drafter = copy.deepcopy(model)  # a separate model with the verifier's weights: every correct draft is accepted
    spec = dict(assistant_model=drafter, draft_cache="full")  # (named: the output then carries spec_stats)
    if schedule == "constant":
        spec.update(num_assistant_tokens=4, num_assistant_tokens_schedule="constant")
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    history = prompt(80, seed=1)
    read = []
    for turn in range(3):  # (80 + 3 * 44 tokens: one engine holds them all)
        mask = torch.ones_like(history)  # (a generated 0 is a token, not padding)
        out = model.generate(history, attention_mask=mask, return_dict_in_generate=True, **spec, **kwargs)
        assert torch.equal(out.sequences, model.generate(history, attention_mask=mask, **kwargs)), turn
        stats = out.spec_stats
        assert stats.accepted == stats.drafted, (turn, stats.accepted, stats.drafted)
        engine = static_engine.current_engine(model)
        assert_drafter_holds(engine, drafter, out.sequences)
        read.append((history.shape[1], stats.prefill_tokens, stats.drafter_prefill_tokens, engine.drafter_holds))
        history = torch.cat([out.sequences, prompt(20, seed=10 + turn)], 1)
    assert read[0][:3] == (80, 80, 80) or (schedule == "controller" and read[0][2] == 0), read
    for (p, verifier_read, drafter_read, _), (*_, held) in zip(read[1:], read):  # what it held of the turn before
        assert drafter_read in (0, max(verifier_read, p - held)), read
    if schedule == "constant":  # (the controller may keep to plain steps on a CPU: a drafter as large as the model)
        # (beyond the verifier's: the last draft of an all-accepted round, which it never read, and a margin of one)
        assert all(0 < drafter_read <= verifier_read + 3 for _, verifier_read, drafter_read, _ in read[1:]), read


def test_a_chat_passing_back_the_returned_cache_copies_nothing_in(fresh_engines, monkeypatch):
    from hf_sparsekv.caches.static import StaticFullCache

    model = copy.deepcopy(tiny_model("llama"))
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0, static_engine=True,
                  return_dict_in_generate=True)
    loads = []
    load = StaticFullCache.load_prefix
    monkeypatch.setattr(StaticFullCache, "load_prefix", lambda self, *a, **k: loads.append(1) or load(self, *a, **k))
    history = prompt(60, seed=3)
    out = model.generate(history, **kwargs)
    for turn in range(2):
        history = torch.cat([out.sequences, prompt(20, seed=turn)], 1)
        out = model.generate(history, past_key_values=out.past_key_values, **kwargs)
        assert torch.equal(out.sequences, model.generate(history, max_new_tokens=10, do_sample=False,
                                                         eos_token_id=None, pad_token_id=0))
        assert out.spec_stats.prefill_tokens == 21 and out.past_key_values.get_seq_length() == history.shape[1] + 9
    assert not loads


def test_a_sampled_chat_turn_draws_as_a_fresh_call_does(fresh_engines):
    """Reusing the held prefix changes no draw: with one seed, a sampled turn after the previous one gives the tokens
    the same turn gives on a fresh engine (the same distribution, the same random numbers)."""
    model = copy.deepcopy(tiny_model("llama"))
    kwargs = dict(max_new_tokens=12, do_sample=True, temperature=1.3, pad_token_id=0, eos_token_id=None,
                  static_engine=True)
    torch.manual_seed(2)  # (the draws of the first turn, whatever ran before on this process)
    first = model.generate(prompt(70, seed=2), **kwargs)
    history = torch.cat([first, prompt(25, seed=5)], 1)
    mask = torch.ones_like(history)  # (a drawn 0 is a token, not padding)
    torch.manual_seed(11)
    reused = model.generate(history, attention_mask=mask, return_dict_in_generate=True, **kwargs)
    assert reused.spec_stats.prefill_tokens == 26
    static_engine.release_engines(model)
    torch.manual_seed(11)
    assert torch.equal(reused.sequences, model.generate(history, attention_mask=mask, **kwargs))


def test_the_light_stage_waits_for_what_tracing_costs(monkeypatch):
    """Rent or buy per configuration: light compilation is due once the model's charged time reaches what tracing
    the configuration's steps costs (more steps, later), never before a configuration ran a step, never after the full
    stage; the full stage is the model's, at ``HF_SPARSEKV_COMPILE_AFTER``."""
    from hf_sparsekv.generation import compile_policy

    monkeypatch.setenv("HF_SPARSEKV_COMPILE_AFTER", "30")
    model = torch.nn.Linear(1, 1)
    monkeypatch.setattr(compile_policy, "LIGHT_FIXED_S", 3.0)
    monkeypatch.setattr(compile_policy, "LIGHT_STEP_S", 1.0)
    monkeypatch.setattr(compile_policy, "REGIONAL_FIXED_S", 2.0)
    monkeypatch.setattr(compile_policy, "REGIONAL_STEP_S", 0.25)
    monkeypatch.setattr(compile_policy, "UNCOMPILED_CHARGE_SHARE", 0.5)
    compile_policy.charge(model, 10.0)  # uncompiled rounds: half counts
    assert compile_policy.charged(model) == 5.0
    assert compile_policy.compiles(model, "later", 1) == "light"  # 3 + 1 s
    assert compile_policy.compiles(model, "later", 14) is None  # 3 + 14 s
    assert compile_policy.compiles(model, "later", 12, regional=True) == "light"  # 2 + 3 s: one layer traced
    assert compile_policy.compiles(model, "later", 14, regional=True) is None  # 2 + 3.5 s
    assert compile_policy.compiles(model, "later", 0) is None
    compile_policy.charge(model, 26.0)
    assert compile_policy.compiles(model, "later", 14) == "light"
    assert compile_policy.light_after(40) == 30.0
    compile_policy.charge(model, 48.0, light=True)  # light rounds: a quarter counts
    assert compile_policy.compiles(model, "later", 0) == "steps"
    assert compile_policy.compiles(model, "now") == "all" and compile_policy.compiles(model, "light") == "light"
    assert compile_policy.compiles(model, "never", 14) is None


def test_a_first_engine_on_graphs_holds_a_chat_ahead_where_memory_allows(monkeypatch):
    """A configuration's first engine on CUDA graphs holds ``FIRST_CAPACITY`` positions, or twice, four times ... as
    many as the call needs (bounded by the model's ``max_position_embeddings``) where its caches that long, every row,
    take at most ``FIRST_CAPACITY_SHARE`` of the engines' memory budget; without graphs, or past that memory, exactly
    what the call needs; a second engine of the same configuration doubles the first."""
    from types import SimpleNamespace

    model = tiny_model("llama")  # 2 layers, 2 KV heads of 16, float64: 1 KiB a position; 1,024 positions at most
    spec = SimpleNamespace(device=torch.device("cpu"), batch=1)
    grown = static_engine._grown
    monkeypatch.setattr(static_engine, "FIRST_CAPACITY", 512)
    assert grown([], model, None, spec, 300, True, 1024) == 512
    assert grown([], model, None, spec, 600, True, 1024) == 1024
    assert grown([], model, None, spec, 1024, True, 4096) == 1024
    assert grown([], model, None, spec, 1100, True, 4096) == 2048
    assert grown([], model, None, spec, 600, True, 800) == 800
    assert grown([], model, None, spec, 300, True, 400) == 400
    assert grown([], model, None, spec, 300, False, 1024) == 300
    monkeypatch.setenv("HF_SPARSEKV_ENGINE_MEMORY", str(8 * 512 * 1024 / 2**30 * 0.99))  # 1/8: just short of it
    assert grown([], model, None, spec, 300, True, 1024) == 300
    monkeypatch.setenv("HF_SPARSEKV_ENGINE_MEMORY", str(8 * 512 * 1024 / 2**30))
    assert grown([], model, None, spec, 600, True, 1024) == 600  # 1,024 positions: past the share
    assert grown([], model, None, spec, 300, True, 1024) == 512
    assert grown([], model, None, SimpleNamespace(device=spec.device, batch=2), 300, True, 1024) == 300  # 2 rows
    kept = SimpleNamespace(max_tokens=512, same_configuration=lambda *args: True)
    assert grown([kept], model, None, spec, 600, True, 4096) == 1024


def test_a_prefill_runs_without_cudnn_attention(monkeypatch):
    """Every prefill (the verifier's and a separate drafter's) runs with PyTorch's cuDNN attention off and its other
    SDPA kernels on (cuDNN builds a plan on the host for each new prompt length), and leaves the settings as they
    were; the tokens are stock greedy's."""
    from hf_sparsekv.generation import graph_steps

    flags, forward = [], graph_steps.prefill_forward

    def recording(model, *args):
        flags.append((model.config.num_hidden_layers, torch.backends.cuda.cudnn_sdp_enabled(),
                      torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()))
        return forward(model, *args)

    monkeypatch.setattr(graph_steps, "prefill_forward", recording)
    model, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")  # 2 layers, 1
    ids = prompt(40, seed=9)
    common = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    reference = model.generate(ids, **common)
    assert torch.equal(model.generate(ids, assistant_model=drafter, **common), reference)
    assert {f[0] for f in flags} == {2, 1}
    assert all(f[1:] == (False, True, True) for f in flags)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_overlapping_prefills_restore_the_users_attention_settings():
    """Prefills overlapping in threads may leave their contexts in any order: cuDNN attention stays off while any is
    inside and comes back as the user set it when the last leaves; the other backends keep the user's choice."""
    from hf_sparsekv.generation.graph_steps import cudnn_attention_off

    flash, cudnn = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        for user_cudnn in (True, False):
            torch.backends.cuda.enable_cudnn_sdp(user_cudnn)
            first = threading.Barrier(2, timeout=30)  # (every wait bounded: a failing thread hangs nothing)
            second, done = threading.Event(), threading.Event()
            seen = []

            def outer():
                with cudnn_attention_off:
                    first.wait()
                    second.wait(30)  # (the inner prefill entered after this one ...)
                seen.append(torch.backends.cuda.cudnn_sdp_enabled())  # (... and is still inside)
                done.set()

            def inner():
                first.wait()
                with cudnn_attention_off:
                    second.set()
                    done.wait(30)
                    seen.append(torch.backends.cuda.flash_sdp_enabled())

            threads = [threading.Thread(target=outer), threading.Thread(target=inner)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=30)
            assert seen == [False, False]  # cuDNN off while the inner one runs; flash as the user set it
            assert torch.backends.cuda.cudnn_sdp_enabled() == user_cudnn
    finally:
        torch.backends.cuda.enable_flash_sdp(flash)
        torch.backends.cuda.enable_cudnn_sdp(cudnn)


def test_a_forgotten_sequence_is_prefilled_again():
    """A repeated prompt prefills its last two tokens only (the engine holds it); after ``forget_sequences`` the same
    call prefills the whole prompt, with the same tokens."""
    model = copy.deepcopy(tiny_model("llama"))
    ids = prompt(30, seed=11)
    kwargs = dict(static_engine=True, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0,
                  return_dict_in_generate=True)
    first = model.generate(ids, **kwargs)
    again = model.generate(ids, **kwargs)
    static_engine.forget_sequences(model)
    forgotten = model.generate(ids, **kwargs)
    assert (first.spec_stats.prefill_tokens, again.spec_stats.prefill_tokens,
            forgotten.spec_stats.prefill_tokens) == (30, 2, 30)
    assert torch.equal(first.sequences, again.sequences) and torch.equal(first.sequences, forgotten.sequences)
