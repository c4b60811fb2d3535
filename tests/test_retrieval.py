"""Retrieval drafting (prompt lookup) on the engine: the drafts against a plain-Python reference of the rule, stock's
own ``generate(ids, prompt_lookup_num_tokens=N)`` served by our engine with stock's tokens (references: stock's
prompt lookup with the patch removed, and plain greedy ``generate()``), batches, sampling, retrieval beside a drafter
(greedy's tokens, and the drafter's drafts those of a drafter that read the whole sequence), and what is refused."""

from __future__ import annotations

import copy
import random

import pytest
import torch

import hf_sparsekv
from hf_sparsekv.generation import engine as static_engine
from hf_sparsekv.generation.retrieval import retrieval_drafts

from .conftest import ARCHS, left_padded, prompt, stock_generate, tiny_model


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
    assert torch.equal(out.sequences, stock_generate(model, ids, **settings))
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=30, do_sample=False))
    stats = out.spec_stats
    assert 0 < stats.drafted <= tokens * stats.rounds  # the controller drafts up to `tokens` a round
    assert stats.drafted == sum(width * rounds for width, rounds in stats.width_rounds.items())
    assert stats.accepted > 0  # retrieval was right at least once
    assert stats.new_tokens == 30


def test_rounds_without_a_match_run_one_verifier_step(monkeypatch):
    """A prompt of distinct tokens and a generation that does not repeat them: the rounds in which no match exists
    run the one-token step, not a (γ+1)-token verification, and the output is still greedy's."""
    model = tiny_model("llama")
    ids = torch.randperm(90, generator=torch.Generator().manual_seed(2))[None, :60] + 3
    steps = []
    run_step = static_engine.StaticEngine.run_step
    monkeypatch.setattr(static_engine.StaticEngine, "run_step", lambda self, name, *args, **kw: (
        steps.append(name), run_step(self, name, *args, **kw))[1])
    out = model.generate(ids, prompt_lookup_num_tokens=4, num_assistant_tokens_schedule="constant", max_new_tokens=12,
                         do_sample=False, return_dict_in_generate=True)
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


def test_what_prompt_lookup_refuses_or_leaves_tostock_generate():
    model, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    ids = _repetitive_prompt(5)
    with pytest.raises(NotImplementedError, match="retrieval beside a drafter runs with draft_cache"):
        model.generate(ids, prompt_lookup_num_tokens=3, assistant_model=model, draft_cache="int4", max_new_tokens=4)
    with pytest.raises(ValueError, match="a round drafts one chain"):
        model.generate(ids, prompt_lookup_num_tokens=3, assistant_model=drafter, kv_budget=16, num_assistant_tokens=4,
                       max_new_tokens=4)
    with pytest.raises(ValueError, match="max_matching_ngram_size must be a positive integer"):
        model.generate(ids, prompt_lookup_num_tokens=3, max_matching_ngram_size=-1, max_new_tokens=4)
    static_engine.release_engines()
    # an option the engine does not serve: stock's own prompt lookup serves it, with stock's output
    out = model.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=4, output_hidden_states=True,
                         return_dict_in_generate=True, do_sample=False)
    assert out.hidden_states is not None and static_engine.current_engine(model) is None
    # stock's call with an assistant model: routed to the engine, retrieval beside the drafter on a full cache
    model.generate(ids, prompt_lookup_num_tokens=3, assistant_model=drafter, max_new_tokens=4, do_sample=False)
    engine = static_engine.current_engine(model)
    assert engine.spec.mode == "full" and engine.spec.retrieval == 2
    static_engine.release_engines()
    # without the patch, stock's prompt lookup
    hf_sparsekv.unregister()
    try:
        out = model.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=4, return_dict_in_generate=True)
    finally:
        hf_sparsekv.register()
    assert not hasattr(out, "spec_stats") and static_engine.current_engine(model) is None


# ---------------------------------------------------------------- retrieval beside a drafter


def _recording_steps(monkeypatch, record=None):
    steps = []
    run_step = static_engine.StaticEngine.run_step

    def run(self, name, *args, **kwargs):
        new = run_step(self, name, *args, **kwargs)
        steps.append(name)
        if record is not None:
            record(self, name)
        return new
    monkeypatch.setattr(static_engine.StaticEngine, "run_step", run)
    return steps


