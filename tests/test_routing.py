"""Stock's own calls on the engine by the import alone (:mod:`hf_sparsekv.generation.registration`):
``generate(ids, assistant_model=drafter)`` with no argument of ours (assisted generation routed), and plain decoding
by the opt-in ``static_engine=True``. References: stock ``generate()`` with the plugin unregistered (greedy without a
drafter, and stock's own assisted generation for the output's shape)."""

from __future__ import annotations

import logging
import types

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, TextStreamer
from transformers.cache_utils import Cache

import hf_sparsekv
from hf_sparsekv.generation import engine as static_engine
from hf_sparsekv.generation import front, registration

from .conftest import ARCHS, OTHER_ARCHS, VOCAB, left_padded, prompt, stock_generate, tiny_model


def _sliding_pair():
    """A Mistral verifier whose sliding window (12) is shorter than the prompts, and its drafter."""
    models = []
    for seed, (width, layers) in enumerate(((64, 2), (32, 1))):
        config = MistralConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width,
                               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=512, sliding_window=12, bos_token_id=1, eos_token_id=2,
                               pad_token_id=0, tie_word_embeddings=False)
        config._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        model = MistralForCausalLM(config).eval().to(torch.float64)
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
        models.append(model)
    return models


def _gpt2_pair():
    """GPT-2 (learned absolute positions, Conv1D projections): stock's classic assisted-generation pair's kind."""
    from transformers import GPT2Config, GPT2LMHeadModel

    models = []
    for seed, (width, layers) in enumerate(((64, 2), (32, 1))):
        torch.manual_seed(seed)
        config = GPT2Config(vocab_size=VOCAB, n_embd=width, n_layer=layers, n_head=2, n_positions=512,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0)
        config._attn_implementation = "sdpa"
        models.append(GPT2LMHeadModel(config).eval().to(torch.float64))
    return models


_PAIRS = {arch: (lambda a=arch: (tiny_model(a), tiny_model(a, role="drafter"))) for arch in ARCHS + OTHER_ARCHS}
_PAIRS["sliding"] = _sliding_pair
_PAIRS["gpt2"] = _gpt2_pair


def assert_likestock_generate(ours, stock) -> None:
    """``ours`` (a call we served) is shaped as ``stock`` (stock's output of the same call): a subclass of its class,
    the same fields set, the same sequences, scores and logits of the same count and shape (and values: greedy on
    float64 models), and a stock-compatible cache holding the same keys and values."""
    if isinstance(stock, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and ours.dtype == stock.dtype
        assert torch.equal(ours, stock)
        return
    assert isinstance(ours, type(stock)), (type(ours), type(stock))
    fields = lambda out: {k for k, v in out.items() if v is not None and k != "spec_stats"}  # noqa: E731
    assert fields(ours) == fields(stock)
    assert torch.equal(ours.sequences, stock.sequences)
    for name in ("scores", "logits"):
        a, b = getattr(ours, name), getattr(stock, name)
        if b is None:
            continue
        assert isinstance(a, tuple) and len(a) == len(b), name
        for x, y in zip(a, b):
            assert x.shape == y.shape and x.dtype == y.dtype, name
            finite = torch.isfinite(y)
            assert torch.equal(finite, torch.isfinite(x)) and torch.allclose(x[finite], y[finite], atol=1e-6), name
    cache, reference = ours.past_key_values, stock.past_key_values
    if reference is not None:
        assert isinstance(cache, Cache) and cache.get_seq_length() == reference.get_seq_length()
        for mine, theirs in zip(cache.layers, reference.layers):
            assert torch.allclose(mine.keys, theirs.keys, atol=1e-6)
            assert torch.allclose(mine.values, theirs.values, atol=1e-6)


@pytest.mark.parametrize("pair", list(_PAIRS))
def test_stock_assisted_generation_runs_on_the_engine_with_greedy_tokens(pair):
    model, drafter = _PAIRS[pair]()
    for length, seed in ((30, 1), (45, 2)):
        ids = prompt(length, seed)
        settings = dict(max_new_tokens=24, do_sample=False)
        greedy = stock_generate(model, ids, **settings)
        out = model.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **settings)
        engine = static_engine.current_engine(model)
        trained = drafter.config.max_position_embeddings  # (past it the drafter drafts on a sink + window cache)
        assert engine.spec.mode == ("full" if length + 24 <= trained else "window"), (length, trained)
        assert engine.spec.adaptive and engine.drafter is drafter
        assert torch.equal(out.sequences, greedy)
        assert out.spec_stats.new_tokens == 24
    ids, mask = left_padded([prompt(20, 3), prompt(33, 4), prompt(27, 5)])
    batch = model.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=12, do_sample=False)
    assert static_engine.current_engine(model).spec.batch == 3  # (stock's assisted generation takes one row)
    assert torch.equal(batch, stock_generate(model, ids, attention_mask=mask, max_new_tokens=12, do_sample=False))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("extra", [
    {}, dict(output_scores=True), dict(output_logits=True, output_scores=True), dict(repetition_penalty=1.3),
    dict(num_assistant_tokens=3, num_assistant_tokens_schedule="constant"),
])
def test_routed_outputs_are_shaped_as_stock_assisted_generations(arch, extra):
    model, drafter = tiny_model(arch), tiny_model(arch, role="drafter")
    ids = prompt(28, 7)
    settings = dict(max_new_tokens=16, do_sample=False, return_dict_in_generate=True, **extra)
    stock = stock_generate(model, ids, assistant_model=drafter, **settings)
    ours = model.generate(ids, assistant_model=drafter, **settings)
    assert_likestock_generate(ours, stock)
    engine = static_engine.current_engine(model)
    if "num_assistant_tokens" in extra:  # stock's constant schedule: a constant γ
        assert engine.spec.gamma == 3 and not engine.spec.adaptive
        assert set(ours.spec_stats.width_rounds) <= {1, 2, 3}


