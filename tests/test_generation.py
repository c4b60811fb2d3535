"""Speculative generate() is token-for-token greedy AR, across architectures, modes, budgets and γ."""

from __future__ import annotations

import copy
import random
import time

import pytest
import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import hf_sparsekv
from hf_sparsekv import HierarchicalQuantCache
from hf_sparsekv.generation import engine as static_engine

from .conftest import ARCHS, OTHER_ARCHS, VOCAB, prompt, tiny_model


def _copy_of(model):
    return copy.deepcopy(model)  # a separate drafter object that agrees with the verifier on a full cache


def _cases(n_per_arch=16, seed=0):
    rng = random.Random(seed)
    modes = ["chunk", "window", "full", "int4-self"]
    cases = []
    for arch in ARCHS:
        for i in range(n_per_arch):
            cases.append(
                dict(
                    arch=arch,
                    mode=modes[i % len(modes)],
                    prompt_len=rng.choice([1, 2, 7, 33, 120, 257, 400]),
                    budget=rng.choice([8, 16, 64, 512]),
                    gamma=rng.choice([1, 2, 3, 5, 8]),
                    copy_drafter=rng.random() < 0.5,
                    seed=i,
                )
            )
    return cases


@pytest.mark.parametrize("case", _cases(), ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_lossless_against_greedy_ar(case):
    verifier = tiny_model(case["arch"])
    drafter = _copy_of(verifier) if case["copy_drafter"] else tiny_model(case["arch"], role="drafter")
    ids = prompt(case["prompt_len"], seed=case["seed"])
    kwargs = dict(max_new_tokens=40, do_sample=False)
    mode = case["mode"]
    if mode == "int4-self":
        store = HierarchicalQuantCache(group_size=16)
        reference = verifier.generate(ids, past_key_values=HierarchicalQuantCache(group_size=16), **kwargs)
        spec = dict(assistant_model=verifier, draft_cache=store)
    else:
        reference = verifier.generate(ids, **kwargs)
        spec = dict(assistant_model=drafter, draft_cache=mode)
        if mode != "full":  # kv_budget with draft_cache="full" is refused (it would be ignored)
            spec["kv_budget"] = case["budget"]
    out = verifier.generate(ids, num_assistant_tokens=case["gamma"], return_dict_in_generate=True, **spec, **kwargs)
    assert torch.equal(out.sequences, reference)
    stats = out.spec_stats
    assert stats["new_tokens"] == reference.shape[1] - ids.shape[1]
    assert 0 <= stats["accepted"] <= stats["drafted"] <= case["gamma"] * stats["rounds"]


_EVERY_MODE = {  # name -> generate() arguments (the drafter: "d" a separate small model, "v" the verifier itself)
    "chunk": dict(assistant_model="d", kv_budget=16),
    "window": dict(assistant_model="d", draft_cache="window", kv_budget=16),
    "full": dict(assistant_model="d", draft_cache="full"),
    "int4-drafter": dict(assistant_model="d", draft_cache="int4"),
    "self-chunk": dict(assistant_model="v", kv_budget=16),
    "self-window": dict(assistant_model="v", draft_cache="window", kv_budget=16),
    "int4-self": dict(assistant_model="v"),
}


@pytest.mark.parametrize("mode", list(_EVERY_MODE))
@pytest.mark.parametrize("arch", OTHER_ARCHS)
def test_other_attention_layouts_are_lossless_in_every_mode(arch, mode):
    """Phi-3 (fused qkv_proj), StableLM (partial rotary) and GPT-NeoX (both) in every mode, with a budget far below
    the prompt, under SDPA and eager attention: stock greedy generate() (int4 self-speculation: greedy AR on the
    same quantized cache). Where our loop runs a prefill, the chunk selection takes the queries the attention call
    receives, whatever the module computes them with."""
    verifier = tiny_model(arch)
    spec = dict(_EVERY_MODE[mode])
    spec["assistant_model"] = verifier if spec["assistant_model"] == "v" else tiny_model(arch, role="drafter")
    ids = prompt(90, seed=len(arch) + len(mode))
    kwargs = dict(max_new_tokens=16, do_sample=False)
    if mode == "int4-self":
        reference = verifier.generate(ids, past_key_values=HierarchicalQuantCache(group_size=16), **kwargs)
        spec["draft_cache"] = HierarchicalQuantCache(group_size=16)
    else:
        reference = verifier.generate(ids, **kwargs)
    out = verifier.generate(ids, num_assistant_tokens=3, return_dict_in_generate=True, **spec, **kwargs)
    assert torch.equal(out.sequences, reference)
    assert out.spec_stats.rounds > 0
    if mode in ("self-chunk", "chunk"):  # eager too (its own modeling file's attention function)
        eager = copy.deepcopy(verifier)
        eager.set_attn_implementation("eager")
        drafter = eager if mode == "self-chunk" else spec["assistant_model"]
        again = eager.generate(ids, assistant_model=drafter, kv_budget=16, num_assistant_tokens=3, **kwargs)
        assert torch.equal(again, eager.generate(ids, **kwargs))
        assert eager.config._attn_implementation == "eager"  # restored after the prefill


@pytest.mark.parametrize("arch", ARCHS)
def test_copy_drafter_on_full_cache_accepts_everything(arch):
    verifier = tiny_model(arch)
    out = verifier.generate(
        prompt(50, 1), assistant_model=_copy_of(verifier), draft_cache="full", num_assistant_tokens=4,
        max_new_tokens=30, do_sample=False, return_dict_in_generate=True,
    )
    assert out.spec_stats["acceptance_rate"] == 1.0
    assert out.spec_stats["mean_accepted_length"] > 4.0


def _greedy_tokens(model, ids, n):
    return model.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("position", [1, 3, 6])
def test_eos_inside_an_accepted_run_stops_there(position):
    verifier = tiny_model("llama")
    ids = prompt(64, 5)
    tokens = _greedy_tokens(verifier, ids, 20)
    eos = tokens[position]
    reference = verifier.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=[eos, 2])
    out = verifier.generate(
        ids, max_new_tokens=20, do_sample=False, eos_token_id=[eos, 2], assistant_model=_copy_of(verifier),
        kv_budget=512, num_assistant_tokens=8,
    )
    assert torch.equal(out, reference)
    assert out[0, -1].item() == eos


