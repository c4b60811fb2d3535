"""Retrieval drafting (prompt lookup) on the engine: the drafts against a plain-Python reference of the rule, stock's
own ``generate(ids, prompt_lookup_num_tokens=N)`` served by our engine with stock's tokens (references: stock's
prompt lookup with the patch removed, and plain greedy ``generate()``), batches, sampling, and what is refused."""

from __future__ import annotations

import random

import pytest
import torch

import hf_sparsekv
from hf_sparsekv.generation import engine as static_engine
from hf_sparsekv.generation.retrieval import retrieval_drafts

from .conftest import ARCHS, left_padded, prompt, tiny_model


def _reference_drafts(tokens: list[int], gamma: int, max_ngram: int) -> tuple[list[int], bool]:
    """The rule, literally: the longest suffix (up to max_ngram) with an earlier occurrence, its most recent one; the
    γ tokens after it, continued periodically; no match: the last token repeated (and found = False)."""
    n = len(tokens)
    for k in range(min(max_ngram, n - 1), 0, -1):
        suffix = tokens[n - k :]
        for end in range(n - 2, k - 2, -1):  # most recent first
            if tokens[end - k + 1 : end + 1] == suffix:
                period = n - 1 - end
                return [tokens[end + 1 + i % period] for i in range(gamma)], True
    return [tokens[-1]] * gamma, False


@pytest.mark.parametrize("seed", range(6))
def test_retrieval_drafts_follow_the_rule(seed):
    rng = random.Random(seed)
    rows, capacity = 5, 96
    seq = torch.randint(0, 7, (rows, capacity), generator=torch.Generator().manual_seed(seed))  # small alphabet
    lengths = [rng.randint(2, capacity) for _ in range(rows)]
    lengths[0] = 2  # the shortest sequence
    for row in range(1, rows):  # plant a repeat of the last tokens in most rows
        n = lengths[row]
        if n > 12 and rng.random() < 0.8:
            at = rng.randint(0, n - 10)
            seq[row, at : at + 4] = seq[row, n - 4 : n]
    n = torch.tensor(lengths)
    for gamma in (1, 3, 8):
        for max_ngram in (1, 2, 4):
            drafts, found = retrieval_drafts(seq, n, gamma, max_ngram)
            for row in range(rows):
                expected, matched = _reference_drafts(seq[row, : lengths[row]].tolist(), gamma, max_ngram)
                assert drafts[row].tolist() == expected and bool(found[row]) == matched, (row, gamma, max_ngram)
    unique = torch.arange(40)[None]  # no token repeats: no match, the last token repeated
    drafts, found = retrieval_drafts(unique, torch.tensor([40]), 3, 2)
    assert drafts.tolist() == [[39, 39, 39]] and not bool(found[0])


def _repetitive_prompt(seed: int) -> torch.Tensor:
    """A prompt that quotes itself, so that lookups find matches."""
    base = prompt(14, seed)
    return torch.cat([base, base[:, 3:], base[:, :6]], 1)


def _stock(model, ids, **kwargs):
    hf_sparsekv.unregister()
    try:
        return model.generate(ids, **kwargs)
    finally:
        hf_sparsekv.register()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tokens,ngram", [(1, 1), (3, 2), (10, 3)])
def test_stock_prompt_lookup_runs_on_the_engine_with_stocks_tokens(arch, tokens, ngram):
    model = tiny_model(arch)
    ids = _repetitive_prompt(3)
    settings = dict(prompt_lookup_num_tokens=tokens, max_matching_ngram_size=ngram, max_new_tokens=30,
                    do_sample=False)
    out = model.generate(ids, return_dict_in_generate=True, **settings)
    engine = static_engine.current_engine(model)
    assert engine.spec.mode == "lookup" and engine.spec.gamma == tokens and engine.spec.budget == ngram
    assert torch.equal(out.sequences, _stock(model, ids, **settings))
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=30, do_sample=False))
    stats = out.spec_stats
    assert stats.drafted % tokens == 0 and 0 < stats.drafted <= tokens * stats.rounds
    assert stats.accepted > 0  # retrieval was right at least once
    assert stats.new_tokens == 30