def test_routed_sampling_with_top_k_one_is_greedy_and_seeded_runs_repeat():
    model, drafter = tiny_model("qwen2"), tiny_model("qwen2", role="drafter")
    ids = prompt(30, 8)
    greedy = stock_generate(model, ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(model.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=True, top_k=1), greedy)
    runs = []
    for seed in (3, 3):
        torch.manual_seed(seed)
        runs.append(model.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=True))
    assert torch.equal(runs[0], runs[1])
    assert static_engine.current_engine(model).spec.sampling is not None


def _other_vocabulary_drafter():
    model = tiny_model("llama", role="drafter", seed=3)
    bigger = type(model)(type(model.config)(**{**model.config.to_dict(), "vocab_size": VOCAB + 8})).eval()
    return bigger.to(torch.float64)


@pytest.mark.parametrize("case", ["hidden_states", "other_vocabulary", "turned_off", "nested_opt_in"])
def test_what_the_engine_does_not_serve_goes_to_stocks_assisted_generation(case, caplog, monkeypatch):
    model, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    ids = prompt(25, 9)
    settings = dict(max_new_tokens=10, do_sample=False)
    served, serve = [], registration.speculative_generate
    monkeypatch.setattr(registration, "speculative_generate", lambda *a, **k: (served.append(k), serve(*a, **k))[1])
    if case == "hidden_states":
        settings.update(output_hidden_states=True, return_dict_in_generate=True)
    elif case == "other_vocabulary":
        drafter = _other_vocabulary_drafter()
    elif case == "turned_off":
        monkeypatch.setattr(registration, "_routing", {"assisted": False, "prompt_lookup": True})
    else:  # the opt-in on the model's config: stock's inner drafter calls must stay stock's
        settings.update(output_hidden_states=True, return_dict_in_generate=True)
        monkeypatch.setattr(model.generation_config, "static_engine", True, raising=False)
    if case == "other_vocabulary":  # stock's own answer: universal assisted generation needs both tokenizers
        for call in (stock_generate, type(model).generate):
            with pytest.raises(ValueError, match="different tokenizers"):
                call(model, ids, assistant_model=drafter, **settings)
        assert served == []
        return
    stock = stock_generate(model, ids, assistant_model=drafter, **settings)
    with caplog.at_level(logging.INFO, logger="hf_sparsekv.generation.registration"):
        out = model.generate(ids, assistant_model=drafter, **settings)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    assert torch.equal(sequences, stock if isinstance(stock, torch.Tensor) else stock.sequences)
    if case == "turned_off":
        assert served == [] and not [r for r in caplog.records if r.name.startswith("hf_sparsekv")]
    else:
        assert len(served) <= 1 and "runs on stock generate()" in caplog.text