def test_min_new_tokens_suppresses_eos_like_stock():
    verifier = tiny_model("qwen2")
    ids = prompt(30, 2)
    eos = _greedy_tokens(verifier, ids, 5)[1]
    kwargs = dict(max_new_tokens=15, min_new_tokens=6, do_sample=False, eos_token_id=eos)
    reference = verifier.generate(ids, **kwargs)
    out = verifier.generate(ids, assistant_model=_copy_of(verifier), kv_budget=16, num_assistant_tokens=3, **kwargs)
    assert torch.equal(out, reference)
    assert out.shape[1] - ids.shape[1] >= 6


def test_eos_rules_that_change_between_calls_on_one_engine_are_each_applied():
    """The engine keeps its EOS floor and EOS ids from the last call (written only where they change): calls on one
    engine alternating min_new_tokens and EOS ids each give stock's output."""
    verifier = tiny_model("qwen2")
    drafter = _copy_of(verifier)
    ids = prompt(30, 2)
    tokens = _greedy_tokens(verifier, ids, 8)
    engines = []
    for extra in (dict(min_new_tokens=6, eos_token_id=tokens[1]), dict(eos_token_id=tokens[1]),
                  dict(min_new_tokens=6, eos_token_id=tokens[1]), dict(eos_token_id=tokens[2]), dict(eos_token_id=None),
                  dict(eos_token_id=tokens[2])):
        kwargs = dict(max_new_tokens=15, do_sample=False, pad_token_id=0, **extra)
        reference = verifier.generate(ids, **kwargs)
        out = verifier.generate(ids, assistant_model=drafter, kv_budget=16, num_assistant_tokens=3, **kwargs)
        assert torch.equal(out, reference), extra
        engines.append(static_engine.current_engine(verifier))
    assert all(engine is engines[0] for engine in engines)


@pytest.mark.parametrize("mode", ["chunk", "int4"])
def test_max_new_tokens_one(mode):
    verifier = tiny_model("mistral")
    ids = prompt(40, 3)
    drafter = verifier if mode == "int4" else tiny_model("mistral", role="drafter")
    kwargs = dict(kv_budget=16) if mode == "chunk" else dict(draft_cache="int4")
    out = verifier.generate(ids, max_new_tokens=1, do_sample=False, assistant_model=drafter, **kwargs)
    assert torch.equal(out, verifier.generate(ids, max_new_tokens=1, do_sample=False))


class _Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_exactly_the_accepted_tokens_in_order():
    verifier = tiny_model("llama")
    ids = prompt(25, 4)
    stock, ours = _Collect(), _Collect()
    reference = verifier.generate(ids, max_new_tokens=20, do_sample=False, streamer=stock)
    out = verifier.generate(
        ids, max_new_tokens=20, do_sample=False, streamer=ours, assistant_model=_copy_of(verifier), kv_budget=16
    )
    assert torch.equal(out, reference)
    assert ours.chunks[0] == ids[0].tolist() and ours.ended
    assert sum(ours.chunks[1:], []) == reference[0, ids.shape[1] :].tolist()
    assert all(len(c) == 1 for c in ours.chunks[1:])