def test_rounds_without_a_match_run_one_verifier_step(monkeypatch):
    """A prompt of distinct tokens and a generation that does not repeat them: the rounds in which no match exists
    run the one-token step, not a (γ+1)-token verification, and the output is still greedy's."""
    model = tiny_model("llama")
    ids = torch.randperm(90, generator=torch.Generator().manual_seed(2))[None, :60] + 3
    steps = []
    run_step = static_engine.StaticEngine.run_step
    monkeypatch.setattr(static_engine.StaticEngine, "run_step", lambda self, name: (steps.append(name),
                                                                                    run_step(self, name))[1])
    out = model.generate(ids, prompt_lookup_num_tokens=4, max_new_tokens=12, do_sample=False,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=12, do_sample=False))
    assert "ar_step" in steps and "draft" not in steps
    assert out.spec_stats.drafted == 4 * steps.count("verify")


def test_prompt_lookup_from_the_models_generation_config_and_in_a_batch():
    model = tiny_model("qwen2")
    prompts = [_repetitive_prompt(s) for s in (1, 2)] + [prompt(5, 9)]
    ids, mask = left_padded(prompts)
    model.generation_config.prompt_lookup_num_tokens = 4
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    finally:
        model.generation_config.prompt_lookup_num_tokens = None
    engine = static_engine.current_engine(model)
    assert engine.spec.mode == "lookup" and engine.spec.batch == 3  # rows together (stock takes batch 1 only)
    width = ids.shape[1]
    for b, p in enumerate(prompts):
        reference = model.generate(p, max_new_tokens=20, do_sample=False)[0, p.shape[1] :]
        assert torch.equal(out[b, width:], reference), b


def test_sampled_prompt_lookup_with_top_k_one_is_greedy():
    model = tiny_model("mistral")
    ids = _repetitive_prompt(4)
    out = model.generate(ids, prompt_lookup_num_tokens=5, do_sample=True, top_k=1, max_new_tokens=24)
    assert static_engine.current_engine(model).warpers is not None
    assert torch.equal(out, model.generate(ids, max_new_tokens=24, do_sample=False))


@pytest.mark.extended
def test_sampled_prompt_lookup_matches_the_exact_joint_distribution():
    """Two sampled tokens per call (the second one verified against a one-hot retrieval draft): their joint
    distribution is stock sampling's, exactly enumerated (chi-square and TV over 2,500 draws)."""
    from .test_sampling import VOCAB, WARPERS, _consistent, _joint, _tiny

    model = _tiny(2, seed=0, width=32)
    base = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    ids = torch.cat([base, base], 1)  # the lookup always matches: its drafts are taken or resampled
    joint = _joint(model, ids)
    torch.manual_seed(11)
    samples = []
    for _ in range(2500):
        out = model.generate(ids, do_sample=True, max_new_tokens=2, min_new_tokens=2, eos_token_id=None,
                             prompt_lookup_num_tokens=3, **WARPERS)
        samples.append(int(out[0, -2]) * VOCAB + int(out[0, -1]))
    assert static_engine.current_engine(model).spec.mode == "lookup"
    samples = torch.tensor(samples)
    assert _consistent(samples, joint)
    counts = torch.bincount(samples, minlength=VOCAB * VOCAB).double() / samples.numel()
    assert float(0.5 * (counts - joint).abs().sum()) < 0.08


def test_what_prompt_lookup_refuses_or_leaves_to_stock():
    model, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    ids = _repetitive_prompt(5)
    with pytest.raises(NotImplementedError, match="retrieval drafting runs alone"):
        model.generate(ids, prompt_lookup_num_tokens=3, assistant_model=drafter, kv_budget=16, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_matching_ngram_size must be a positive integer"):
        model.generate(ids, prompt_lookup_num_tokens=3, max_matching_ngram_size=-1, max_new_tokens=4)
    static_engine.release_engines()
    # an option the engine does not serve: stock's own prompt lookup serves it, with stock's output
    out = model.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=4, output_hidden_states=True,
                         return_dict_in_generate=True, do_sample=False)
    assert out.hidden_states is not None and static_engine.current_engine(model) is None
    # stock's call with an assistant model stays stock's
    model.generate(ids, prompt_lookup_num_tokens=3, assistant_model=drafter, max_new_tokens=4, do_sample=False)
    assert static_engine.current_engine(model) is None
    # without the patch, stock's prompt lookup
    hf_sparsekv.unregister()
    try:
        out = model.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=4, return_dict_in_generate=True)
    finally:
        hf_sparsekv.register()
    assert not hasattr(out, "spec_stats") and static_engine.current_engine(model) is None