def test_set_routing_and_unregister_restorestock_generate():
    assert hf_sparsekv.set_routing() == {"assisted": True, "prompt_lookup": True}
    try:
        assert hf_sparsekv.set_routing(assisted=False) == {"assisted": False, "prompt_lookup": True}
    finally:
        hf_sparsekv.set_routing(assisted=True)
    model, drafter = tiny_model("mistral"), tiny_model("mistral", role="drafter")
    static_engine.release_engines()
    hf_sparsekv.unregister()
    try:
        model.generate(prompt(20, 1), assistant_model=drafter, max_new_tokens=6, do_sample=False)
    finally:
        hf_sparsekv.register()
    assert static_engine.current_engine(model) is None


@pytest.mark.parametrize("pair", ["llama", "qwen2", "mistral", "phi3", "gpt_neox", "sliding"])
def test_static_engine_opt_in_is_stock_greedy_and_sampling(pair):
    model, _ = _PAIRS[pair]()
    ids = prompt(40, 4)
    greedy = stock_generate(model, ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(model.generate(ids, static_engine=True, max_new_tokens=20, do_sample=False), greedy)
    assert static_engine.current_engine(model).spec.mode == "ar"
    assert torch.equal(model.generate(ids, static_engine=True, max_new_tokens=20, do_sample=True, top_k=1), greedy)
    ids, mask = left_padded([prompt(20, 3), prompt(33, 4)])
    batch = model.generate(ids, attention_mask=mask, static_engine=True, max_new_tokens=12, do_sample=False)
    assert torch.equal(batch, stock_generate(model, ids, attention_mask=mask, max_new_tokens=12, do_sample=False))


@pytest.mark.parametrize("extra", [
    dict(output_scores=True), dict(output_logits=True), dict(repetition_penalty=1.4, no_repeat_ngram_size=3),
    dict(min_new_tokens=12, eos_token_id=[5, 9]),
])
def test_static_engine_outputs_are_shaped_as_stock_decoding(extra):
    model = tiny_model("llama")
    ids = prompt(30, 6)
    settings = dict(max_new_tokens=14, do_sample=False, return_dict_in_generate=True, **extra)
    assert_likestock_generate(model.generate(ids, static_engine=True, **settings), stock_generate(model, ids, **settings))


def test_static_engine_from_the_generation_config_and_refusals(monkeypatch):
    model = tiny_model("qwen2")
    warned = []  # (warning_once: the message of an earlier test would not show again)
    monkeypatch.setattr(registration.logger, "warning_once", warned.append)
    ids = prompt(25, 2)
    greedy = stock_generate(model, ids, max_new_tokens=10, do_sample=False)
    model.generation_config.static_engine = True
    try:
        assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False), greedy)
        assert static_engine.current_engine(model).spec.mode == "ar"
        # an option the engine does not serve: stock serves the call
        out = model.generate(ids, max_new_tokens=10, do_sample=False, output_hidden_states=True,
                             return_dict_in_generate=True)
        assert torch.equal(out.sequences, greedy) and out.hidden_states is not None
        assert len(warned) == 1 and "output_hidden_states" in warned[0]
    finally:
        del model.generation_config.static_engine
    with pytest.raises(ValueError, match="need assistant_model"):
        hf_sparsekv.speculative_generate(model, ids, static_engine=True, kv_budget=16, max_new_tokens=4)


def test_a_static_engine_fallback_names_what_the_call_passed(monkeypatch):
    """The one-time warning of a ``static_engine=True`` call that goes to stock names that argument (and the
    refused ones), not kv_budget/draft_cache, which the call never passed."""
    model = tiny_model("llama")
    warned = []
    monkeypatch.setattr(registration.logger, "warning_once", warned.append)
    ids = prompt(25, 3)
    model.generate(ids, static_engine=True, num_beams=2, max_new_tokens=4, do_sample=False)
    with pytest.raises(ValueError, match="not used by the model"):  # stock's own answer to an unknown argument
        model.generate(ids, static_engine=True, max_new_tokens=4, do_sample=False, no_such_argument=1)
    assert len(warned) == 2 and all("kv_budget" not in w and "draft_cache" not in w for w in warned)
    assert "num_beams" in warned[0]
    assert "(static_engine=True): ['no_such_argument']" in warned[1]