class _StopAfter(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


class _StopOnConfidentScore(StoppingCriteria):
    """Reads the scores as stock passes them (the tuple of every generated token's scores, with output_scores):
    stops once the last token's best score exceeds the second best by ``gap``."""

    def __init__(self, gap):
        self.gap = gap

    def __call__(self, input_ids, scores, **kwargs):
        top = scores[-1].topk(2, dim=-1).values
        return (top[:, 0] - top[:, 1]) > self.gap


def test_stopping_criteria_like_stock():
    verifier = tiny_model("qwen2")
    ids = prompt(45, 6)
    stop = _greedy_tokens(verifier, ids, 12)[7]
    criteria = StoppingCriteriaList([_StopAfter(stop)])
    reference = verifier.generate(ids, max_new_tokens=30, do_sample=False, stopping_criteria=criteria)
    out = verifier.generate(
        ids, max_new_tokens=30, do_sample=False, stopping_criteria=criteria, assistant_model=_copy_of(verifier),
        draft_cache="window", kv_budget=20, num_assistant_tokens=5,
    )
    assert torch.equal(out, reference)
    # a criterion that reads the scores: the static engine hands them over from its host-side rules
    scores_read = dict(stopping_criteria=StoppingCriteriaList([_StopOnConfidentScore(0.88)]), max_new_tokens=30,
                       do_sample=False, return_dict_in_generate=True, output_scores=True)
    reference = verifier.generate(ids, **scores_read)
    assert 45 < reference.sequences.shape[1] < 75  # it stops early
    out = verifier.generate(ids, assistant_model=_copy_of(verifier), kv_budget=16, num_assistant_tokens=4,
                            **scores_read)
    assert torch.equal(out.sequences, reference.sequences)
    torch.testing.assert_close(torch.cat(out.scores), torch.cat(reference.scores), rtol=1e-9, atol=1e-9)
    assert _ran_on_engine(verifier)


class _Recording(StoppingCriteria):
    """Keeps every ``input_ids`` it is handed (the tensor itself, not a copy) and a copy of it; never stops."""

    def __init__(self):
        self.kept, self.copies = [], []

    def __call__(self, input_ids, scores, **kwargs):
        self.kept.append(input_ids)
        self.copies.append(input_ids.clone())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_stopping_criteria_see_the_sequence_so_far_and_what_they_keep_stays():
    """The rules hand criteria a view of a growing buffer (not the whole sequence converted again at every token): each
    call sees the prompt and the tokens so far, as stock's does, and a tensor a criterion kept still holds those values
    after the buffer grew and later tokens were written."""
    verifier = tiny_model("llama")
    ids = prompt(130, 8)  # the buffer starts at 2 x 131 tokens and grows once
    theirs, ours = _Recording(), _Recording()
    reference = verifier.generate(ids, max_new_tokens=150, do_sample=False, stopping_criteria=StoppingCriteriaList([theirs]))
    out = verifier.generate(ids, max_new_tokens=150, do_sample=False, stopping_criteria=StoppingCriteriaList([ours]),
                            assistant_model=_copy_of(verifier), kv_budget=24, num_assistant_tokens=4)
    assert torch.equal(out, reference)
    assert [c.tolist() for c in ours.copies] == [out[:, : ids.shape[1] + i + 1].tolist() for i in range(150)]
    assert [c.tolist() for c in theirs.copies] == [c.tolist() for c in ours.copies]
    assert all(torch.equal(k, c) for k, c in zip(ours.kept, ours.copies))


def test_left_padded_attention_mask_like_stock():
    verifier = tiny_model("llama")
    ids = torch.cat([torch.zeros(1, 5, dtype=torch.long), prompt(30, 7)], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 30, dtype=torch.long)], dim=1)
    reference = verifier.generate(ids, attention_mask=mask, max_new_tokens=15, do_sample=False)
    out = verifier.generate(
        ids, attention_mask=mask, max_new_tokens=15, do_sample=False, assistant_model=_copy_of(verifier), kv_budget=16
    )
    assert torch.equal(out, reference)


def test_return_dict_carries_scores_and_stats():
    verifier = tiny_model("llama")
    ids = prompt(30, 8)
    out = verifier.generate(
        ids, max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True,
        assistant_model=tiny_model("llama", role="drafter"), kv_budget=16,
    )
    reference = verifier.generate(ids, max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_logits=True)
    assert len(out.scores) == len(out.logits) == 12
    torch.testing.assert_close(torch.cat(out.logits), torch.cat(reference.logits), rtol=1e-9, atol=1e-9)
    stats = out.spec_stats
    for key in ("rounds", "drafted", "accepted", "new_tokens", "acceptance_rate", "mean_accepted_length",
                "prefill_seconds", "draft_seconds", "verify_seconds", "rounds_seconds"):
        assert key in stats
        assert stats[key] == getattr(stats, key) == stats.to_dict()[key]
    assert set(stats.to_dict()) == set(stats.keys()) and {**stats} == stats.to_dict()
    assert isinstance(stats, hf_sparsekv.SpecStats)


def test_the_seconds_of_a_call_partition_its_wall_clock_time():
    """prefill + rounds fit in the call's time (a clock around the call), and the rounds' steps in the rounds, with
    the controller choosing and with a constant γ."""
    verifier, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    ids = prompt(40, seed=5)
    for kwargs in (dict(assistant_model=drafter, kv_budget=16), dict(assistant_model=drafter, kv_budget=16,
                                                                    num_assistant_tokens=3,
                                                                    num_assistant_tokens_schedule="constant")):
        start = time.perf_counter()
        stats = verifier.generate(ids, max_new_tokens=24, do_sample=False, return_dict_in_generate=True,
                                  **kwargs).spec_stats
        wall = time.perf_counter() - start
        assert stats.rounds_seconds > 0 and stats.prefill_seconds > 0
        assert stats.prefill_seconds + stats.rounds_seconds <= wall
        assert stats.draft_seconds + stats.verify_seconds <= stats.rounds_seconds


def test_spec_stats_is_a_dataclass_with_dict_access():
    # Independent arithmetic: the derived figures from the counters, by hand.
    stats = hf_sparsekv.SpecStats(rounds=4, drafted=12, accepted=9, new_tokens=14, draft_seconds=0.5)
    assert stats.acceptance_rate == stats["acceptance_rate"] == 0.75
    assert stats.mean_accepted_length == stats["mean_accepted_length"] == 13 / 4
    assert stats.to_dict() == dict(rounds=4, drafted=12, accepted=9, retrieved_rounds=0, sibling_rounds=0, new_tokens=14,
                                   prefill_tokens=0, drafter_prefill_tokens=0, prefill_seconds=0.0,
                                   draft_seconds=0.5, verify_seconds=0.0, rounds_seconds=0.0, prompts=1, rows=[],
                                   width_rounds={}, acceptance_rate=0.75, mean_accepted_length=3.25, ar_rounds=0)
    text = repr(stats)
    assert text.startswith("SpecStats(acceptance_rate=0.750, mean_accepted_length=3.25, rounds=4")
    with pytest.raises(KeyError):
        stats["timer"]  # methods are not keys
    assert "timer" not in stats and "DERIVED" not in stats
    empty = hf_sparsekv.SpecStats(rounds=3, new_tokens=4, width_rounds={0: 3})
    assert empty.acceptance_rate is None and empty.to_dict()["acceptance_rate"] is None  # no drafts: no rate
    assert "acceptance_rate=None" in repr(empty) and empty.summary().startswith("no drafts: 3 plain verifier steps")
    assert stats.summary() == "acceptance 0.75 (9 of 12 drafts), tau 3.25, rounds by width {}"
    assert hf_sparsekv.SpecStats().mean_accepted_length == 0.0


