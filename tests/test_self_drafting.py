"""Self-drafting on a compressed view of the model's own prefill (``assistant_model=model`` with draft_cache
"chunk"/"window") and prompt caching (``past_key_values`` holding a prefix of the prompt). References: stock greedy
``generate()``, a separate prefill of the same cache, and counts of the tokens the verifier processes."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from transformers import DynamicCache

import hf_sparsekv
from hf_sparsekv import ChunkBudgetCache, HierarchicalQuantCache, SinkWindowCache

from .conftest import ARCHS, prompt, tiny_model


@contextlib.contextmanager
def _forward_lengths(model):
    """Yields the list of input lengths of every forward call of ``model`` inside the block."""
    lengths: list[int] = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        lengths.append(int(ids.shape[1]))

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield lengths
    finally:
        handle.remove()


def _self_cases(n_per_arch=6, seed=1):
    rng = random.Random(seed)
    cases = []
    for arch in ARCHS:
        for i in range(n_per_arch):
            mode = ("chunk", "window")[i % 2]
            cases.append(dict(
                arch=arch, mode=mode, prompt_len=rng.choice([2, 9, 64, 150, 333]),
                budget=rng.choice([8, 16, 40, 128]) if mode == "chunk" else rng.choice([None, 12, 40]),
                gamma=rng.choice([1, 2, 4, 7]), seed=i,
            ))
    return cases


@pytest.mark.parametrize("case", _self_cases(), ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_self_drafting_is_lossless(case):
    model = tiny_model(case["arch"])
    ids = prompt(case["prompt_len"], seed=case["seed"])
    kwargs = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False)
    reference = model.generate(ids, **kwargs)
    out = model.generate(
        ids, assistant_model=model, draft_cache=case["mode"], kv_budget=case["budget"],
        num_assistant_tokens=case["gamma"], return_dict_in_generate=True, **kwargs,
    )
    assert torch.equal(out.sequences, reference)
    stats = out.spec_stats
    assert stats["new_tokens"] == 32
    assert 0 <= stats["accepted"] <= stats["drafted"] <= case["gamma"] * stats["rounds"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["chunk", "window"])
def test_self_drafter_cache_is_built_from_the_one_prefill(arch, mode):
    model = tiny_model(arch)
    p = 150
    ids = prompt(p, seed=3)
    make = (lambda: ChunkBudgetCache(32)) if mode == "chunk" else (lambda: SinkWindowCache(4, 20, max_rollback=5))
    shared = make()
    with _forward_lengths(model) as lengths:
        out = model.generate(ids, assistant_model=model, draft_cache=shared, num_assistant_tokens=4,
                             max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert torch.equal(out, model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False))
    assert lengths.count(p) == 1 and max(lengths[1:]) <= 5  # one prefill of the prompt, then drafts and blocks

    separate = make()  # the same cache prefilled on its own (hooks give the queries) ...
    with torch.no_grad(), hf_sparsekv.prompt_queries(model):
        model(input_ids=ids, past_key_values=separate, use_cache=True)
    for a, b in zip(shared.layers, separate.layers):  # ... holds the same prompt tokens
        if mode == "chunk":
            assert torch.equal(a.kept_indices, b.kept_indices)
            n = b.keys.shape[-2]
            assert n <= 32 and torch.equal(a.keys[..., :n, :], b.keys) and torch.equal(a.values[..., :n, :], b.values)
        else:
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)  # the sinks


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("mode,budget", [("chunk", 512), ("window", 512)])
def test_self_drafting_on_an_uncompressed_view_accepts_everything(arch, mode, budget):
    """Budget above prompt + output: the draft view holds every token, so in float64 each draft must match."""
    model = tiny_model(arch)
    out = model.generate(prompt(120, seed=4), assistant_model=model, draft_cache=mode, kv_budget=budget,
                         num_assistant_tokens=4, max_new_tokens=30, min_new_tokens=30, do_sample=False,
                         return_dict_in_generate=True)
    assert out.spec_stats["drafted"] > 0 and out.spec_stats["acceptance_rate"] == 1.0


def test_self_drafting_rejects_a_cache_it_cannot_share():
    model = tiny_model("llama")
    with pytest.raises(NotImplementedError, match="draft_cache"):
        model.generate(prompt(20, 0), assistant_model=model, draft_cache=DynamicCache(), max_new_tokens=3)


# --- prompt caching -------------------------------------------------------------------------------------------


def _prefix(model, ids, n):
    cache = DynamicCache()
    if n:
        with torch.no_grad():
            model(input_ids=ids[:, :n], past_key_values=cache, use_cache=True)
    return cache


_SPECS = {
    "chunk": dict(kv_budget=16), "window": dict(draft_cache="window", kv_budget=24), "full": dict(draft_cache="full"),
    "int4-drafter": dict(draft_cache="int4"), "window-self": dict(draft_cache="window", kv_budget=24, self=True),
}
_PREFIX_CASES = [  # every spec on every architecture, the prefix length cycling through 1, 57, 119 (of 120)
    (arch, name, (1, 57, 119)[(i + j) % 3]) for i, arch in enumerate(ARCHS) for j, name in enumerate(_SPECS)
]


@pytest.mark.parametrize("arch,spec_name,n_prefix", _PREFIX_CASES)
def test_prefix_cache_is_reused_not_recomputed(arch, spec_name, n_prefix):
    """The engine copies the prefix into its row (self-drafting on a window: into the drafter's window too) and
    extends the caller's cache afterwards."""
    from hf_sparsekv.generation import engine as static_engine

    verifier = tiny_model(arch)
    spec = dict(_SPECS[spec_name])
    drafter = verifier if spec.pop("self", False) else tiny_model(arch, role="drafter")
    p = 120
    ids = prompt(p, seed=n_prefix)
    kwargs = dict(max_new_tokens=16, do_sample=False, assistant_model=drafter, num_assistant_tokens=3, **spec)
    reference = verifier.generate(ids, max_new_tokens=16, do_sample=False)
    with _forward_lengths(verifier) as fresh:
        out_fresh = verifier.generate(ids, **kwargs)
    cache = _prefix(verifier, ids, n_prefix)
    static_engine.release_engines(verifier)  # (else the engine still holds the whole prompt: a chat's next turn)
    with _forward_lengths(verifier) as reused:
        out = verifier.generate(ids, past_key_values=cache, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, reference) and torch.equal(out_fresh, reference)
    assert reused[0] == p - n_prefix  # the verifier's prefill covers only the uncached part ...
    assert sum(fresh) - sum(reused) == n_prefix  # ... and every later forward is the same (same drafts)
    assert out.past_key_values is cache and cache.get_seq_length() == out.sequences.shape[1] - 1
    assert static_engine.current_engine(verifier) is not None
    stock = _prefix(verifier, out.sequences, out.sequences.shape[1] - 1)  # what stock leaves in a cache
    for ours, theirs in zip(cache.layers, stock.layers):
        torch.testing.assert_close(ours.keys, theirs.keys)
        torch.testing.assert_close(ours.values, theirs.values)


@pytest.mark.parametrize("case,error,match", [
    ("full_prefix", ValueError, "past_key_values"),
    ("self_chunk", NotImplementedError, "past_key_values"),
    ("self_int4", NotImplementedError, "past_key_values"),
    ("sliding", NotImplementedError, "past_key_values"),
    ("compressed", NotImplementedError, "past_key_values"),
    ("padded", NotImplementedError, "past_key_values"),
])
def test_prefix_cache_misuse_raises_naming_past_key_values(case, error, match):
    model = tiny_model("mistral")  # has a sliding window: DynamicCache(config=...) builds sliding layers
    ids = prompt(40, seed=5)
    kwargs = dict(max_new_tokens=4, do_sample=False, assistant_model=tiny_model("mistral", role="drafter"), kv_budget=16)
    cache = _prefix(model, ids, 10)
    if case == "full_prefix":
        cache = _prefix(model, ids, 40)
    elif case == "self_chunk":
        kwargs["assistant_model"] = model
    elif case == "self_int4":
        kwargs.update(assistant_model=model, draft_cache="int4", kv_budget=None)
    elif case == "sliding":
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[:, :10], past_key_values=cache, use_cache=True)
    elif case == "compressed":
        cache = HierarchicalQuantCache(16)
    elif case == "padded":
        ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
        kwargs["attention_mask"] = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 40, dtype=torch.long)], 1)
    with pytest.raises(error, match=match):
        model.generate(ids, past_key_values=cache, **kwargs)


