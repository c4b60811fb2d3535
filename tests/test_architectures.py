"""Attention semantics on the engine: every option a model's attention asks for is computed exactly or the call is
refused (explicit engine options) or handed to stock (stock's own calls), never silently different.

The grid (:mod:`tests.arch_grid`) runs each causal-LM architecture of the installed transformers through six calls
against stock greedy ``generate()``: by default the architectures whose attention differs from Llama's (chunked,
soft-capped, with sinks, sliding), the rest with ``make test-extended``, where each row is also checked against the
generated page docs/architectures.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers

import hf_sparsekv
from hf_sparsekv.generation import attention_semantics
from hf_sparsekv.generation.attention_semantics import AttentionNotServed, LayerAttention, classify_mask, served_layers
from transformers.masking_utils import (
    bidirectional_mask_function, causal_mask_function, chunked_causal_mask_function,
    sliding_window_causal_mask_function,
)

from . import arch_grid

PAGE = Path(__file__).resolve().parent.parent / "docs" / "architectures.md"
# Served by the engine with attention unlike plain causal: chunked (Llama 4), soft-capped logits (Gemma 2), attention
# sinks with alternating sliding layers (GPT-OSS), sliding windows (Mistral, Gemma 3), rope scaling past its threshold
ATTENTION_CASES = ("llama4_text", "gemma2", "gpt_oss", "mistral", "gemma3_text", "llama@dynamic-ntk", "phi3@longrope")


def _assert_row(row: arch_grid.Row, every_call_on_engine: bool) -> None:
    assert not row.built, row.built
    bad = {name: o for name, o in row.outcomes.items() if o[0] in ("DIFFERENT", "error")}
    assert not bad, bad
    if every_call_on_engine:
        assert {name: o[0] for name, o in row.outcomes.items()} == dict.fromkeys(arch_grid.CALLS, "engine")


@pytest.mark.parametrize("arch", ATTENTION_CASES)
def test_attention_unlike_llamas_runs_on_the_engine_with_stock_tokens(arch):
    _assert_row(arch_grid.run_arch(arch), every_call_on_engine=True)


def _page_rows() -> dict[str, str]:
    text = PAGE.read_text()
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| ([^ |]+) \|.*\|$", text, re.M)}


@pytest.mark.extended
@pytest.mark.parametrize("arch", arch_grid.architectures())
def test_every_architecture_is_served_exactly_or_refused(arch):
    """No call of any architecture gives other tokens than stock greedy; on the transformers the page was generated
    with, the row equals the page's (regenerate with ``make architectures``)."""
    row = arch_grid.run_arch(arch)
    if row.built:
        pytest.skip(f"not built with the grid's tiny settings: {row.built}")
    _assert_row(row, every_call_on_engine=False)
    page = PAGE.read_text()
    if f"on transformers {transformers.__version__}:" in page:
        lines = arch_grid.table([row]).splitlines()
        ours = re.sub(r" \[\d+\]", "", lines[2])
        assert re.sub(r" \[\d+\]", "", _page_rows().get(arch, "")) == ours


def test_the_page_covers_every_architecture_of_its_transformers():
    page = PAGE.read_text()
    if f"on transformers {transformers.__version__}:" not in page:
        pytest.skip("docs/architectures.md was generated on another transformers release")
    listed = set(_page_rows()) | set(re.findall(r"^- ([^:]+):", page, re.M))
    assert listed - {"architecture", "---"} == set(arch_grid.architectures())


def test_mask_functions_are_classified_from_their_pattern():
    config = transformers.LlamaConfig(max_position_embeddings=512, sliding_window=48, attention_chunk_size=40)
    none = torch.zeros(1, dtype=torch.long)
    assert classify_mask(causal_mask_function, config) == ("causal", None)
    assert classify_mask(sliding_window_causal_mask_function(48), config) == ("window", 48)
    assert classify_mask(chunked_causal_mask_function(40, none), config) == ("chunk", 40)
    assert classify_mask(bidirectional_mask_function, config)[0] == "unknown"

    def every_other(b, h, q, kv):  # a dilated pattern: causal, but not one run of positions
        return (kv <= q) & ((q - kv) % 2 == 0)

    assert classify_mask(every_other, config)[0] == "unknown"

    def host_side(b, h, q, kv):  # not index-based: cannot be evaluated on tensors
        return bool(kv <= q)

    assert classify_mask(host_side, config)[0] == "unknown"


def test_the_probe_reads_each_layers_rules():
    gemma2 = arch_grid.build("gemma2")
    before = gemma2.config._attn_implementation
    layers = served_layers(gemma2)
    assert layers == (LayerAttention(0, window=64, softcap=50.0), LayerAttention(1, softcap=50.0))
    assert gemma2.config._attn_implementation == before  # restored
    llama4 = arch_grid.build("llama4_text")
    assert {layer.chunk for layer in served_layers(llama4)} == {64}
    gpt_oss = arch_grid.build("gpt_oss")
    assert [(layer.window, layer.sinks) for layer in served_layers(gpt_oss)] == [(64, True), (None, True)]


def test_an_unknown_attention_option_is_named():
    assert "'alibi'" in attention_semantics._layer_record(0, ("causal", None), 0.0, {"alibi": torch.zeros(1)})
    assert "dropout" in attention_semantics._layer_record(0, ("causal", None), 0.1, {})
    record = attention_semantics._layer_record(0, ("window", 32), 0.0, {"sliding_window": 16})
    assert "32" in record and "16" in record