def _cache_check(plain, plain_verifier, checked: list):
    """A step recorder: before each draft step, both full caches (drafter's and verifier's) of row 0 hold for the
    positions before ``n - 1`` exactly what a plain forward of ``plain`` / ``plain_verifier`` over ``seq[:n-1]``
    holds (float64), and no later slot is visible; ``checked`` gets whether the drafts are ``plain``'s greedy
    continuation of ``seq[:n]``."""

    def record(engine, name):
        if name != "draft":
            return
        n = int(engine.n[0])
        for model, cache in ((plain, engine.drafter_cache), (plain_verifier, engine.verifier_cache)):
            with torch.no_grad():
                held = model(engine.seq[:1, : n - 1], use_cache=True).past_key_values
            for i, layer in enumerate(cache.layers):
                for ours, theirs in ((layer.keys, held.layers[i].keys), (layer.values, held.layers[i].values)):
                    assert torch.allclose(ours[:1, :, : n - 1], theirs, rtol=0, atol=1e-9), (n, i)
            assert bool((cache.slot_positions[0, : n - 1] == torch.arange(n - 1)).all())
            assert bool((cache.slot_positions[0, n - 1 :] >= n - 1).logical_or(
                cache.slot_positions[0, n - 1 :] == -1).all())
        expected = plain.generate(engine.seq[:1, :n], max_new_tokens=engine.spec.gamma, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, n:]
        checked.append(torch.equal(engine.drafts[0], expected))
    return record


def _rounds_by_kind(steps: list[str]) -> tuple[int, int]:
    """(rounds that verified the drafter's chain alone, rounds that verified it beside a retrieved one as a tree)."""
    return steps.count("verify"), steps.count("verify_tree")


def _beside_cases():
    """architecture × drafter cache × γ; the default suite runs a Latin square (each pair once), the rest extended."""
    modes, gammas = ["chunk", "window", "full"], [1, 3, 6]
    cases = []
    for i, arch in enumerate(ARCHS):
        for j, mode in enumerate(modes):
            for gamma in gammas:
                default = gamma == gammas[(i + j) % 3]
                cases.append(pytest.param(arch, mode, gamma, marks=() if default else pytest.mark.extended,
                                          id=f"{arch}-{mode}-g{gamma}"))
    return cases


