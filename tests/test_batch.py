"""Batch size > 1 (left-padded prompts with an attention mask): each row of the speculative output is the stock greedy
output of that prompt alone, followed by padding where the row stopped early; per-row statistics add up to the
totals. Reference: stock greedy ``generate()`` on each unpadded prompt."""

from __future__ import annotations

import copy
import random

import pytest
import torch

import hf_sparsekv
from hf_sparsekv.generation import engine as static_engine

from .conftest import ARCHS, left_padded, prompt, tiny_model

PAD = 0  # the tiny models' pad_token_id


def _check_engine(verifier, rows: int) -> None:
    """Every greedy mode: one engine of all rows."""
    engine = static_engine.current_engine(verifier)
    assert engine is not None and engine.spec.batch == rows


def _spec(mode: str, verifier, drafter) -> dict:
    return {
        "chunk": dict(assistant_model=drafter, kv_budget=16),
        "window": dict(assistant_model=drafter, draft_cache="window", kv_budget=24),
        "full": dict(assistant_model=drafter, draft_cache="full"),
        "int4-self": dict(assistant_model=verifier, draft_cache="int4"),
        "window-self": dict(assistant_model=verifier, draft_cache="window", kv_budget=24),
    }[mode]


def _reference(verifier, p: torch.Tensor, mode: str, **kwargs) -> torch.Tensor:
    """Greedy AR of one unpadded prompt (int4: on the INT8 view, which self-speculation is lossless against)."""
    if mode == "int4-self":
        kwargs["past_key_values"] = hf_sparsekv.HierarchicalQuantCache()
    return verifier.generate(p, do_sample=False, **kwargs)[0, p.shape[1] :]


def _assert_rows(out: torch.Tensor, prompts, references, width: int) -> None:
    assert out.shape[0] == len(prompts)
    for b, (p, ref) in enumerate(zip(prompts, references)):
        row = out[b]
        assert torch.equal(row[width - p.shape[1] : width], p[0]), b  # the prompt, left-padded, unchanged
        assert torch.equal(row[:width - p.shape[1]], torch.full((width - p.shape[1],), PAD)), b
        assert torch.equal(row[width : width + ref.shape[0]], ref), b
        assert bool((row[width + ref.shape[0] :] == PAD).all()), b  # padding after an early stop, as stock