def test_a_call_that_drafts_nothing_reports_no_rate():
    model = tiny_model("llama")
    out = model.generate(prompt(40, 0), prompt_lookup_num_tokens=3, max_new_tokens=1, do_sample=False,
                         return_dict_in_generate=True)
    assert out.spec_stats.drafted == 0 and out.spec_stats.acceptance_rate is None
    assert out.spec_stats.summary().startswith("no drafts")


def test_drafter_runs_past_its_native_positions():
    verifier = tiny_model("llama")
    drafter = tiny_model("llama", role="drafter")
    assert drafter.config.max_position_embeddings == 64
    ids = prompt(300, 9)
    out = verifier.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=drafter, kv_budget=32)
    assert torch.equal(out, verifier.generate(ids, max_new_tokens=10, do_sample=False))


def _word_tokenizer(size=VOCAB, extra=()):
    """A word-level tokenizer whose ids are the tiny models' ids: "w5" is id 5 (``extra`` words follow)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(size)] + list(extra)
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", pad_token="w0", eos_token="w2")


def test_pipeline_accepts_kv_budget():
    from transformers import pipeline

    tokenizer = _word_tokenizer()
    verifier = tiny_model("llama")
    text = " ".join(f"w{i}" for i in prompt(40, 10)[0].tolist())
    pipe = pipeline(
        "text-generation", model=verifier, tokenizer=tokenizer, assistant_model=_copy_of(verifier), device="cpu"
    )
    stock = pipe(text, max_new_tokens=10, do_sample=False)
    ours = pipe(text, max_new_tokens=10, do_sample=False, kv_budget=16)
    assert ours == stock


def test_kv_budget_none_gives_stocks_assisted_tokens():
    verifier = tiny_model("llama")
    ids = prompt(20, 11)
    drafter = tiny_model("llama", role="drafter")
    ours = verifier.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=drafter, kv_budget=None)
    hf_sparsekv.unregister()
    try:
        stock = verifier.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=drafter)
        with pytest.raises(ValueError, match="kv_budget"):
            verifier.generate(ids, max_new_tokens=8, assistant_model=drafter, kv_budget=16)
    finally:
        hf_sparsekv.register()
    assert torch.equal(ours, stock)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(kv_budget=16), ValueError, "assistant_model"),
        (dict(kv_budget=4, assistant_model="drafter"), ValueError, "kv_budget"),
        (dict(kv_budget=16, assistant_model="drafter", num_beams=2), NotImplementedError, "num_beams"),
        (dict(draft_cache="sparse", assistant_model="drafter"), ValueError, "draft_cache"),
        (dict(draft_cache="chunk", assistant_model="drafter"), ValueError, "kv_budget"),
        (dict(kv_budget=16, assistant_model="other_vocab"), ValueError, "vocab"),
        (dict(kv_budget=16, assistant_model="meta"), ValueError, "assistant_model is on"),
        (dict(kv_budget=16, assistant_model="drafter", batch=2, output_scores=True, return_dict_in_generate=True),
         NotImplementedError, "output_scores"),
        (dict(kv_budget=16, assistant_model="drafter", guidance_scale=1.5), NotImplementedError, "guidance_scale"),
        (dict(draft_cache="int4", assistant_model="self", kv_budget=64), ValueError, "kv_budget"),
        (dict(kv_budget=16, assistant_model="drafter", batch=2, past_key_values="empty"), NotImplementedError,
         "batch size 1 only"),
    ],
)
def test_bad_input_raises_naming_the_argument(kwargs, error, match):
    from transformers import LlamaConfig, LlamaForCausalLM

    verifier = tiny_model("llama")
    kwargs = dict(kwargs)
    batch = kwargs.pop("batch", 1)
    choice = kwargs.get("assistant_model")
    if choice == "drafter":
        kwargs["assistant_model"] = tiny_model("llama", role="drafter")
    elif choice == "self":
        kwargs["assistant_model"] = verifier
    elif choice == "other_vocab":
        kwargs["assistant_model"] = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB + 1, hidden_size=16, intermediate_size=32,
                                                                 num_hidden_layers=1, num_attention_heads=2))
    elif choice == "meta":
        kwargs["assistant_model"] = copy.deepcopy(tiny_model("llama", role="drafter")).to("meta")
    if kwargs.get("past_key_values") == "empty":
        kwargs["past_key_values"] = DynamicCache()
    ids = prompt(20, 0).repeat(batch, 1)
    with pytest.raises(error, match=match):
        verifier.generate(ids, max_new_tokens=5, **kwargs)


# ------------------------------------------------------------------ what a newcomer tries (issue 18, item 6)


def test_without_a_length_follows_the_generation_config_like_stock():
    verifier = copy.deepcopy(tiny_model("llama"))
    ids = prompt(12, 21)
    spec = dict(assistant_model=tiny_model("llama", role="drafter"), kv_budget=16)
    with pytest.warns(UserWarning, match="model-agnostic default `max_length`") as stock_warnings:
        reference = verifier.generate(ids, do_sample=False)
    with pytest.warns(UserWarning, match="model-agnostic default `max_length`"):
        out = verifier.generate(ids, do_sample=False, **spec)
    assert torch.equal(out, reference) and reference.shape[1] == 12 + 20
    assert stock_warnings  # the same warning text stock gives
    verifier.generation_config.max_length = 30  # a model whose generation config sets the length
    assert torch.equal(verifier.generate(ids, **spec), verifier.generate(ids))
    assert verifier.generate(ids, **spec).shape[1] == 30
    with pytest.raises(ValueError, match="max_length"):  # stock's own check: nothing left to generate
        verifier.generate(prompt(30, 1), **spec)


def test_do_sample_from_the_generation_config_samples_as_stock_does():
    """A generation config that samples (the model's, or the text-generation pipeline's default) samples here too,
    reproducibly with a seed; do_sample=False in the call overrides it, as in stock generate()."""
    from transformers import pipeline

    verifier = copy.deepcopy(tiny_model("llama"))
    verifier.generation_config.do_sample = True
    verifier.generation_config.temperature = 5.0  # far from greedy
    drafter = tiny_model("llama", role="drafter")
    ids = prompt(10, 0)
    greedy = tiny_model("llama").generate(ids, max_new_tokens=8, do_sample=False)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(verifier.generate(ids, max_new_tokens=8, assistant_model=drafter, kv_budget=16))
    assert torch.equal(runs[0], runs[1]) and not all(torch.equal(r, greedy) for r in runs)
    out = verifier.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=drafter, kv_budget=16)
    assert torch.equal(out, greedy)
    pipe = pipeline("text-generation", model=tiny_model("llama"), tokenizer=_word_tokenizer(),
                    assistant_model=_copy_of(tiny_model("llama")), device="cpu")
    text = " ".join(f"w{i}" for i in prompt(20, 3)[0].tolist())
    generated = pipe(text, max_new_tokens=5, min_new_tokens=5, kv_budget=16)[0]["generated_text"]
    assert generated.startswith(text) and len(generated[len(text) :].split()) == 5


def test_stop_strings_with_tokenizer_like_stock():
    verifier = tiny_model("llama")
    tokenizer = _word_tokenizer(extra=["abcdef"])  # StopStringCriteria probes the vocabulary with "abcdef"
    ids = prompt(25, 4)
    stop = f"w{_greedy_tokens(verifier, ids, 6)[3]}"
    kwargs = dict(max_new_tokens=20, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    reference = verifier.generate(ids, **kwargs)
    assert reference.shape[1] - ids.shape[1] <= 4  # the stop string fired
    out = verifier.generate(ids, assistant_model=_copy_of(verifier), kv_budget=16, num_assistant_tokens=5, **kwargs)
    assert torch.equal(out, reference)
    with pytest.raises(ValueError, match="stop_strings needs the tokenizer"):
        verifier.generate(ids, max_new_tokens=5, stop_strings=[stop], assistant_model=_copy_of(verifier), kv_budget=16)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(cache_implementation="static"), NotImplementedError, "cache_implementation"),
        (dict(prompt_lookup_num_tokens=3, num_assistant_tokens=4), ValueError, "a round drafts one chain"),
        (dict(use_cache=False), RuntimeError, "Assisted decoding requires a cache: use_cache=False"),
        (dict(draft_cache="full", kv_budget=64), ValueError, "kv_budget does not apply to draft_cache='full'"),
        (dict(draft_cache="cache-instance", kv_budget=64), ValueError, "kv_budget does not apply"),
        (dict(penalty_alpha=0.6, top_k=4), NotImplementedError, "penalty_alpha"),
        (dict(dola_layers="low"), NotImplementedError, "dola_layers"),
        (dict(token_healing=True), NotImplementedError, "token_healing"),
        (dict(num_assistant_tokens_schedule="sometimes"), ValueError, "num_assistant_tokens_schedule"),
        (dict(prefill_chunk_size=8), NotImplementedError, "prefill_chunk_size"),
        (dict(attention_mask="short"), ValueError, "attention_mask has shape"),
        (dict(draft_cache="window", kv_budget=4), ValueError, "sink"),
    ],
)
def test_options_that_would_be_ignored_raise_naming_them(kwargs, error, match):
    from hf_sparsekv import SinkWindowCache

    kwargs = {"kv_budget": 16, **kwargs}
    if kwargs.get("draft_cache") == "cache-instance":
        kwargs["draft_cache"] = SinkWindowCache(window=32)
    if kwargs.get("attention_mask") == "short":
        kwargs["attention_mask"] = torch.ones(1, 9, dtype=torch.long)
    with pytest.raises(error, match=match):
        tiny_model("llama").generate(prompt(10, 0), max_new_tokens=4, do_sample=False,
                                     assistant_model=tiny_model("llama", role="drafter"), **kwargs)


def _padded(model, rows: int, favour: dict | None = None):
    """A copy of ``model`` whose embedding and LM head have ``rows`` extra (padding) rows; ``favour`` maps a padding
    row to a real one whose LM-head row it copies, scaled up, so that greedy picks the padding row instead."""
    padded = copy.deepcopy(model)
    vocab = padded.config.vocab_size
    padded.resize_token_embeddings(vocab + rows, mean_resizing=False)
    with torch.no_grad():
        head = padded.get_output_embeddings().weight
        head[vocab:] = 0.0
        for pad_row, real in (favour or {}).items():
            head[pad_row] = head[real] * 1.5
    assert padded.config.vocab_size == vocab + rows
    return padded


def _ran_on_engine(verifier) -> bool:
    from hf_sparsekv.generation import engine as static_engine

    return static_engine.current_engine(verifier) is not None


def test_drafter_with_padded_vocabulary_is_lossless():
    verifier = tiny_model("qwen2")
    tokenizer = _word_tokenizer()
    ids = prompt(60, 6)
    reference = verifier.generate(ids, max_new_tokens=24, do_sample=False)
    # The drafter's padding rows would win its argmax everywhere: only ids < VOCAB may be drafted.
    drafter = _padded(verifier, 32)
    with torch.no_grad():
        drafter.get_output_embeddings().weight[VOCAB + 3] = 1e3 * drafter.get_output_embeddings().weight[7]
    for tree in (None, 12):  # a tree grown by the drafter ranks only the shared ids too
        out = verifier.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter, draft_cache="full",
                                tokenizer=tokenizer, return_dict_in_generate=True, num_assistant_tokens=4,
                                draft_tree_size=tree)
        assert torch.equal(out.sequences, reference)
        assert out.spec_stats.acceptance_rate > 0.0  # the argmax over the shared range agrees with the verifier
        assert _ran_on_engine(verifier)


def test_verifier_with_padded_vocabulary_is_lossless_even_when_it_picks_a_padding_row():
    base = tiny_model("qwen2")
    ids = prompt(60, 7)
    greedy = _greedy_tokens(base, ids, 24)
    verifier = _padded(base, 32, favour={VOCAB + 5: greedy[0]})  # greedy emits the padding id VOCAB + 5
    reference = verifier.generate(ids, max_new_tokens=24, do_sample=False)
    assert (reference >= VOCAB).any()
    for mode, tree in (("full", None), ("chunk", None), ("chunk", 10)):  # the drafter lacks the padding ids
        out = verifier.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=_copy_of(base),
                                draft_cache=mode, kv_budget=16 if mode == "chunk" else None,
                                tokenizer=_word_tokenizer(), draft_tree_size=tree)
        assert torch.equal(out, reference)
        assert _ran_on_engine(verifier)


def test_padded_vocabulary_needs_a_tokenizer_within_the_shared_range():
    verifier = tiny_model("llama")
    drafter = _padded(tiny_model("llama", role="drafter"), 16)
    kwargs = dict(max_new_tokens=4, do_sample=False, assistant_model=drafter, kv_budget=16)
    with pytest.raises(ValueError, match=r"vocab_size.*tokenizer=tok"):
        verifier.generate(prompt(10, 0), **kwargs)
    with pytest.raises(ValueError, match="not embedding padding"):
        verifier.generate(prompt(10, 0), tokenizer=_word_tokenizer(VOCAB + 4), **kwargs)
    out = verifier.generate(prompt(10, 0), tokenizer=_word_tokenizer(), **kwargs)
    assert torch.equal(out, verifier.generate(prompt(10, 0), max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("spec", [
    dict(kv_budget=16), dict(draft_cache="window", kv_budget=16), dict(draft_cache="full"),
    dict(draft_cache="int4", self=True), dict(kv_budget=16, do_sample=True, self=False),
])
def test_no_cache_keyword_deprecation_warnings(spec):
    """Every internal forward hands the cache over under the keyword the model declares (``cache`` from
    transformers 5.24 on, ``past_key_values`` before), so a speculative call raises no deprecation warning about it
    on any supported version; the output still equals stock generate()."""
    import warnings

    spec = dict(spec)
    verifier = tiny_model("llama")
    drafter = verifier if spec.pop("self", False) else tiny_model("llama", role="drafter")
    ids = prompt(70, seed=11)
    sampled = spec.pop("do_sample", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        out = verifier.generate(ids, max_new_tokens=10, do_sample=sampled, assistant_model=drafter, **spec)
    about_cache = [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert not about_cache, about_cache
    if not sampled:
        assert torch.equal(out, verifier.generate(ids, max_new_tokens=10, do_sample=False))


def test_token_id_options_in_any_integer_form_like_stock():
    """``eos_token_id`` as a NumPy integer or a 0-d tensor (and ``kv_budget`` as a NumPy integer), and int32 input
    ids, give stock's int64 output."""
    import numpy as np

    verifier, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    ids = prompt(30, 4)
    free = verifier.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[])
    eos = int(free[0, 36])  # a token the output reaches, so that stopping on it matters
    stock = verifier.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    assert stock.shape[1] < free.shape[1]
    for form in (np.int64(eos), torch.tensor(eos), torch.tensor([eos])):
        ours = verifier.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=form, assistant_model=drafter,
                                 kv_budget=np.int64(16))
        assert torch.equal(ours, stock)
    ours = verifier.generate(ids.int(), max_new_tokens=12, do_sample=False, eos_token_id=eos, assistant_model=drafter,
                             kv_budget=16)
    assert ours.dtype == verifier.generate(ids.int(), max_new_tokens=2, do_sample=False).dtype == torch.int64
    assert torch.equal(ours, stock)


