"""The cache keyword (``past_key_values`` up to transformers 5.23, ``cache`` from 5.24 on): the name
:func:`cache_keyword` picks reaches the model's cache without a deprecation warning. (Compiled steps take the
name from their engine: tests/test_static.py and the CUDA suite's ``compiled`` tests.)"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

from hf_sparsekv.cache_keyword import cache_keyword, pop_user_cache

from .conftest import ARCHS, tiny_model


def _forward(model, ids, cache):
    return model(input_ids=ids, use_cache=True, **{cache_keyword(model): cache}).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_the_chosen_keyword_fills_the_cache_without_warnings(arch):
    model = tiny_model(arch)
    ids = torch.arange(1, 12)[None]
    cache = DynamicCache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = _forward(model, ids, cache)
    assert cache.get_seq_length() == ids.shape[1]  # the model used our cache, not a fresh one of its own
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    torch.testing.assert_close(logits, model(input_ids=ids, use_cache=False).logits, rtol=0, atol=0)


def test_a_compiled_wrapper_takes_the_keyword_of_the_model_inside():
    """torch.compile's wrapper forwards ``(*args, **kwargs)``; the keyword is read from the wrapped model's forward.
    (DistributedDataParallel: the two-process training test.)"""
    model = tiny_model("llama")
    assert cache_keyword(torch.compile(model)) == cache_keyword(model)


def test_pop_user_cache_takes_either_name_and_refuses_both():
    a, b = DynamicCache(), DynamicCache()
    assert pop_user_cache({"past_key_values": a}) is a and pop_user_cache({"cache": b}) is b
    assert pop_user_cache({}) is None
    kwargs = {"cache": None, "past_key_values": a, "x": 1}
    assert pop_user_cache(kwargs) is a and kwargs == {"x": 1}
    with pytest.raises(TypeError, match="both"):
        pop_user_cache({"cache": a, "past_key_values": b})


def test_a_returned_cache_sits_in_the_field_the_output_declares(caplog):
    """With return_dict_in_generate the caller's prefix cache (extended to the sequence, as stock leaves its cache)
    is stored under the output class's own field (``cache`` from transformers 5.24 on), so building the output logs
    no deprecation of ``past_key_values``; without a cache passed in, the field holds a new ``DynamicCache`` of the
    sequence, as stock's does (the engine's static buffers stay its own)."""
    import logging

    from transformers.utils import logging as hf_logging

    from hf_sparsekv.cache_keyword import output_field

    verifier, drafter = tiny_model("llama"), tiny_model("llama", role="drafter")
    ids = torch.arange(3, 40)[None]
    logging.Logger.warning_once.cache_clear()  # transformers logs this deprecation once per process
    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            prefix = DynamicCache()
            out = verifier.generate(ids, assistant_model=drafter, kv_budget=16, max_new_tokens=6, do_sample=False,
                                    return_dict_in_generate=True, past_key_values=prefix)
            bare = verifier.generate(ids, assistant_model=drafter, kv_budget=16, max_new_tokens=6, do_sample=False,
                                     return_dict_in_generate=True)
    finally:
        hf_logging.disable_propagation()
    assert not [r for r in caplog.records if "past_key_values" in r.getMessage()]
    cache = getattr(out, output_field(type(out)))
    assert cache is prefix and cache.get_seq_length() == out.sequences.shape[1] - 1
    fresh = getattr(bare, output_field(type(bare)))
    assert type(fresh) is DynamicCache and fresh.get_seq_length() == bare.sequences.shape[1] - 1


@pytest.mark.parametrize("kind", ["chunk", "dynamic"])
def test_a_cache_passed_to_stock_generate_warns_only_as_stock_does(kind):
    """A cache passed to stock generate() (no kv_budget) goes through our guarded wrapper: under the keyword this
    transformers expects it raises no warning; under the old name it raises at most stock's own FutureWarning,
    attributed like stock's to the line that called generate(), never to a file of ours. The output is the same."""
    from hf_sparsekv import ChunkBudgetCache
    from hf_sparsekv.generation import registration

    from .conftest import prompt

    model = tiny_model("llama")
    ids = prompt(40, seed=1)
    make = (lambda: ChunkBudgetCache(16)) if kind == "chunk" else DynamicCache
    outputs = []
    for name in ("past_key_values", cache_keyword(model)):  # the same name twice before 5.24
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outputs.append(model.generate(ids, max_new_tokens=4, do_sample=False, **{name: make()}))
        cache_warnings = [w for w in caught if "past_key_values" in str(w.message)]
        assert not [w for w in cache_warnings if "hf_sparsekv" in w.filename], [w.filename for w in cache_warnings]
        if name == cache_keyword(model) or not registration._keyword_renames(registration._original):
            assert not cache_warnings
        else:  # 5.24+: stock's deprecation, pointing at this test
            assert len(cache_warnings) == 1 and cache_warnings[0].filename == __file__
            assert cache_warnings[0].category is FutureWarning
    assert torch.equal(*outputs)
