"""``draft_tree_size`` on the engine (:mod:`hf_sparsekv.generation.draft_tree`): token-identical to plain greedy
``generate()`` on Llama, Qwen2 and Mistral, every drafter cache, γ 1-8, trees of γ+1 to 62 nodes, with retrieval
grafted in, self-drafting, batch rows of different lengths; both caches after sibling rounds equal a plain forward's; sampling
against the exactly enumerated joint distribution; host-side rules with stock's scores; what is refused."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from hf_sparsekv.generation import drafting, engine as static_engine
from hf_sparsekv.generation.draft_tree import SIBLING

from .conftest import ARCHS, left_padded, prompt, stock_generate, tiny_model
from .test_retrieval import _cache_check, _recording_steps, _repetitive_prompt

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


@functools.lru_cache(maxsize=None)
def _near_drafter(arch: str):
    """The verifier with noise on every weight: a drafter whose argmax often differs from the verifier's while the
    verifier's token is among its next few (the rounds a tree's alternatives rescue); its logits sharpened fourfold
    (the final norm's weight: the same argmaxes), so that paths grown off its chain can outrank the root's further
    alternatives, as a trained drafter's do."""
    drafter = copy.deepcopy(tiny_model(arch))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * p.std().clamp_min(1e-3) * 0.35)
        drafter.model.norm.weight.mul_(4)
    return drafter


def _cases():
    """architecture × drafter cache × (γ, nodes); the default suite runs a Latin square, the rest extended."""
    modes, shapes = ["chunk", "window", "full"], [(1, 4), (3, 12), (5, 32), (8, 62)]
    cases = []
    for i, arch in enumerate(ARCHS):
        for j, mode in enumerate(modes):
            for k, (gamma, size) in enumerate(shapes):
                default = k == (i + j) % len(shapes)
                cases.append(pytest.param(arch, mode, gamma, size, marks=() if default else pytest.mark.extended,
                                          id=f"{arch}-{mode}-g{gamma}-n{size}"))
    return cases


@pytest.mark.parametrize("arch,mode,gamma,size", _cases())
def test_trees_are_greedy(arch, mode, gamma, size, monkeypatch):
    """Every round a tree: rounds kept on the chain, rounds ending on an alternative (the drafter then catches up),
    with and without retrieval grafted in: greedy's tokens."""
    verifier, drafter = tiny_model(arch), _near_drafter(arch)
    grown = []  # per round: whether the drafter's tree held a node whose parent is off its chain
    steps = _recording_steps(monkeypatch, lambda engine, name: name == "draft" and grown.append(_grown(engine)))
    siblings = 0
    for seed, lookup in ((0, None), (1, gamma)):
        ids = _repetitive_prompt(seed + 10 * gamma)
        out = verifier.generate(ids, assistant_model=drafter, draft_cache=mode, num_assistant_tokens=gamma,
                                kv_budget=None if mode == "full" else 24, draft_tree_size=size,
                                prompt_lookup_num_tokens=lookup, max_new_tokens=40, return_dict_in_generate=True,
                                **GREEDY)
        assert torch.equal(out.sequences, verifier.generate(ids, max_new_tokens=40, **GREEDY)), (seed, lookup)
        siblings += out.spec_stats.sibling_rounds
    engine = static_engine.current_engine(verifier)
    assert engine.spec.tree_size == size and engine.tree.width >= 2
    assert siblings > 0 and "verify" not in steps and "catch_up_block" not in steps and "catch_up" not in steps
    assert any(grown) == (gamma > 1)


def _grown(engine) -> bool:
    """Whether the tree of the round just drafted holds a node whose parent is one of the drafter's other nodes (a
    path it grew off its chain), built again from the engine's buffers."""
    tree = engine.tree
    _, parents, _, _, kinds = tree.build(
        engine.tree_constants, engine.drafts, (engine.pool_tokens, engine.pool_scores),
        engine.frontier, engine.retrieved[:, : tree.retrieved] if tree.retrieved else None,
        engine.report[:, -1] > 0 if tree.retrieved else None)
    return bool((kinds.gather(1, parents) == SIBLING).any())