def test_renormalized_scores_like_stock():
    verifier = tiny_model("qwen2")
    ids = prompt(30, 5)
    kw = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_scores=True,
              renormalize_logits=True)
    stock = verifier.generate(ids, **kw)
    ours = verifier.generate(ids, assistant_model=tiny_model("qwen2", role="drafter"), kv_budget=16, **kw)
    assert torch.equal(ours.sequences, stock.sequences)
    torch.testing.assert_close(torch.cat(ours.scores), torch.cat(stock.scores), rtol=1e-9, atol=1e-9)
    scores = torch.cat(ours.scores)
    assert torch.allclose(scores.exp().sum(-1), torch.ones(8, dtype=scores.dtype))  # log-probabilities


def test_kv_budget_on_a_generation_config_is_honoured():
    """``kv_budget``/``draft_cache`` on the passed ``generation_config`` or on ``model.generation_config`` take the
    speculative path (in a call with ``assistant_model``); ``kv_budget=None`` in the call turns them off (the call is
    then stock's assisted generation, which the import routes to the engine with a full drafter cache)."""
    from transformers import GenerationConfig

    verifier, drafter = copy.deepcopy(tiny_model("mistral")), tiny_model("mistral", role="drafter")
    ids = prompt(40, 6)
    greedy = verifier.generate(ids, max_new_tokens=10, do_sample=False)
    config = GenerationConfig(kv_budget=16, draft_cache="window", max_new_tokens=10, do_sample=False,
                              return_dict_in_generate=True)
    out = verifier.generate(ids, generation_config=config, assistant_model=drafter)
    assert out.spec_stats.rounds > 0 and torch.equal(out.sequences, greedy)
    verifier.generation_config.kv_budget = 16
    out = verifier.generate(ids, assistant_model=drafter, max_new_tokens=10, do_sample=False,
                            return_dict_in_generate=True)
    assert out.spec_stats.rounds > 0 and torch.equal(out.sequences, greedy)
    routed = verifier.generate(ids, assistant_model=drafter, max_new_tokens=10, do_sample=False,
                               return_dict_in_generate=True, kv_budget=None)
    assert static_engine.current_engine(verifier).spec.mode == "full" and torch.equal(routed.sequences, greedy)
    assert torch.equal(verifier.generate(ids, max_new_tokens=10, do_sample=False), greedy)  # no drafter: stock