def test_pipeline_and_text_streamer_on_the_routed_call_and_the_opt_in(capsys):
    from transformers import pipeline

    from .test_generation import _word_tokenizer

    model, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    tokenizer = _word_tokenizer()
    text = " ".join(f"w{i}" for i in prompt(30, 12)[0].tolist())
    stock = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")(
        text, max_new_tokens=8, do_sample=False)
    for extra in (dict(assistant_model=drafter), dict(static_engine=True)):
        pipe = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu",
                        **({"assistant_model": drafter} if "assistant_model" in extra else {}))
        static_engine.release_engines()
        call = {} if "assistant_model" in extra else extra
        assert pipe(text, max_new_tokens=8, do_sample=False, **call) == stock
        assert static_engine.current_engine(model) is not None
        ids = tokenizer(text, return_tensors="pt").input_ids
        capsys.readouterr()
        streamed = model.generate(ids, max_new_tokens=8, do_sample=False, streamer=TextStreamer(tokenizer), **extra)
        printed = capsys.readouterr().out.split()
        assert printed == tokenizer.decode(streamed[0]).split()


def test_num_return_sequences_with_sampling_expands_the_rows():
    model, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    prompts = [prompt(20, 1), prompt(26, 2)]
    ids, mask = left_padded(prompts)
    for extra in (dict(assistant_model=drafter), dict(static_engine=True), dict(assistant_model=drafter, kv_budget=16)):
        out = model.generate(ids, attention_mask=mask, do_sample=True, top_k=1, num_return_sequences=3,
                             max_new_tokens=10, **extra)
        assert out.shape[0] == 6 and static_engine.current_engine(model).spec.batch == 6
        for b, p in enumerate(prompts):  # top_k=1: every copy is its prompt's greedy continuation
            reference = stock_generate(model, p, max_new_tokens=10, do_sample=False)[0, p.shape[1] :]
            for row in range(3 * b, 3 * b + 3):
                assert torch.equal(out[row, ids.shape[1] :], reference), row
    torch.manual_seed(0)
    samples = model.generate(prompts[0], do_sample=True, num_return_sequences=8, max_new_tokens=6, static_engine=True)
    assert len({tuple(r.tolist()) for r in samples}) > 1  # the copies draw their own tokens


def test_max_time_in_a_batch_and_the_length_reminder(monkeypatch):
    model, drafter = tiny_model("qwen2"), tiny_model("qwen2", role="drafter")
    ids, mask = left_padded([prompt(20, 1), prompt(26, 2)])
    greedy = stock_generate(model, ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    out = model.generate(ids, attention_mask=mask, assistant_model=drafter, kv_budget=16, max_new_tokens=40,
                         do_sample=False, max_time=0.0)
    assert ids.shape[1] < out.shape[1] < greedy.shape[1]  # every row stopped at once, after its first tokens
    assert torch.equal(out, greedy[:, : out.shape[1]])
    with pytest.raises(NotImplementedError, match="max_time with batch size > 1"):  # rows one after another
        model.generate(ids, attention_mask=mask, assistant_model=model, draft_cache="int4", do_sample=True,
                       max_new_tokens=4, max_time=5.0)
    reminders = []  # (warning_once: a message stock gave earlier in the process would not show again)
    monkeypatch.setattr(front._criteria_logger, "warning_once", reminders.append)
    model.generate(prompt(1020, 3), static_engine=True, max_new_tokens=3, do_sample=False)
    assert reminders == []
    model.generate(prompt(1030, 3), static_engine=True, max_new_tokens=3, do_sample=False)
    assert len(reminders) == 1 and "exceeded the model's predefined maximum length (1024)" in reminders[0]


def test_an_encoder_decoder_model_keeps_stocks_calls():
    from transformers import BartConfig, BartForConditionalGeneration

    def bart(layers):
        torch.manual_seed(layers)
        config = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=layers, decoder_layers=layers,
                            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                            decoder_ffn_dim=64, max_position_embeddings=128)
        return BartForConditionalGeneration(config).eval()

    model, drafter = bart(2), bart(1)
    ids = prompt(20, 5)
    for extra in (dict(assistant_model=drafter), dict(prompt_lookup_num_tokens=3), dict(static_engine=True)):
        settings = dict(max_new_tokens=8, do_sample=False, **extra)
        stock = stock_generate(model, ids, **{k: v for k, v in settings.items() if k != "static_engine"})
        assert torch.equal(model.generate(ids, **settings), stock)


