"""Sequence-dependent logits processors (repetition penalty, n-gram and bad-word bans, forced and suppressed tokens,
sequence bias, length penalty): greedy output and scores equal stock ``generate()``'s on every architecture and mode,
and speculative sampling draws from the exact distribution stock sampling defines with them."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessorList,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from hf_sparsekv import HierarchicalQuantCache
from hf_sparsekv.generation import engine as static_engine
from hf_sparsekv.generation.sampling import stock_processors

from .conftest import ARCHS, left_padded, prompt, tiny_model
from .test_sampling import _consistent

# Each set changes stock greedy's output on the prompts below (checked by the first test).
OPTION_SETS = {
    "repetition": dict(repetition_penalty=1.6),
    "ngram": dict(no_repeat_ngram_size=2),
    "bans": dict(bad_words_ids=[[41], [85, 18], [95, 54]], suppress_tokens=[48, 23, 81],
                 begin_suppress_tokens=[44, 79, 58, 72, 19, 69]),
    "bias-forced": dict(sequence_bias={(23,): 5.0, (85, 18): -9.0}, exponential_decay_length_penalty=(4, 1.6),
                        forced_eos_token_id=2, forced_bos_token_id=15, eos_token_id=2),
    "prompt-side": dict(encoder_repetition_penalty=0.5, encoder_no_repeat_ngram_size=2, remove_invalid_values=True),
}
MODES = ("chunk", "window", "full", "int4-self")
GREEDY = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)


def _spec(verifier, arch: str, mode: str, gamma: int) -> dict:
    if mode == "int4-self":
        return dict(assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=16),
                    num_assistant_tokens=gamma)
    spec = dict(assistant_model=tiny_model(arch, role="drafter"), draft_cache=mode, num_assistant_tokens=gamma)
    if mode != "full":
        spec["kv_budget"] = 16
    return spec


def _stock(verifier, ids, mode: str, **kwargs):
    cache = dict(past_key_values=HierarchicalQuantCache(group_size=16)) if mode == "int4-self" else {}
    return verifier.generate(ids, **cache, **kwargs)


@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_each_option_set_changes_stock_greedy(name):
    verifier = tiny_model("llama")
    changed = [not torch.equal(verifier.generate(ids, **GREEDY), verifier.generate(ids, **{**GREEDY, **OPTION_SETS[name]}))
               for ids in (prompt(40, 1), prompt(9, 2))]
    assert any(changed)


def _greedy_cases():
    """Every (option set, mode) on one architecture by default, rotating through ARCHS; the other pairs are marked
    extended (make test-extended)."""
    cases = []
    for i, name in enumerate(OPTION_SETS):
        for j, mode in enumerate(MODES):
            for k, arch in enumerate(ARCHS):
                default = k == (i + j) % len(ARCHS)
                cases.append(pytest.param(arch, name, mode, marks=() if default else (pytest.mark.extended,),
                                          id=f"{arch}-{name}-{mode}"))
    return cases


@pytest.mark.parametrize("arch,name,mode", _greedy_cases())
def test_greedy_with_processors_equals_stock(arch, name, mode):
    static_engine.release_engines()
    verifier = tiny_model(arch)
    for seed, (length, gamma) in enumerate([(40, 3), (9, 5), (70, 1), (1, 2)]):
        ids = prompt(length, seed + 10)
        kwargs = {**GREEDY, "return_dict_in_generate": True, "output_scores": True, **OPTION_SETS[name]}
        stock = _stock(verifier, ids, mode, **kwargs)
        ours = verifier.generate(ids, **_spec(verifier, arch, mode, gamma), **kwargs)
        assert torch.equal(ours.sequences, stock.sequences), (seed, length, gamma)
        torch.testing.assert_close(torch.cat(ours.scores), torch.cat(stock.scores), rtol=1e-9, atol=1e-9)
        assert static_engine.current_engine(verifier).spec.host  # the scores are kept: host-side rules
    static_engine.release_engines()


@pytest.mark.parametrize("batch", [1, 3])
def test_the_static_loop_applies_a_config_repetition_penalty(batch):
    """A repetition penalty from the model's own generation config (as
    Qwen2.5-Instruct ships one) is applied on the device by the static loop itself (a seen-token mask per row): each
    row is what stock greedy gives for its prompt alone."""
    import copy

    static_engine.release_engines()
    verifier = copy.deepcopy(tiny_model("qwen2"))
    verifier.generation_config.repetition_penalty = 1.6
    drafter = tiny_model("qwen2", role="drafter")
    prompts = [prompt(n, 20 + n) for n in (30, 12, 21)[:batch]]
    ids, mask = left_padded(prompts)
    width = ids.shape[1]
    out = verifier.generate(ids, attention_mask=mask, assistant_model=drafter, kv_budget=16, **GREEDY)
    engine = static_engine.current_engine(verifier)
    assert engine is not None and engine.spec.penalty == (1.6, 0) and engine.spec.batch == batch
    for row, p in enumerate(prompts):
        want = verifier.generate(p, **GREEDY)[0, p.shape[1]:]
        assert torch.equal(out[row, width:], want), row
    plain = copy.deepcopy(tiny_model("qwen2"))
    assert not torch.equal(plain.generate(prompts[0], **GREEDY), verifier.generate(prompts[0], **GREEDY))
    static_engine.release_engines()


def _penalty_cases():
    """Every mode with a penalty above 1 (discourages repeats) or below 1 (favours them), alternating, rotating
    through ARCHS; the other penalty of each mode is extended."""
    return [pytest.param(ARCHS[(i + j) % len(ARCHS)], mode, penalty, id=f"{mode}-{penalty}",
                         marks=() if (i + j) % 2 == 0 else (pytest.mark.extended,))
            for i, mode in enumerate(MODES) for j, penalty in enumerate((1.6, 0.7))]


@pytest.mark.parametrize("arch,mode,penalty", _penalty_cases())
def test_static_loop_repetition_penalty_equals_stock_greedy(arch, mode, penalty):
    """The static loop's device-side repetition penalty (drafts, verification, the first token): the same tokens as
    stock greedy generate() with the penalty, for several prompts and γ."""
    static_engine.release_engines()
    verifier = tiny_model(arch)
    changed = False
    for seed, (length, gamma) in enumerate([(40, 3), (9, 5), (70, 1), (1, 2)]):
        ids = prompt(length, seed + 30)
        kwargs = {**GREEDY, "repetition_penalty": penalty, "max_new_tokens": 32}
        stock = _stock(verifier, ids, mode, **kwargs)
        ours = verifier.generate(ids, **_spec(verifier, arch, mode, gamma), **kwargs)
        assert torch.equal(ours, stock), (seed, length, gamma)
        assert static_engine.current_engine(verifier).spec.penalty == (penalty, 0)
        changed |= not torch.equal(stock, _stock(verifier, ids, mode, **{**GREEDY, "max_new_tokens": 32}))
    assert changed  # the penalty changes the output of at least one prompt
    static_engine.release_engines()


SAMPLING_VOCAB = 16
SAMPLING = dict(repetition_penalty=1.8, no_repeat_ngram_size=2, temperature=0.8, top_k=6)


def _tiny_sampler(layers: int, seed: int, width: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=SAMPLING_VOCAB, hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return model


def _next_token_probs(model, ids: torch.Tensor, ngram: bool = True) -> torch.Tensor:
    """Stock sampling's next-token distribution under SAMPLING (without its n-gram ban unless ``ngram``), in float64
    (stock processor order: penalty, n-gram ban, then the warpers)."""
    processors = LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(SAMPLING["repetition_penalty"]),
        *([NoRepeatNGramLogitsProcessor(SAMPLING["no_repeat_ngram_size"])] if ngram else []),
        TemperatureLogitsWarper(SAMPLING["temperature"]), TopKLogitsWarper(SAMPLING["top_k"]),
    ])
    with torch.no_grad():
        logits = model(ids).logits[:, -1].double()
    return torch.softmax(processors(ids, logits), -1)[0]


@pytest.mark.extended  # ~390 s of CPU: make test-extended
def test_sampling_with_processors_matches_the_exact_joint_distribution():
    """The second token's distribution depends on the first through both processors; 2,500 draws of the pair
    against the exactly enumerated joint (chi-square and total variation, as tests/test_sampling.py)."""
    static_engine.release_engines()
    verifier, drafter = _tiny_sampler(2, seed=0, width=32), _tiny_sampler(1, seed=1, width=16)
    ids = torch.randint(3, SAMPLING_VOCAB, (1, 10), generator=torch.Generator().manual_seed(6))
    first = _next_token_probs(verifier, ids)
    joint = torch.stack([first[a] * _next_token_probs(verifier, torch.cat([ids, torch.tensor([[a]])], 1))
                         for a in range(SAMPLING_VOCAB)]).flatten()
    torch.manual_seed(321)
    samples = []
    for _ in range(2500):
        out = verifier.generate(ids, do_sample=True, max_new_tokens=2, min_new_tokens=2, eos_token_id=None,
                                assistant_model=drafter, kv_budget=8, num_assistant_tokens=3,
                                **SAMPLING)
        samples.append(int(out[0, -2]) * SAMPLING_VOCAB + int(out[0, -1]))
    samples = torch.tensor(samples)
    assert static_engine.current_engine(verifier).spec.host  # the n-gram ban: host-side rules on the static engine
    assert _consistent(samples, joint)
    counts = torch.bincount(samples, minlength=SAMPLING_VOCAB**2).double() / samples.numel()
    assert float(0.5 * (counts - joint).abs().sum()) < 0.08  # TV distance at 2,500 samples over <= 36 cells
    # the processors matter here: without them the joint is far from this one
    with torch.no_grad():
        plain = torch.softmax(verifier(ids).logits[0, -1].double() / SAMPLING["temperature"], -1)
    assert float(0.5 * (plain - first).abs().sum()) > 0.1


@pytest.mark.extended  # ~400 s of CPU: make test-extended
def test_static_sampling_with_repetition_penalty_matches_the_exact_joint_distribution():
    """The static loop's device-side penalty while sampling (drafts' q and the verifier's p both penalized after
    their exact prefixes): 2,500 draws of two tokens against the exactly enumerated joint."""
    static_engine.release_engines()
    verifier, drafter = _tiny_sampler(2, seed=0, width=32), _tiny_sampler(1, seed=1, width=16)
    ids = torch.randint(3, SAMPLING_VOCAB, (1, 10), generator=torch.Generator().manual_seed(6))
    first = _next_token_probs(verifier, ids, ngram=False)
    joint = torch.stack([first[a] * _next_token_probs(verifier, torch.cat([ids, torch.tensor([[a]])], 1), False)
                         for a in range(SAMPLING_VOCAB)]).flatten()
    options = {k: v for k, v in SAMPLING.items() if k != "no_repeat_ngram_size"}
    torch.manual_seed(322)
    samples = []
    for _ in range(2500):
        out = verifier.generate(ids, do_sample=True, max_new_tokens=2, min_new_tokens=2, eos_token_id=None,
                                assistant_model=drafter, kv_budget=8, num_assistant_tokens=3, **options)
        samples.append(int(out[0, -2]) * SAMPLING_VOCAB + int(out[0, -1]))
    samples = torch.tensor(samples)
    assert static_engine.current_engine(verifier).spec.penalty == (SAMPLING["repetition_penalty"], 0)
    assert _consistent(samples, joint)
    counts = torch.bincount(samples, minlength=SAMPLING_VOCAB**2).double() / samples.numel()
    assert float(0.5 * (counts - joint).abs().sum()) < 0.08
    static_engine.release_engines()


@pytest.mark.parametrize("mode", ["full", "int4-self"])
def test_drafts_follow_the_processors(mode):
    """A drafter identical to the verifier on a full cache has every draft accepted only if its drafts go through the
    same sequence-dependent processors (raw argmax drafts are rejected where the penalty changes the choice); the
    int4 view drafts through them too."""
    import copy

    static_engine.release_engines()
    verifier = tiny_model("llama")
    ids = prompt(40, 1)
    kwargs = {**GREEDY, **OPTION_SETS["repetition"], "return_dict_in_generate": True, "num_assistant_tokens": 4}
    if mode == "full":
        spec = dict(assistant_model=copy.deepcopy(verifier), draft_cache="full")
    else:
        spec = dict(assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=16))
    out = verifier.generate(ids, **spec, **kwargs)
    assert torch.equal(out.sequences, _stock(verifier, ids, mode, **kwargs).sequences)
    if mode == "full":
        assert out.spec_stats.drafted > 0 and out.spec_stats.acceptance_rate == 1.0
    else:  # the INT4 view mostly agrees with the INT8 one once both apply the penalty
        assert out.spec_stats.acceptance_rate > 0.5
    assert static_engine.current_engine(verifier) is not None
    static_engine.release_engines()


def test_a_row_sequence_reads_as_its_list_and_keeps_its_prompt_on_the_device(monkeypatch):
    """RowSequence answers len, indexing and slicing as ``prompt.tolist() + new`` does, and a sequence buffer fed
    from it holds the same tensor; a greedy call without host rules never brings a row's prompt to the host (the
    stop rules read only the length and the last token), and its output is stock greedy's."""
    from hf_sparsekv.generation import rounds
    from hf_sparsekv.generation.host_rules import RowSequence, SequenceBuffer

    ids = prompt(37, seed=8)
    row, reference = RowSequence(ids), ids[0].tolist()
    for token in (5, 9, 11):
        row.append(token)
        reference.append(token)
    for index in (-1, -3, 0, 36, 37, 39, slice(37, None), slice(38, 40), slice(40, 45), slice(0, 3), slice(30, 39),
                  slice(-2, None), slice(None, 5)):
        assert row[index] == reference[index], index
    assert len(row) == len(reference)
    listed, fed = SequenceBuffer(torch.device("cpu")), SequenceBuffer(torch.device("cpu"))
    assert torch.equal(fed.view(RowSequence(ids)), listed.view(ids[0].tolist()))
    assert torch.equal(fed.view(row), listed.view(reference)) and torch.equal(fed.view(row), torch.tensor([reference]))

    made = []
    monkeypatch.setattr(rounds, "RowSequence", lambda p: made.append(RowSequence(p)) or made[-1])
    model, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=2, pad_token_id=0)
    out = model.generate(ids, assistant_model=drafter, kv_budget=16, **kwargs)
    assert torch.equal(out, model.generate(ids, **kwargs))
    assert made and all(r._prompt_list is None for r in made)


@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_a_rows_processors_leave_the_calls_config_as_it_was(name):
    """:func:`stock_processors` works on a shallow copy of the call's config (each row of a batch builds its own from
    the same config): the config keeps every attribute, and the list equals the one built from a deep copy."""
    model = tiny_model("llama")
    config = copy.deepcopy(model.generation_config)
    config.update(**OPTION_SETS[name], min_length=4, max_length=60)
    before = copy.deepcopy(vars(config))
    ids = prompt(9, 2)[:1]
    built = stock_processors(model, config, ids, None, min_length=1, max_length=50)
    assert vars(config) == before
    reference = stock_processors(model, copy.deepcopy(config), ids, None, min_length=1, max_length=50)
    assert [repr(vars(p)) for p in built] == [repr(vars(p)) for p in reference] and len(built) > 0