def test_prefix_cache_under_either_keyword():
    """transformers 5.24 renamed generate()'s ``past_key_values`` to ``cache``: both names reach the same prompt
    cache (on every supported version), giving the stock greedy output; both at once is a TypeError."""
    verifier, drafter = tiny_model("qwen2"), tiny_model("qwen2", role="drafter")
    ids = prompt(90, seed=3)
    kwargs = dict(max_new_tokens=12, do_sample=False, assistant_model=drafter, kv_budget=16, num_assistant_tokens=3)
    reference = verifier.generate(ids, max_new_tokens=12, do_sample=False)
    cache = _prefix(verifier, ids, 50)
    with _forward_lengths(verifier) as lengths:
        out = verifier.generate(ids, cache=cache, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, reference)
    assert lengths[0] == 40 and out.past_key_values is cache
    with pytest.raises(TypeError, match="both past_key_values and cache"):
        verifier.generate(ids, cache=_prefix(verifier, ids, 50), past_key_values=_prefix(verifier, ids, 50), **kwargs)


@pytest.mark.parametrize("arch", ARCHS)
def test_self_drafting_verification_writes_the_drafters_cache(arch):
    """A self-drafting verify step also writes the drafter's cache: with every draft accepted (a full view), each
    round is γ one-token draft forwards and one verify block, no catch-up forward, and the drafter's cache holds the
    verifier's own keys/values at every position of the sequence."""
    from hf_sparsekv.generation import engine as static_engine

    model, gamma, p, new = tiny_model(arch), 4, 60, 31
    ids = prompt(p, seed=5)
    with _forward_lengths(model) as lengths:
        out = model.generate(ids, assistant_model=model, draft_cache="full", num_assistant_tokens=gamma,
                             num_assistant_tokens_schedule="constant", max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False))
    assert out.spec_stats["acceptance_rate"] == 1.0
    rounds = out.spec_stats["rounds"]
    assert lengths.count(gamma + 1) == rounds and lengths.count(1) == gamma * rounds and len(lengths) == 1 + (gamma + 1) * rounds
    engine = static_engine.current_engine(model)
    assert "catch_up" not in engine.steps
    for i in range(len(engine.verifier_cache.layers)):
        for a, b in zip(engine.verifier_cache.sequence(i, 0, 0, p + new - 1),
                        engine.drafter_cache.sequence(i, 0, 0, p + new - 1)):
            assert torch.equal(a, b)


def test_self_drafting_with_retrieval_leaves_no_hole_in_the_drafters_cache():
    """Retrieval beside a self-drafter verifies trees, whose forward does not write the drafter's cache: after a
    tree round that kept every draft, the last draft is fed to the drafter before the next round, so the drafter
    holds every position of the sequence but the last round's (float64, greedy's tokens)."""
    from hf_sparsekv.generation import engine as static_engine

    model = tiny_model("llama")
    base = prompt(30, seed=6)
    ids = torch.cat([base, base, base[:, :12]], 1)  # repeats: retrieval finds matches
    new = 40
    out = model.generate(ids, assistant_model=model, draft_cache="full", prompt_lookup_num_tokens=3,
                         num_assistant_tokens=3, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False))
    engine = static_engine.current_engine(model)
    assert "verify_tree" in engine.steps and out.spec_stats.acceptance_rate == 1.0  # trees, each keeping the chain
    held = engine.drafter_cache.slot_positions[0]
    length = out.sequences.shape[1] - 5  # (the last round's tokens may still wait for their catch-up)
    assert torch.equal(held[:length], torch.arange(length)), (held[:length] < 0).nonzero().flatten().tolist()