@pytest.mark.parametrize("mode", ["chunk", "window"])
def test_self_drafting_trees_are_greedy(mode):
    """The verifier drafting on its own budget cache (one prefill fills both), trees of 16 nodes: greedy's tokens."""
    verifier = tiny_model("qwen2")
    ids = _repetitive_prompt(5)
    out = verifier.generate(ids, assistant_model=verifier, draft_cache=mode, kv_budget=24, num_assistant_tokens=4,
                            draft_tree_size=16, max_new_tokens=40, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, verifier.generate(ids, max_new_tokens=40, **GREEDY))
    assert out.spec_stats.sibling_rounds > 0 and static_engine.current_engine(verifier).drafter is verifier


def test_trees_in_a_batch_of_different_lengths(monkeypatch):
    """A left-padded batch, each row its own tree (retrieval grafted in where a row matched): each row's greedy
    tokens. The drafter's vocabulary top-k runs its two stages here (slices of 8 ids; the tiny vocabulary would
    otherwise take one ``torch.topk``)."""
    monkeypatch.setattr(drafting, "TOPK_SLICE", 8)
    verifier, drafter = tiny_model("qwen2"), _near_drafter("qwen2")
    prompts = [_repetitive_prompt(3), prompt(9, 5), prompt(30, 6)]
    ids, mask = left_padded(prompts)
    out = verifier.generate(ids, attention_mask=mask, assistant_model=drafter, kv_budget=24, draft_tree_size=10,
                            num_assistant_tokens=3, prompt_lookup_num_tokens=3, max_new_tokens=24, **GREEDY)
    assert static_engine.current_engine(verifier).spec.batch == 3
    width = ids.shape[1]
    for b, p in enumerate(prompts):
        assert torch.equal(out[b, width:], verifier.generate(p, max_new_tokens=24, **GREEDY)[0, p.shape[1] :]), b


def test_both_caches_hold_the_kept_paths_only(monkeypatch):
    """After rounds that ended on one of the drafter's alternatives or on the retrieved chain, at every draft step the
    drafter's and the verifier's full caches hold, for the positions before ``n - 1``, exactly a plain forward's keys
    and values over ``seq[:n-1]`` (float64), no other node's slot is visible, and the drafts are the drafter's
    greedy continuation."""
    verifier, drafter = tiny_model("llama"), _near_drafter("llama")
    plain, plain_verifier = copy.deepcopy(drafter), copy.deepcopy(verifier)
    checked = []
    steps = _recording_steps(monkeypatch, _cache_check(plain, plain_verifier, checked))
    ids = _repetitive_prompt(7)
    out = verifier.generate(ids, assistant_model=drafter, draft_cache="full", draft_tree_size=12,
                            num_assistant_tokens=4, prompt_lookup_num_tokens=4, max_new_tokens=48,
                            return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, verifier.generate(ids, max_new_tokens=48, **GREEDY))
    assert out.spec_stats.sibling_rounds > 0 and out.spec_stats.retrieved_rounds > 0
    assert len(checked) == steps.count("draft") > 1 and all(checked)


def test_trees_with_a_repetition_penalty_and_sampled_with_top_k_one():
    """The penalty on the device, after each node's own path; sampling with top_k=1: greedy's (penalized) tokens."""
    verifier, drafter = tiny_model("mistral"), _near_drafter("mistral")
    ids = _repetitive_prompt(11)
    kwargs = dict(max_new_tokens=30, repetition_penalty=1.3, **GREEDY)
    ours = verifier.generate(ids, assistant_model=drafter, kv_budget=24, draft_tree_size=9, num_assistant_tokens=3,
                             **kwargs)
    assert not static_engine.current_engine(verifier).spec.host
    assert torch.equal(ours, stock_generate(verifier, ids, **kwargs))
    sampled = verifier.generate(ids, assistant_model=drafter, kv_budget=24, draft_tree_size=9, num_assistant_tokens=3,
                                max_new_tokens=30, do_sample=True, top_k=1, eos_token_id=None, pad_token_id=0)
    assert torch.equal(sampled, verifier.generate(ids, max_new_tokens=30, **GREEDY))