@pytest.mark.parametrize("arch,mode,gamma", _beside_cases())
def test_retrieval_beside_a_drafter_is_greedy(arch, mode, gamma, monkeypatch):
    """``prompt_lookup_num_tokens`` with a drafter: rounds that verify the drafter's chain and the retrieved one as two
    branches of a tree (some keeping either branch), rounds of the drafter's chain alone (no match), and the drafter
    catching up on a kept retrieved branch: token-identical to greedy."""
    verifier, drafter = tiny_model(arch), tiny_model(arch, role="drafter")
    steps = _recording_steps(monkeypatch)
    kwargs = dict(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    kept_retrieved = []
    for seed in range(2):
        ids = _repetitive_prompt(seed + 10 * gamma)
        out = verifier.generate(ids, assistant_model=drafter, draft_cache=mode,
                                kv_budget=None if mode == "full" else 24, prompt_lookup_num_tokens=gamma,
                                return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, verifier.generate(ids, **kwargs)), seed
        assert out.spec_stats.drafted == gamma * out.spec_stats.rounds
        kept_retrieved.append(out.spec_stats.retrieved_rounds)
    engine = static_engine.current_engine(verifier)
    assert engine.spec.mode == mode and engine.spec.retrieval == 2 and engine.drafter is drafter
    chains, trees = _rounds_by_kind(steps)
    assert chains > 0 and trees > sum(kept_retrieved) > 0 and "catch_up_block" in steps


@pytest.mark.parametrize("kind", ["drafter", "verifier-copy"])
def test_the_drafter_catches_up_on_what_it_did_not_read(monkeypatch, kind):
    """After tree rounds that kept the retrieved branch (and, with a copy of the verifier as drafter, after rounds that
    accepted every draft), both caches hold exactly what models that read the whole sequence hold: at every draft
    step the drafter's and the verifier's full caches' keys and values for the positions before ``n - 1`` equal a
    plain forward's over ``seq[:n-1]`` (float64; the verifier's: its kept branch moved to its slots, nothing of the
    other branch seen), and the drafts are the drafter's greedy continuation of ``seq[:n]``."""
    verifier = tiny_model("qwen2")
    drafter = tiny_model("qwen2", role="drafter") if kind == "drafter" else copy.deepcopy(verifier)
    plain, plain_verifier = copy.deepcopy(drafter), copy.deepcopy(verifier)  # outside the engine's attention
    checked = []
    steps = _recording_steps(monkeypatch, _cache_check(plain, plain_verifier, checked))
    ids = _repetitive_prompt(7)
    if kind == "verifier-copy":  # every draft accepted; matches hidden in some rounds, so that rounds drafted after
        from hf_sparsekv.generation import retrieval  # a full acceptance follow each other too

        def sometimes(seq, n, gamma, ngram):
            drafts, found = retrieval_drafts(seq, n, gamma, ngram)
            return drafts, found & (n % 3 == 0)
        monkeypatch.setattr(retrieval, "retrieval_drafts", sometimes)
    kwargs = dict(max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = verifier.generate(ids, assistant_model=drafter, draft_cache="full", prompt_lookup_num_tokens=4, **kwargs)
    assert torch.equal(out, verifier.generate(ids, **kwargs))
    chains, trees = _rounds_by_kind(steps)
    assert trees > 0 and len(checked) == steps.count("draft") > 1 and all(checked)
    # draft steps prepared by a catch-up block after a kept retrieved branch, by a one-token catch-up after a tree
    # round that accepted every draft of the drafter's branch
    after = {tuple(steps[i - 2 : i]) for i, name in enumerate(steps) if name == "draft" and i >= 2}
    assert ("verify_tree", "catch_up_block" if kind == "drafter" else "catch_up") in after
    if kind == "verifier-copy":
        assert chains > 0 and "catch_up_block" not in steps  # its branch is never shorter than the retrieved one


def test_retrieval_beside_a_drafter_in_a_batch_and_sampled():
    """Rows of different lengths together, and sampling with top_k=1 (the retrieved drafts read as one-hot
    proposals): both are greedy's tokens."""
    verifier, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    prompts = [_repetitive_prompt(s) for s in (3, 4)] + [prompt(9, 5)]
    ids, mask = left_padded(prompts)
    out = verifier.generate(ids, attention_mask=mask, assistant_model=drafter, kv_budget=24,
                            prompt_lookup_num_tokens=3, max_new_tokens=24, do_sample=False)
    assert static_engine.current_engine(verifier).spec.batch == 3
    width = ids.shape[1]
    for b, p in enumerate(prompts):
        assert torch.equal(out[b, width:], verifier.generate(p, max_new_tokens=24, do_sample=False)[0, p.shape[1] :]), b
    ids = prompts[0]
    out = verifier.generate(ids, assistant_model=drafter, kv_budget=24, prompt_lookup_num_tokens=3, do_sample=True,
                            top_k=1, max_new_tokens=24)
    assert static_engine.current_engine(verifier).warpers is not None
    assert torch.equal(out, verifier.generate(ids, max_new_tokens=24, do_sample=False))


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_tree_rounds_under_host_side_rules(arch):
    """A processor the device cannot apply (an n-gram ban) moves the rounds' choices to the host, which verifies both
    branches of each tree after their own prefixes: greedy gives stock's tokens and scores; sampling with top_k=1
    gives greedy's tokens."""
    verifier, drafter = tiny_model(arch), tiny_model(arch, role="drafter")
    ids = _repetitive_prompt(21)
    kwargs = dict(max_new_tokens=30, eos_token_id=None, pad_token_id=0, no_repeat_ngram_size=4,
                  return_dict_in_generate=True, output_scores=True)
    ours = verifier.generate(ids, assistant_model=drafter, kv_budget=24, prompt_lookup_num_tokens=3,
                             do_sample=False, **kwargs)
    engine = static_engine.current_engine(verifier)
    assert engine.spec.host and engine.spec.retrieval == 2
    stock = stock_generate(verifier, ids, do_sample=False, **kwargs)
    assert torch.equal(ours.sequences, stock.sequences)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ours.scores, stock.scores))
    assert ours.spec_stats.retrieved_rounds > 0
    sampled = verifier.generate(ids, assistant_model=drafter, kv_budget=24, prompt_lookup_num_tokens=3,
                                do_sample=True, top_k=1, **kwargs)
    assert torch.equal(sampled.sequences, stock.sequences)