def _cases(n=15, seed=4):
    rng = random.Random(seed)
    modes = ["chunk", "window", "full", "int4-self", "window-self"]
    cases = []
    for i in range(n):
        arch = ARCHS[i % len(ARCHS)]
        lengths = [rng.choice([1, 2, 7, 33, 90, 170, 257, 400]) for _ in range(rng.randint(2, 5))]
        # γ changes every len(modes) cases, so every (mode, γ) and every (architecture, γ) pair is covered
        case = (arch, modes[i % len(modes)], (1, 3, 5)[(i // len(modes)) % 3], tuple(lengths), rng.randint(0, 10**6))
        # The first len(modes) cases cover every mode and architecture; the rest vary γ and lengths: extended.
        cases.append(case if i < len(modes) else pytest.param(*case, marks=pytest.mark.extended))
    return cases


@pytest.mark.parametrize("arch,mode,gamma,lengths,seed", _cases())
def test_each_row_equals_its_prompt_alone(arch, mode, gamma, lengths, seed):
    verifier, drafter = tiny_model(arch), tiny_model(arch, role="drafter")
    prompts = [prompt(n, seed + i) for i, n in enumerate(lengths)]
    ids, mask = left_padded(prompts)
    out = verifier.generate(ids, attention_mask=mask, max_new_tokens=12, num_assistant_tokens=gamma,
                            return_dict_in_generate=True, **_spec(mode, verifier, drafter))
    _check_engine(verifier, len(prompts))
    references = [_reference(verifier, p, mode, max_new_tokens=12) for p in prompts]
    _assert_rows(out.sequences, prompts, references, ids.shape[1])
    stats = out.spec_stats
    assert stats.prompts == len(prompts) and len(stats.rows) == len(prompts)
    assert [r.new_tokens for r in stats.rows] == [ref.shape[0] for ref in references]
    assert stats.new_tokens == sum(ref.shape[0] for ref in references)
    assert stats.accepted == sum(r.accepted for r in stats.rows) and stats.rounds == sum(r.rounds for r in stats.rows)
    assert stats.mean_accepted_length == pytest.approx((stats.new_tokens - len(prompts)) / stats.rounds)


def test_eos_in_one_row_while_the_others_go_on():
    verifier, drafter = tiny_model("qwen2"), tiny_model("qwen2", role="drafter")
    prompts = [prompt(n, 50 + n) for n in (40, 9, 120)]
    free = [_reference(verifier, p, "chunk", max_new_tokens=20) for p in prompts]
    # An EOS id that row 0 produces early and the other rows never produce within 20 tokens.
    candidates = [int(t) for t in free[0][:8] if all(int(t) not in f.tolist() for f in free[1:])]
    assert candidates, "pick other prompts: no token of row 0 is absent from the other rows"
    eos = candidates[0]
    ids, mask = left_padded(prompts)
    kwargs = dict(max_new_tokens=20, eos_token_id=eos)
    out = verifier.generate(ids, attention_mask=mask, assistant_model=drafter, kv_budget=16, **kwargs)
    _check_engine(verifier, len(prompts))
    references = [_reference(verifier, p, "chunk", **kwargs) for p in prompts]
    assert references[0].shape[0] < 20 and references[0][-1] == eos
    assert all(r.shape[0] == 20 for r in references[1:])
    assert out.shape[1] == ids.shape[1] + 20
    _assert_rows(out, prompts, references, ids.shape[1])


def test_rejected_and_accepted_rows_side_by_side():
    """One drafter that agrees with the verifier on every prompt without token 5 and is wrong wherever token 5
    was seen (its embedding of 5 is scrambled): a row of all-rejected drafts beside a row of all-accepted ones."""
    verifier = tiny_model("llama")
    drafter = copy.deepcopy(verifier)
    with torch.no_grad():
        drafter.model.embed_tokens.weight[5] = -50.0 * drafter.model.embed_tokens.weight[5].flip(0)
    clean = prompt(60, 3)
    clean = clean[:, (clean[0] != 5)][:, :50]
    poisoned = torch.full((1, 30), 5)
    prompts = [clean, poisoned]
    ids, mask = left_padded(prompts)
    out = verifier.generate(ids, attention_mask=mask, assistant_model=drafter, draft_cache="full",
                            max_new_tokens=16, num_assistant_tokens=3, return_dict_in_generate=True)
    _check_engine(verifier, len(prompts))
    references = [_reference(verifier, p, "full", max_new_tokens=16) for p in prompts]
    _assert_rows(out.sequences, prompts, references, ids.shape[1])
    accepted_row, rejected_row = out.spec_stats.rows
    assert 5 not in references[0].tolist()
    assert accepted_row.acceptance_rate == 1.0
    assert rejected_row.acceptance_rate < 0.35


@pytest.mark.parametrize("arch", [a if a == "llama" else pytest.param(a, marks=pytest.mark.extended) for a in ARCHS])
def test_int4_rows_cross_quantization_points_at_their_own_rounds(arch, monkeypatch):
    """Self-speculation with G = 16 and γ = 5 on rows whose lengths put them at different phases of their groups:
    the quantization state moves every 16 tokens, so in many rounds one row may keep only part of its block (its
    cap) while the others draft in full. Each row equals greedy AR of its prompt alone on the INT8 view."""
    verifier = tiny_model(arch)
    prompts = [prompt(n, 7 * n) for n in (20, 31, 47, 90)]
    ids, mask = left_padded(prompts)
    caps = []
    verify = static_engine.StaticEngine._verify
    monkeypatch.setattr(static_engine.StaticEngine, "_verify",
                        lambda self: (caps.append((self.cap.tolist(), list(self.caps_held))), verify(self))[1])
    out = verifier.generate(ids, attention_mask=mask, assistant_model=verifier, num_assistant_tokens=5,
                            draft_cache=hf_sparsekv.HierarchicalQuantCache(group_size=16), max_new_tokens=40)
    _check_engine(verifier, len(prompts))
    references = [
        verifier.generate(p, do_sample=False, max_new_tokens=40,
                          past_key_values=hf_sparsekv.HierarchicalQuantCache(group_size=16))[0, p.shape[1] :]
        for p in prompts
    ]
    _assert_rows(out, prompts, references, ids.shape[1])
    assert any(min(c) < 5 and max(c) == 5 for c, _ in caps)  # one row's cap cut its block, another drafted in full
    assert all(c == held for c, held in caps)  # a round copies its caps only where they changed: none is stale


def test_a_draft_cache_instance_serves_every_row():
    verifier, drafter = tiny_model("mistral"), tiny_model("mistral", role="drafter")
    prompts = [prompt(n, n) for n in (70, 20)]
    ids, mask = left_padded(prompts)
    cache = hf_sparsekv.ChunkBudgetCache(16)
    out = verifier.generate(ids, attention_mask=mask, assistant_model=drafter, draft_cache=cache, max_new_tokens=8)
    _assert_rows(out, prompts, [_reference(verifier, p, "chunk", max_new_tokens=8) for p in prompts], ids.shape[1])
    assert cache.get_seq_length() == 0  # the caller's instance is left as it was given


@pytest.mark.parametrize("extra,error,match", [
    (dict(streamer="streamer"), ValueError, "streamer"),
    (dict(output_logits=True, return_dict_in_generate=True), NotImplementedError, "output_logits"),
    (dict(past_key_values="prefix"), NotImplementedError, "prompt caching"),
    (dict(num_beams=2), NotImplementedError, "num_beams"),
])
def test_what_a_batch_refuses(extra, error, match):
    from transformers import DynamicCache
    from transformers.generation.streamers import BaseStreamer

    verifier, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    ids, mask = left_padded([prompt(12, 1), prompt(30, 2)])
    extra = dict(extra)
    if extra.get("streamer") == "streamer":
        extra["streamer"] = BaseStreamer()
    if extra.get("past_key_values") == "prefix":
        extra["past_key_values"] = DynamicCache()
    with pytest.raises(error, match=match):
        verifier.generate(ids, attention_mask=mask, assistant_model=drafter, kv_budget=16, max_new_tokens=4, **extra)


@pytest.mark.parametrize("mode", ["chunk", "window-self", "full"])
def test_a_sampled_batch_runs_its_rows_together(mode):
    """Sampling with top_k=1 draws each row's argmax: the rows, decoded together on one engine with the sampling
    steps (warpers baked in), equal each prompt's greedy output alone."""
    verifier, drafter = tiny_model("qwen2"), tiny_model("qwen2", role="drafter")
    prompts = [prompt(n, seed) for n, seed in ((30, 1), (7, 2), (90, 3))]
    ids, mask = left_padded(prompts)
    out = verifier.generate(ids, attention_mask=mask, do_sample=True, top_k=1, max_new_tokens=12,
                            **_spec(mode, verifier, drafter))
    engine = static_engine.current_engine(verifier)
    assert engine.spec.batch == len(prompts) and engine.warpers is not None  # together, sampling
    _assert_rows(out, prompts, [_reference(verifier, p, mode, max_new_tokens=12) for p in prompts], ids.shape[1])


@pytest.mark.extended
def test_sampled_rows_together_each_draw_from_their_own_prompts_distribution():
    """Two rows of different lengths sampled together (chunk drafter, γ = 3, temperature/top-k/top-p): each row's
    two new tokens follow the exact joint distribution of stock sampling on its own prompt (chi-square and TV over
    2,500 draws per row); the second token is the first round's verification."""
    from .test_sampling import VOCAB, WARPERS, _consistent, _joint, _tiny

    verifier, drafter = _tiny(2, seed=0, width=32), _tiny(1, seed=1, width=16)
    prompts = [torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in (40, 23)]
    ids, mask = left_padded(prompts)
    joints = [_joint(verifier, p) for p in prompts]
    torch.manual_seed(7)
    draws = [[], []]
    for _ in range(2500):
        out = verifier.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=2, min_new_tokens=2,
                                eos_token_id=None, pad_token_id=0, assistant_model=drafter, kv_budget=16,
                                num_assistant_tokens=3, **WARPERS)
        for b in range(2):
            draws[b].append(int(out[b, -2]) * VOCAB + int(out[b, -1]))
    assert static_engine.current_engine(verifier).spec.batch == 2
    for b in range(2):
        samples = torch.tensor(draws[b])
        assert _consistent(samples, joints[b]), b
        counts = torch.bincount(samples, minlength=VOCAB * VOCAB).double() / samples.numel()
        assert float(0.5 * (counts - joints[b]).abs().sum()) < 0.08, b


def test_a_sampled_int4_engine_takes_one_row():
    """A sampled int4 batch is decoded row by row (front); an int4 engine asked for sampled rows together refuses
    rather than cut a sampled block at a row's quantization cap."""
    verifier = tiny_model("llama")
    with pytest.raises(NotImplementedError, match="one row at a time"):
        static_engine.engine_for(verifier, verifier, "int4", 16, 3, 64, 16, use_graphs=False, warpers=[], batch=2)
    static_engine.release_engines()


def test_padded_batch_without_attention_mask_is_masked_as_stock_infers_it():
    """No attention_mask: stock generate() infers it from pad_token_id (not an EOS id), so the speculative output is
    stock's greedy batch output, and each row its prompt alone; a pad id inside a prompt is refused, naming it."""
    verifier, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    prompts = [prompt(n, 60 + n) for n in (40, 11)]
    ids, _ = left_padded(prompts)
    out = verifier.generate(ids, assistant_model=drafter, kv_budget=16, max_new_tokens=10)
    assert torch.equal(out, verifier.generate(ids, max_new_tokens=10, do_sample=False))
    _assert_rows(out, prompts, [_reference(verifier, p, "chunk", max_new_tokens=10) for p in prompts], ids.shape[1])
    inside = ids.clone()
    inside[1, -3] = PAD
    with pytest.raises(ValueError, match=f"pad_token_id={PAD} where it is not left padding"):
        verifier.generate(inside, assistant_model=drafter, kv_budget=16, max_new_tokens=4)


def test_padded_batch_with_pad_equal_to_eos_warns_as_stock(caplog):
    """pad_token_id == eos_token_id: stock cannot infer the mask and warns; so do we, and both treat the padding
    as tokens (the same output)."""
    from transformers.utils import logging as hf_logging

    verifier, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    ids, _ = left_padded([prompt(30, 1), prompt(12, 2)])
    hf_logging.enable_propagation()
    try:
        hf_logging.get_logger("transformers.generation.utils").warning_once.cache_clear()  # (once per process)
        caplog.clear()
        with caplog.at_level("WARNING", logger="transformers.generation.utils"):
            out = verifier.generate(ids, assistant_model=drafter, kv_budget=16, max_new_tokens=6, pad_token_id=2,
                                    eos_token_id=2)
        ours = [r.getMessage() for r in caplog.records]
        reference = verifier.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=2, eos_token_id=2)
    finally:
        hf_logging.disable_propagation()
    assert torch.equal(out, reference)
    assert any("cannot be inferred from input because pad token is same as eos token" in m for m in ours), ours


def test_a_row_by_row_batch_logs_only_at_debug_level(caplog):
    """A sampled int4 batch (decoded one row after another) says so only at debug level: nothing at
    the default verbosity (warnings), in any call of the process."""
    from transformers.utils import logging as hf_logging

    verifier = tiny_model("llama")
    ids, mask = left_padded([prompt(20, 1), prompt(9, 2)])
    hf_logging.enable_propagation()
    try:
        logging_module = __import__("logging")
        logging_module.Logger.warning_once.cache_clear()  # as in a fresh process
        with caplog.at_level("DEBUG", logger="hf_sparsekv"):
            verifier.generate(ids, attention_mask=mask, assistant_model=verifier, draft_cache="int4", max_new_tokens=3,
                              do_sample=True)
    finally:
        hf_logging.disable_propagation()
    ours = [r for r in caplog.records if r.name.startswith("hf_sparsekv") and "one row after another" in r.getMessage()]
    assert ours and all(r.levelname == "DEBUG" for r in ours)


@pytest.mark.parametrize("how", ["together", "row by row"])
def test_a_batch_returns_the_cache_stock_greedy_returns(how):
    """return_dict_in_generate with a left-padded batch: the output's cache has the shape of stock greedy's and, in
    each row's own columns (its prompt and new tokens but the last), stock's keys and values; the left padding (and
    the padding after a row that ended early: keys of pad tokens the engine never computed) holds zeros. Row by row:
    sampled int4 self-speculation (top_k=1, prompts below two quantization groups: greedy's tokens)."""
    from .test_retrieval import assert_same_cache, returned_cache

    verifier, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    prompts = [prompt(n, 20 + n) for n in (40, 9, 25)]
    ids, mask = left_padded(prompts)
    settings = dict(attention_mask=mask, max_new_tokens=8, return_dict_in_generate=True)
    stock = verifier.generate(ids, do_sample=False, **settings)
    options = (dict(assistant_model=drafter, kv_budget=16, do_sample=False) if how == "together" else
               dict(assistant_model=verifier, draft_cache="int4", do_sample=True, top_k=1))
    out = verifier.generate(ids, **options, **settings)
    assert torch.equal(out.sequences, stock.sequences)
    width = ids.shape[1]
    own = {}
    for b, p in enumerate(prompts):
        new = out.sequences[b, width:].tolist()
        end = width + (new.index(2) + 1 if 2 in new else len(new))  # past its EOS, the row is padding
        own[b] = slice(width - p.shape[1], end - 1)
    cache = returned_cache(out)
    assert_same_cache(cache, returned_cache(stock), columns=own)
    for b, cols in own.items():
        assert not cache.layers[0].keys[b, :, : cols.start].any() and not cache.layers[0].keys[b, :, cols.stop :].any()