def test_an_unsupported_option_from_the_model_config_is_named_as_such():
    verifier = copy.deepcopy(tiny_model("llama"))
    verifier.generation_config.guidance_scale = 1.5
    with pytest.raises(NotImplementedError, match=r"model\.generation_config\.guidance_scale"):
        verifier.generate(prompt(20, 0), assistant_model=tiny_model("llama", role="drafter"), kv_budget=16,
                          max_new_tokens=4, do_sample=False)


@pytest.mark.parametrize("gamma", [2, pytest.param(5, marks=pytest.mark.extended)])  # ~65 s of CPU each
def test_smallest_window_and_rollback_are_lossless(gamma):
    """A window budget one above the sink tokens, and a SinkWindowCache rolling back exactly γ − 1 tokens (the most
    rejected drafts a round leaves), still give greedy AR."""
    from hf_sparsekv import SinkWindowCache

    for arch in ARCHS:
        verifier, drafter = tiny_model(arch), tiny_model(arch, role="drafter")
        for seed in range(3):
            ids = prompt(50, seed)
            greedy = verifier.generate(ids, max_new_tokens=24, do_sample=False)
            for cache in ({"kv_budget": 5}, {"draft_cache": SinkWindowCache(4, 8, max_rollback=gamma - 1)}):
                kw = {"draft_cache": "window", **cache}
                ours = verifier.generate(ids, assistant_model=drafter, num_assistant_tokens=gamma, max_new_tokens=24,
                                         do_sample=False, **kw)
                assert torch.equal(ours, greedy), (arch, seed, cache)