def test_tree_rounds_under_host_side_rules():
    """An n-gram ban moves the choices to the host, which processes each node after its own path: stock's tokens and
    scores."""
    verifier, drafter = tiny_model("llama"), _near_drafter("llama")
    ids = _repetitive_prompt(21)
    kwargs = dict(max_new_tokens=30, no_repeat_ngram_size=4, return_dict_in_generate=True, output_scores=True,
                  **GREEDY)
    ours = verifier.generate(ids, assistant_model=drafter, kv_budget=24, draft_tree_size=12, num_assistant_tokens=3,
                             prompt_lookup_num_tokens=3, **kwargs)
    assert static_engine.current_engine(verifier).spec.host
    stock = stock_generate(verifier, ids, **kwargs)
    assert torch.equal(ours.sequences, stock.sequences)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ours.scores, stock.scores))
    assert ours.spec_stats.sibling_rounds > 0


@pytest.mark.extended
def test_sampled_trees_match_the_exact_joint_distribution():
    """Two sampled tokens per call, the second from a tree round (the drafter's draft and its three most probable
    alternatives): the joint distribution is stock sampling's, exactly enumerated (chi-square and TV over 1,500
    draws)."""
    from .test_sampling import VOCAB, WARPERS, _consistent, _joint, _tiny

    model, drafter = _tiny(2, seed=0, width=32), _tiny(1, seed=3, width=32)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(6))
    joint = _joint(model, ids)
    torch.manual_seed(12)
    samples = []
    for _ in range(1500):
        out = model.generate(ids, assistant_model=drafter, draft_cache="full", do_sample=True, max_new_tokens=2,
                             min_new_tokens=2, eos_token_id=None, num_assistant_tokens=1, draft_tree_size=4, **WARPERS)
        samples.append(int(out[0, -2]) * VOCAB + int(out[0, -1]))
    assert static_engine.current_engine(model).tree.width == 4
    samples = torch.tensor(samples)
    assert _consistent(samples, joint)
    counts = torch.bincount(samples, minlength=VOCAB * VOCAB).double() / samples.numel()
    assert float(0.5 * (counts - joint).abs().sum()) < 0.1


def test_what_trees_refuse():
    verifier, drafter = tiny_model("llama"), _near_drafter("llama")
    ids = prompt(12, 0)
    for size, match in ((2, "from num_assistant_tokens"), (63, "to 62"), (4.5, "an integer")):
        with pytest.raises(ValueError, match=match):
            verifier.generate(ids, assistant_model=drafter, kv_budget=16, num_assistant_tokens=3,
                              draft_tree_size=size, max_new_tokens=4)
    with pytest.raises(NotImplementedError, match="draft_tree_size with mode 'int4'"):
        verifier.generate(ids, assistant_model=verifier, draft_cache="int4", draft_tree_size=8, max_new_tokens=4)
    with pytest.raises(NotImplementedError, match="draft_tree_size with mode 'lookup'"):
        verifier.generate(ids, prompt_lookup_num_tokens=3, draft_tree_size=8, max_new_tokens=4)
    # the chain's size is the chain
    out = verifier.generate(ids, assistant_model=drafter, kv_budget=16, num_assistant_tokens=3, draft_tree_size=3,
                            max_new_tokens=8, **GREEDY)
    assert static_engine.current_engine(verifier).tree is None
    assert torch.equal(out, verifier.generate(ids, max_new_tokens=8, **GREEDY))