@pytest.mark.extended
def test_sampled_retrieval_beside_a_drafter_matches_the_exact_joint_distribution():
    """Two sampled tokens per call; the second one's round verifies a tree (the drafter's draft and a retrieved,
    one-hot, one) where the first token occurs in the prompt, else the drafter's draft alone: the joint distribution
    is stock sampling's, exactly enumerated
    (chi-square and TV over 2,500 draws)."""
    from .test_sampling import VOCAB, WARPERS, _consistent, _joint, _tiny

    model, drafter = _tiny(2, seed=0, width=32), _tiny(1, seed=3, width=32)
    base = torch.randint(3, 9, (1, 10), generator=torch.Generator().manual_seed(6))  # 6 of the 16 ids
    ids = torch.cat([base, base[:, :7]], 1)
    joint = _joint(model, ids)
    torch.manual_seed(12)
    samples = []
    for _ in range(2500):
        out = model.generate(ids, assistant_model=drafter, draft_cache="full", do_sample=True, max_new_tokens=2,
                             min_new_tokens=2, eos_token_id=None, prompt_lookup_num_tokens=1, **WARPERS)
        samples.append(int(out[0, -2]) * VOCAB + int(out[0, -1]))
    assert static_engine.current_engine(model).spec.retrieval == 2
    samples = torch.tensor(samples)
    first_in_prompt = torch.isin(samples // VOCAB, ids[0])
    assert 0 < int(first_in_prompt.sum()) < samples.numel()  # both kinds of round were drawn
    assert _consistent(samples, joint)
    counts = torch.bincount(samples, minlength=VOCAB * VOCAB).double() / samples.numel()
    assert float(0.5 * (counts - joint).abs().sum()) < 0.08


# ---------------------------------------------------------------- stock's prompt lookup as stock serves it (issue 53)


def assert_same_cache(ours, stock, columns=None, atol=1e-8):
    """``ours`` holds what ``stock`` (a generate() output's cache) holds: the same length, and the same keys and
    values in every layer (float tolerance ``atol``; ``columns``: only those of each row, ``{row: slice}``)."""
    from transformers import DynamicCache

    assert isinstance(ours, DynamicCache) and ours.get_seq_length() == stock.get_seq_length()
    for mine, theirs in zip(ours.layers, stock.layers, strict=True):
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            assert a.shape == b.shape
            for row, cols in (columns or {r: slice(None) for r in range(a.shape[0])}).items():
                torch.testing.assert_close(a[row, :, cols], b[row, :, cols], rtol=0, atol=atol)


def returned_cache(out):
    """The cache field of a generate() output (``cache`` from transformers 5.24 on, before it ``past_key_values``)."""
    from hf_sparsekv.cache_keyword import output_field

    return getattr(out, output_field(type(out)))


def test_prompt_lookup_returns_and_extends_a_cache_asstock_generate():
    """Stock's prompt lookup on the engine returns the cache of the whole sequence but its last token (a new one, or
    the caller's empty ``DynamicCache(config=...)`` extended in place), holding what stock greedy's does."""
    from transformers import DynamicCache

    from hf_sparsekv.cache_keyword import cache_keyword

    model = tiny_model("llama")
    ids = _repetitive_prompt(7)
    settings = dict(max_new_tokens=16, do_sample=False, return_dict_in_generate=True)
    stock = model.generate(ids, **settings)
    out = model.generate(ids, prompt_lookup_num_tokens=3, **settings)
    assert static_engine.current_engine(model).spec.mode == "lookup"
    assert torch.equal(out.sequences, stock.sequences)
    assert_same_cache(returned_cache(out), returned_cache(stock))
    mine = DynamicCache(config=model.config)
    plain = model.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=16, do_sample=False,
                           **{cache_keyword(model): mine})
    assert torch.equal(plain, stock.sequences)
    assert_same_cache(mine, returned_cache(stock))
    mine = DynamicCache(config=model.config)
    out = model.generate(ids, prompt_lookup_num_tokens=3, **{cache_keyword(model): mine}, **settings)
    assert returned_cache(out) is mine
    assert_same_cache(mine, returned_cache(stock))


def test_prompt_lookup_the_engine_cannot_serve_is_stocks():
    """A pad id inside the prompt without attention_mask: stock masks it (with its warning), which the engine cannot,
    so stock's own prompt lookup serves the call; use_cache=False raises stock's RuntimeError."""
    model = tiny_model("llama")
    ids = _repetitive_prompt(8)
    ids[0, 6] = model.config.pad_token_id
    settings = dict(prompt_lookup_num_tokens=3, max_new_tokens=10, do_sample=False)
    static_engine.release_engines()
    assert torch.equal(model.generate(ids, **settings), stock_generate(model, ids, **settings))
    assert static_engine.current_engine(model) is None
    with pytest.raises(RuntimeError, match="Assisted decoding requires a cache"):
        model.generate(_repetitive_prompt(8), use_cache=False, **settings)