def test_num_assistant_tokens_on_the_model_config_sets_gamma():
    verifier = copy.deepcopy(tiny_model("llama"))
    ids = prompt(30, 7)
    kw = dict(assistant_model=tiny_model("llama", role="drafter"), kv_budget=16, max_new_tokens=12, do_sample=False,
              return_dict_in_generate=True)
    default = verifier.generate(ids, num_assistant_tokens_schedule="constant", **kw).spec_stats
    assert default.drafted > 2 * default.rounds  # γ = 5 (rounds near the length limit draft fewer)
    verifier.generation_config.num_assistant_tokens = 2
    out = verifier.generate(ids, **kw)
    assert out.spec_stats.rounds < out.spec_stats.drafted <= 2 * out.spec_stats.rounds  # γ = 2
    assert torch.equal(out.sequences, verifier.generate(ids, max_new_tokens=12, do_sample=False))


def test_num_assistant_tokens_on_the_assistant_config_sets_gamma():
    """Stock assisted generation reads γ from ``assistant_model.generation_config``; so do we, below the call's and
    the model's own setting. Stock's adaptive schedule there hands γ to the controller, at most that γ."""
    verifier = tiny_model("llama")
    drafter = copy.deepcopy(tiny_model("llama", role="drafter"))
    ids = prompt(30, 7)
    kw = dict(assistant_model=drafter, kv_budget=16, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    drafter.generation_config.num_assistant_tokens = 1
    one = verifier.generate(ids, **kw)
    assert one.spec_stats.rounds - 2 <= one.spec_stats.drafted <= one.spec_stats.rounds  # γ = 1 (the last rounds draft less)
    assert torch.equal(one.sequences, verifier.generate(ids, max_new_tokens=12, do_sample=False))
    three = verifier.generate(ids, num_assistant_tokens=3, **kw).spec_stats  # the call's setting wins
    assert three.rounds < three.drafted <= 3 * three.rounds
    drafter.generation_config.num_assistant_tokens = 3
    drafter.generation_config.num_assistant_tokens_schedule = "heuristic"
    adaptive = verifier.generate(ids, **{**kw, "max_new_tokens": 48})  # (its plain steps' cost first: 3 bursts)
    assert torch.equal(adaptive.sequences, verifier.generate(ids, max_new_tokens=48, do_sample=False))
    assert set(adaptive.spec_stats.width_rounds) <= {0, 1, 2, 3} and len(adaptive.spec_stats.width_rounds) > 1


# ------------------------------------------------------------------ odd inputs (issue 53)


def test_an_assistant_model_that_is_no_model_is_named():
    with pytest.raises(TypeError, match="assistant_model must be a causal LM.*got object"):
        tiny_model("llama").generate(prompt(10, 0), max_new_tokens=3, assistant_model=object(), kv_budget=16)


def test_kv_budget_as_a_0d_integer_tensor_like_a_python_int():
    """A 0-d integer tensor is an integer setting (as a NumPy integer is); a float or multi-element tensor is refused,
    naming kv_budget."""
    verifier, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    ids = prompt(40, 1)
    expected = verifier.generate(ids, max_new_tokens=8, do_sample=False)
    for budget in (torch.tensor(16), torch.tensor(16, dtype=torch.int32)):
        assert torch.equal(verifier.generate(ids, max_new_tokens=8, assistant_model=drafter, kv_budget=budget),
                           expected)
    for budget, match in ((torch.tensor(16.0), r"shape \(\) and dtype torch.float32"),
                          (torch.tensor([16, 8]), r"shape \(2,\)"),
                          (torch.tensor(True), r"shape \(\) and dtype torch.bool")):
        with pytest.raises(ValueError, match="kv_budget must be a positive integer; a tensor must be a 0-d integer "
                                             "tensor, got one of " + match):
            verifier.generate(ids, max_new_tokens=3, assistant_model=drafter, kv_budget=budget)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_drafter_in_another_dtype_than_the_verifier_is_served_in_every_mode(dtype):
    """The drafter's caches are in the drafter's dtype (stock assisted generation serves such a pair too): every
    drafter mode, a tree, retrieval beside the drafter and a batch give stock greedy's tokens of the verifier."""
    verifier = tiny_model("llama")  # float64
    drafter = copy.deepcopy(tiny_model("llama", role="drafter")).to(dtype)
    ids = prompt(60, 5)
    greedy = verifier.generate(ids, max_new_tokens=12, do_sample=False)
    for options in (dict(kv_budget=16), dict(draft_cache="window", kv_budget=24), dict(draft_cache="full"),
                    dict(draft_cache="int4"), dict(kv_budget=16, draft_tree_size=8),
                    dict(kv_budget=16, prompt_lookup_num_tokens=3)):
        out = verifier.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter, **options)
        assert torch.equal(out, greedy), options
    batch = torch.cat([ids, prompt(60, 6)])
    out = verifier.generate(batch, max_new_tokens=12, do_sample=False, assistant_model=drafter, kv_budget=16)
    assert torch.equal(out, verifier.generate(batch, max_new_tokens=12, do_sample=False))


