"""The remembered ``GenerationConfig`` of a call equals stock's ``_prepare_generation_config`` call by call, also after
the inputs change between calls."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GenerationConfig

from hf_sparsekv.generation.config_memo import prepare_generation_config

from .conftest import tiny_model


def _same_as_stock(model, generation_config, kwargs) -> GenerationConfig:
    config, unused = prepare_generation_config(model, generation_config, copy.deepcopy(kwargs))
    want, want_unused = model._prepare_generation_config(copy.deepcopy(generation_config), **copy.deepcopy(kwargs))
    assert config.to_dict() == want.to_dict() and unused == want_unused
    return config


def test_each_call_gets_stocks_config_as_its_inputs_change():
    model = copy.deepcopy(tiny_model("llama"))  # (its generation config is changed below)
    greedy = dict(max_new_tokens=5, do_sample=False, eos_token_id=[2, 3], pad_token_id=0)
    for _ in range(3):  # a call's config is its own: the next call does not see what the caller did to it
        config = _same_as_stock(model, None, greedy)
        config.max_length = 999
        config.eos_token_id.append(7)
    _same_as_stock(model, None, dict(greedy, max_new_tokens=6))  # other kwargs
    _same_as_stock(model, None, dict(greedy, output_attentions=True, output_hidden_states=False))  # forward's
    sampled = dict(do_sample=True, max_new_tokens=5)
    _same_as_stock(model, None, sampled)
    model.generation_config.temperature = 0.3  # the model's generation config changed, the same kwargs
    assert _same_as_stock(model, None, sampled).temperature == 0.3
    model.generation_config.eos_token_id = [2]
    _same_as_stock(model, None, sampled)
    model.generation_config.eos_token_id.append(5)  # changed in place
    assert _same_as_stock(model, None, sampled).eos_token_id == [2, 5]
    given = GenerationConfig(max_new_tokens=4, top_k=3)  # the caller's config, then changed in place
    _same_as_stock(model, given, {})
    given.top_k = 9
    assert _same_as_stock(model, given, {}).top_k == 9
    _same_as_stock(model, None, dict(max_new_tokens=5, suppress_tokens=torch.tensor([4])))  # not plain: stock's path


def test_generation_parameters_on_the_model_config_are_refused_as_stock_refuses_them():
    model = copy.deepcopy(tiny_model("qwen2"))
    kwargs = dict(max_new_tokens=5, do_sample=False)
    _same_as_stock(model, None, kwargs)
    model.config.num_beams = 3  # a generation parameter on the model's config, after a remembered call
    with pytest.raises(ValueError, match="modified the pretrained model configuration"):
        model._prepare_generation_config(None, **kwargs)
    with pytest.raises(ValueError, match="modified the pretrained model configuration"):
        prepare_generation_config(model, None, kwargs)


def test_inputs_that_cannot_be_copied_are_served_and_not_remembered():
    import threading

    from hf_sparsekv.generation import config_memo

    model = copy.deepcopy(tiny_model("mistral"))
    model.config.not_copyable = threading.Lock()  # (deepcopy raises on a lock)
    _same_as_stock(model, None, dict(max_new_tokens=5, do_sample=False))
    assert model not in config_memo._memos


def test_alternating_calls_each_find_their_config_remembered(monkeypatch):
    """Configurations alternating on one model (plain, sampled, prompt lookup) each keep their remembered config:
    after the first round, no call merges configs again, and each still gets stock's result."""
    from hf_sparsekv.generation import config_memo

    model = copy.deepcopy(tiny_model("llama"))
    calls = [dict(max_new_tokens=5, do_sample=False), dict(max_new_tokens=5, do_sample=True, top_k=4),
             dict(max_new_tokens=5, prompt_lookup_num_tokens=3)]
    merged = []
    stock = type(model)._prepare_generation_config
    monkeypatch.setattr(type(model), "_prepare_generation_config",
                        lambda self, *a, **k: merged.append(1) or stock(self, *a, **k))
    for _ in range(3):
        for kwargs in calls:
            config, unused = prepare_generation_config(model, None, copy.deepcopy(kwargs))
            want, want_unused = stock(model, None, **copy.deepcopy(kwargs))
            assert config.to_dict() == want.to_dict() and unused == want_unused
    assert len(merged) == len(calls)  # (stock's own calls above go through `stock`, not the counted method)
    for n in range(config_memo.KEPT + 1):  # more distinct calls than are kept: the oldest is merged again
        prepare_generation_config(model, None, dict(max_new_tokens=6 + n))
    prepare_generation_config(model, None, dict(max_new_tokens=6))
    assert len(merged) == len(calls) + config_memo.KEPT + 2


def test_a_remembered_config_is_copied_as_deep_as_a_deep_copy():
    """The copy a remembered call gets shares no mutable attribute with the remembered config (attributes that share
    a list share its copy), and equals a deep copy."""
    from hf_sparsekv.generation.config_memo import _copied

    shared = [4, 5]
    config = GenerationConfig(eos_token_id=[2, 3], sequence_bias={(4,): 1.0}, bad_words_ids=[[6]], max_new_tokens=3)
    config.suppress_tokens = config.begin_suppress_tokens = shared
    copied = _copied(config)
    assert copied.to_dict() == copy.deepcopy(config).to_dict()
    for name, value in vars(config).items():
        if isinstance(value, (list, dict)):
            assert getattr(copied, name) is not value and getattr(copied, name) == value
    assert copied.suppress_tokens is copied.begin_suppress_tokens
    copied.eos_token_id.append(7)
    copied.bad_words_ids[0].append(8)
    copied.max_new_tokens = 9
    assert config.eos_token_id == [2, 3] and config.bad_words_ids == [[6]] and config.max_new_tokens == 3