def test_a_call_refused_at_the_prefill_streams_once_on_stocks_path(monkeypatch):
    """A NotImplementedError from the engine's prefill (an attention option the static path lacks, say) hands the
    call to stock before anything was streamed: the streamer sees stock's stream once."""
    from transformers.generation.streamers import BaseStreamer

    class Recorder(BaseStreamer):
        def __init__(self):
            self.puts = []

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.puts.append("end")

    model, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    ids = prompt(25, 4)
    stock = Recorder()
    stock_generate(model, ids, assistant_model=drafter, max_new_tokens=6, do_sample=False, streamer=stock)

    def refuse(*args, **kwargs):
        raise NotImplementedError("an attention option the static path lacks")

    monkeypatch.setattr(static_engine.StaticEngine, "prefill", refuse)
    ours = Recorder()
    model.generate(ids, assistant_model=drafter, max_new_tokens=6, do_sample=False, streamer=ours)
    assert ours.puts == stock.puts


@pytest.mark.parametrize("call", ["routed", "lookup", "static_engine", "static_batch", "batch", "kv_budget",
                                  "streamer"])
def test_an_engine_failure_hands_a_routed_call_to_stock(call, monkeypatch):
    """An error inside the engine (an architecture it cannot run, say) on a call the import routed: stock's path
    serves the call, with one warning, and the model's engines are freed. A call with an argument of ours, with a
    streamer (which may have had tokens), or a batch of a speculative call (stock's take one row) raises the
    error."""
    from transformers.generation.streamers import BaseStreamer

    model, drafter = tiny_model("mistral"), tiny_model("mistral", role="drafter")
    ids = prompt(24, 6)
    settings = dict(max_new_tokens=8, do_sample=False)
    extra = {"routed": dict(assistant_model=drafter), "lookup": dict(prompt_lookup_num_tokens=3),
             "static_engine": dict(static_engine=True), "static_batch": dict(static_engine=True),
             "batch": dict(assistant_model=drafter),
             "kv_budget": dict(assistant_model=drafter, kv_budget=16),
             "streamer": dict(assistant_model=drafter, streamer=BaseStreamer())}[call]
    if call in ("batch", "static_batch"):
        ids, mask = left_padded([ids, prompt(15, 7)])
        settings["attention_mask"] = mask
    warned = []
    monkeypatch.setattr(registration.logger, "warning_once", warned.append)

    def fail(*args, **kwargs):
        raise RuntimeError("a layer the engine cannot run")

    monkeypatch.setattr(static_engine.StaticEngine, "prefill", fail)
    if call in ("kv_budget", "streamer", "batch"):
        with pytest.raises(RuntimeError, match="a layer the engine cannot run"):
            model.generate(ids, **settings, **extra)
        return
    out = model.generate(ids, **settings, **extra)
    stock_extra = {k: v for k, v in extra.items() if k != "static_engine"}
    assert torch.equal(out, stock_generate(model, ids, **settings, **stock_extra))
    assert len(warned) == 1 and "RuntimeError: a layer the engine cannot run" in warned[0]
    assert static_engine.current_engine(model) is None


def test_the_routed_drafter_cache_is_full_within_the_drafters_trained_positions():
    from hf_sparsekv.generation.draft_modes import routed_draft_cache

    drafter = tiny_model("llama", "drafter")
    trained = drafter.config.max_position_embeddings
    assert routed_draft_cache(drafter, trained) == "full" and routed_draft_cache(drafter, trained + 1) == "window"
    unknown = types.SimpleNamespace(config=types.SimpleNamespace())  # (no trained length known: stock's full cache)
    assert routed_draft_cache(unknown, 10**6) == "full"