def test_a_budget_beyond_the_sequence_is_sized_by_the_call():
    """kv_budget (or a cache instance's budget, sink or window) at or above prompt + new tokens keeps every token:
    the drafter's cache is sized by what the call can hold (prompt + max_new_tokens + slack), not by the budget
    (10**9 asked for 256 GB)."""
    import time

    from hf_sparsekv import ChunkBudgetCache, SinkWindowCache
    from hf_sparsekv.generation import engine as static_engine

    verifier, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    ids = prompt(60, 2)
    greedy = verifier.generate(ids, max_new_tokens=12, do_sample=False)
    huge = 10**9
    for options in (dict(kv_budget=huge), dict(draft_cache="window", kv_budget=huge),
                    dict(draft_cache=ChunkBudgetCache(huge, generated_window=huge)),
                    dict(draft_cache=SinkWindowCache(sink=huge, window=huge)), dict(kv_budget=huge, draft_tree_size=8)):
        start = time.perf_counter()
        out = verifier.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter, **options)
        assert time.perf_counter() - start < 30, options  # ~0.3 s; allocating by the budget takes minutes, or fails
        assert torch.equal(out, greedy), options
        cache = static_engine.current_engine(verifier).drafter_cache
        assert cache.capacity <= 1024 and cache.nbytes() < 2**20, (options, cache.capacity)


def test_return_dict_returns_the_cache_stock_greedy_returns():
    """return_dict_in_generate: the output's cache holds what stock greedy's does (the whole sequence but its last
    token) in every mode, with left padding (zero columns there: stock's keys of pad tokens, which the mask hides,
    are never computed) and after prompt caching (the caller's cache, extended). int4 returns what verification read,
    the INT8 view (within its quantization error of stock's)."""
    from hf_sparsekv.cache_keyword import cache_keyword

    from .test_retrieval import assert_same_cache, returned_cache

    verifier, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    ids = prompt(60, 3)
    settings = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    stock = verifier.generate(ids, **settings)
    expected = returned_cache(stock)
    for options in (dict(kv_budget=16), dict(draft_cache="window", kv_budget=24), dict(draft_cache="full"),
                    dict(kv_budget=16, draft_tree_size=8), dict(kv_budget=16, prompt_lookup_num_tokens=3)):
        out = verifier.generate(ids, assistant_model=drafter, **options, **settings)
        assert torch.equal(out.sequences, stock.sequences), options
        assert_same_cache(returned_cache(out), expected)
    out = verifier.generate(ids, assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=16),
                            **settings)
    assert torch.equal(out.sequences, stock.sequences)
    assert_same_cache(returned_cache(out), expected, atol=0.02 * float(expected.layers[0].keys.abs().max()))

    prefix, keyword = DynamicCache(), cache_keyword(verifier)
    verifier(ids[:, :20], **{keyword: prefix})
    out = verifier.generate(ids, assistant_model=drafter, kv_budget=16, **{keyword: prefix}, **settings)
    assert returned_cache(out) is prefix
    assert_same_cache(prefix, expected)

    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], 1)
    mask = (padded != 0).long()
    mask[:, 4:] = 1
    stock = verifier.generate(padded, attention_mask=mask, **settings)
    out = verifier.generate(padded, attention_mask=mask, assistant_model=drafter, kv_budget=16, **settings)
    assert torch.equal(out.sequences, stock.sequences)
    cache = returned_cache(out)
    assert_same_cache(cache, returned_cache(stock), columns={0: slice(4, None)})
    assert not cache.layers[0].keys[:, :, :4].any()