def test_an_unknown_mask_function_hands_routed_calls_to_stock_and_refuses_explicit_ones(monkeypatch):
    """A model whose causal mask gains a mask function the check has never seen (here a dilation): stock's assisted
    and prompt-lookup calls run on stock's path with stock's tokens; the engine's options raise naming it."""
    from transformers.models.llama import modeling_llama

    model = arch_grid.build("llama")
    ids = torch.randint(3, arch_grid.VOCAB, (1, 120), generator=torch.Generator().manual_seed(3))
    kwargs = dict(do_sample=False, max_new_tokens=8, min_new_tokens=8)
    before = model.generate(ids, static_engine=True, **kwargs)
    hf_sparsekv.release_engines(model)
    attention_semantics.forget(model)
    stock_mask = modeling_llama.create_causal_mask

    def dilated(b, h, q, kv):
        return (q - kv) % 3 != 1

    monkeypatch.setattr(modeling_llama, "create_causal_mask",
                        lambda **kw: stock_mask(**kw, and_mask_function=dilated))
    reference = arch_grid._stock(model, ids, **kwargs)
    assert not torch.equal(reference, before)  # the mask matters
    for call in (dict(assistant_model=model), dict(prompt_lookup_num_tokens=3), dict(static_engine=True)):
        out = model.generate(ids, return_dict_in_generate=True, **call, **kwargs)
        assert torch.equal(out.sequences, reference)
        assert getattr(out, "spec_stats", None) is None  # stock's path served it
    with pytest.raises(AttentionNotServed, match="not one run"):
        model.generate(ids, assistant_model=model, kv_budget=32, **kwargs)
    monkeypatch.undo()
    attention_semantics.forget(model)
    assert torch.equal(model.generate(ids, static_engine=True, **kwargs), before)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ATTENTION_CASES)
def test_attention_unlike_llamas_on_the_graph_path(arch, exact_cuda_float32):
    _assert_row(arch_grid.run_arch(arch, device="cuda"), every_call_on_engine=True)


def test_token_type_ids_of_a_gpt2_reach_the_engine():
    """GPT-2 adds token types to its input embeddings: the engine feeds the prompt's, then the last one to every new
    token, as stock does; plain decoding, prompt lookup and a separate drafter run on the engine with stock's tokens,
    and what it does not serve with them (self-drafting, a batch) is refused naming them (routed: stock's path)."""
    model, drafter = arch_grid.build("gpt2"), arch_grid.build("gpt2", seed=1)
    ids = torch.randint(3, arch_grid.VOCAB, (1, 120), generator=torch.Generator().manual_seed(1))
    types = torch.zeros_like(ids)
    types[:, 60:] = 1
    kwargs = dict(do_sample=False, max_new_tokens=12, min_new_tokens=12, return_dict_in_generate=True)
    reference = arch_grid._stock(model, ids, token_type_ids=types, **kwargs).sequences
    assert not torch.equal(reference, arch_grid._stock(model, ids, **kwargs).sequences)  # the types matter
    for call in (dict(static_engine=True), dict(prompt_lookup_num_tokens=3), dict(assistant_model=drafter),
                 dict(assistant_model=drafter, kv_budget=32)):
        out = model.generate(ids, token_type_ids=types, **call, **kwargs)
        assert torch.equal(out.sequences, reference) and out.spec_stats is not None, call
    with pytest.raises(NotImplementedError, match="token_type_ids"):
        model.generate(ids, token_type_ids=types, assistant_model=model, kv_budget=32, **kwargs)
    with pytest.raises(NotImplementedError, match="token_type_ids"):
        model.generate(ids.repeat(2, 1), token_type_ids=types.repeat(2, 1), assistant_model=drafter, kv_budget=32,
                       **kwargs)
    out = model.generate(ids, token_type_ids=types, assistant_model=model, **kwargs)  # routed: stock's path
    assert torch.equal(out.sequences, reference)


@pytest.mark.parametrize("arch,per_call", [("llama@dynamic-ntk", True), ("phi3@longrope", True), ("llama", False),
                                           ("gemma3_text", False)])
def test_a_rotary_embedding_that_reads_positions_on_the_host_is_never_captured(arch, per_call):
    """Dynamic NTK and LongRoPE choose their frequencies from a comparison on the host each call, which a CUDA graph
    cannot record: such models are known before any capture is tried (a failed capture would leave CUDA's generator
    marked as capturing); other rotary kinds are captured."""
    from hf_sparsekv.generation.graph_steps import updates_rotary_per_call

    model = arch_grid.build(arch)
    assert updates_rotary_per_call(model) is per_call


def test_the_rotary_check_walks_a_model_once_and_reads_its_rotary_modules_each_call(monkeypatch):
    """The check runs twice a ``generate()`` call: the model's modules are walked once, then each call reads the
    ``rope_type`` of the rotary modules found (a change of it is seen); a model whose children change is walked
    again."""
    import torch.nn as nn

    from hf_sparsekv.generation.graph_steps import updates_rotary_per_call

    model = arch_grid.build("llama")
    walks = []
    original = nn.Module.modules

    def counted(self):
        walks.append(self)
        return original(self)

    monkeypatch.setattr(nn.Module, "modules", counted)
    assert [updates_rotary_per_call(model) for _ in range(3)] == [False] * 3
    assert walks.count(model) == 1
    rotary = next(m for m in original(model) if hasattr(m, "rope_type"))
    monkeypatch.setattr(rotary, "rope_type", "dynamic")
    assert updates_rotary_per_call(model) is True and walks.count(model) == 1
    monkeypatch.setattr(rotary, "rope_type", "default")
    model.extra = nn.Linear(2, 2)  # (a new child: walked again)
    assert updates_rotary_per_call(model) is False and walks.count(model) == 2
