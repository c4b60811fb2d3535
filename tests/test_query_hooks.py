"""ChunkBudgetCache under the model's own attention implementation (eager, SDPA, flash-attn when installed): the
prompt's queries come through forward hooks (hf_sparsekv.caches.query_hooks). References: the queries the
attention function really receives (recorded by a test-only attention implementation), the brute-force selection
of test_caches, and greedy decoding with full attention under a mask that hides the dropped prompt tokens."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from transformers import AttentionInterface, DynamicCache, Qwen3Config, Qwen3ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

import hf_sparsekv
from hf_sparsekv import ChunkBudgetCache

from .conftest import VOCAB, prompt, tiny_model
from hf_sparsekv.caches.chunk_selection import ChunkSelection

from .test_caches import _bruteforce_observed

IMPLS = ["eager", "sdpa"]  # flash-attn needs CUDA and half precision: test_hooked_selection_on_cuda_half_precision
_recorded: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}


def _recording_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA, remembering per layer the query and key tensors the attention receives (the independent reference)."""
    _recorded[module.layer_idx] = (query.clone(), key.clone(), scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


AttentionInterface.register("test_record", _recording_attention)
AttentionMaskInterface.register("test_record", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def _model(arch: str, impl: str, layers: int | None = None):
    if arch == "qwen3":  # q_norm/k_norm: the recipe must apply the module's norms
        config = Qwen3Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers or 2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).eval().to(torch.float64)
    else:
        model = copy.deepcopy(tiny_model(arch, layers=layers))
    model.set_attn_implementation(impl)
    return model


def _recorded_prompt_queries(model, ids):
    """{layer_idx: (query [1, Hq, P, D], key [1, Hkv, P, D], scaling)} as the attention function receives them."""
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("test_record")
    _recorded.clear()
    with torch.no_grad():
        reference(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
    return dict(_recorded)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("budget,p,per_head", [(24, 90, False), (40, 203, True), (16, 37, False)])
def test_hooked_selection_equals_bruteforce_on_the_real_queries(arch, impl, budget, p, per_head):
    model = _model(arch, impl)
    ids = prompt(p, seed=budget + p)
    sel = ChunkSelection(observe=24, pool=3, recent=8, sink=8, per_kv_head=per_head)  # the scores decide most chunks
    cache = ChunkBudgetCache(budget, selection=sel)
    with torch.no_grad(), hf_sparsekv.prompt_queries(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    recorded = _recorded_prompt_queries(model, ids)
    assert len(recorded) == len(cache.layers) >= 2
    for i, layer in enumerate(cache.layers):
        q, k, scaling = recorded[i]
        want = _bruteforce_observed(q, k, scaling, 8, budget, per_head, sel)
        got = [set(row.tolist()) for row in layer.kept_indices[0]]
        assert got == want, f"layer {i}"
        assert all(len(s) <= budget for s in got) and len(got[0]) < p  # something was dropped
    # and the same selection as the "sparsekv" attention path
    direct = copy.deepcopy(model)
    direct.set_attn_implementation("sparsekv")
    other = ChunkBudgetCache(budget, selection=sel)
    with torch.no_grad():
        direct(input_ids=ids, past_key_values=other, use_cache=True)
    for a, b in zip(cache.layers, other.layers):
        assert torch.equal(a.kept_indices, b.kept_indices)


def _masked_greedy(model, ids, kept, n_new):
    """Greedy continuation where, after the (full-attention) prefill, each step attends to the prompt tokens in
    ``kept`` and to every token generated so far; full attention on a DynamicCache with a boolean 4D mask."""
    p = ids.shape[1]
    cache = DynamicCache()
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        tokens = [int(logits.argmax())]
        for t in range(p, p + n_new - 1):
            mask = torch.zeros(1, 1, 1, t + 1, dtype=torch.bool)
            mask[..., kept + list(range(p, t + 1))] = True
            out = model(
                input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=torch.tensor([[t]]),
                attention_mask=mask, use_cache=True,
            )
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("impl", IMPLS)
def test_generate_with_chunk_cache_on_a_stock_model(arch, impl):
    model = _model(arch, impl, layers=1)  # one layer: one selection, expressible as one mask
    budget, p, n_new = 32, 120, 12
    ids = prompt(p, seed=7)
    out = model.generate(ids, past_key_values=ChunkBudgetCache(budget), max_new_tokens=n_new, do_sample=False)
    q, k, scaling = _recorded_prompt_queries(model, ids)[0]
    kept = sorted(_bruteforce_observed(q, k, scaling, 8, budget, False)[0])
    assert len(kept) == budget
    assert out[0, p:].tolist() == _masked_greedy(tiny_model(arch, layers=1), ids, kept, n_new)
    assert all(not m._forward_hooks for m in model.modules())  # the hooks live only for the call


def test_direct_forward_without_hooks_raises_naming_the_ways_out():
    cache = ChunkBudgetCache(16)
    tiny_model("llama")(input_ids=prompt(40, seed=0), past_key_values=cache, use_cache=True)
    with pytest.raises(RuntimeError, match="prompt_queries"):
        tiny_model("llama")(input_ids=prompt(1, seed=1), past_key_values=cache, use_cache=True)


def test_unknown_query_path_raises_instead_of_selecting_wrongly():
    model = copy.deepcopy(tiny_model("llama"))
    attn = model.model.layers[0].self_attn
    base = type(attn)

    class ScaledInputAttention(base):  # a module whose projections differ from the recipe's
        def forward(self, hidden_states, *args, **kwargs):
            return base.forward(self, hidden_states * 2.0, *args, **kwargs)

    attn.__class__ = ScaledInputAttention
    with pytest.raises(NotImplementedError, match="ScaledInputAttention"):
        model.generate(prompt(40, seed=2), past_key_values=ChunkBudgetCache(16), max_new_tokens=3, do_sample=False)


def test_fused_qkv_module_raises():
    from transformers import Phi3Config, Phi3ForCausalLM

    model = Phi3ForCausalLM(Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=0,
    )).eval()
    with pytest.raises(NotImplementedError, match="q_proj"):
        model.generate(prompt(40, seed=3), past_key_values=ChunkBudgetCache(16), max_new_tokens=2, do_sample=False)


@pytest.mark.cuda
@pytest.mark.parametrize("impl", ["sdpa", "flash_attention_2"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_hooked_selection_on_cuda_half_precision(arch, impl):
    """bf16 on CUDA: the hooks recompute the queries with the module's own ops, so the selection is the one the
    "sparsekv" attention makes from the query it receives, index for index."""
    if impl == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    model = copy.deepcopy(tiny_model(arch)).to("cuda", torch.bfloat16)
    model.set_attn_implementation(impl)
    ids = prompt(300, seed=11).cuda()
    hooked, direct = ChunkBudgetCache(64), ChunkBudgetCache(64)
    with torch.no_grad(), hf_sparsekv.prompt_queries(model):
        model(input_ids=ids, past_key_values=hooked, use_cache=True)
    model.set_attn_implementation("sparsekv")
    with torch.no_grad():
        model(input_ids=ids, past_key_values=direct, use_cache=True)
    for a, b in zip(hooked.layers, direct.layers):
        assert torch.equal(a.kept_indices, b.kept_indices)
    out = copy.deepcopy(model)
    out.set_attn_implementation(impl)
    generated = out.generate(ids, past_key_values=ChunkBudgetCache(64), max_new_tokens=8, do_sample=False)
    assert generated.shape[1] == 308


def _neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    model = GPTNeoXForCausalLM(config).eval().double()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # wide argmax gaps, varied greedy paths
    return model


def test_cache_passed_as_layer_past_reaches_the_self_drafter():
    """GPT-NeoX-style modules take the cache as ``layer_past``: self-drafting on a sink+window or a chunk view of
    the model's own prefill equals its greedy output (the chunk view takes the fused qkv's queries from the
    attention call)."""
    model = _neox()
    for seed in range(3):
        ids = prompt(50, seed)
        greedy = model.generate(ids, do_sample=False, max_new_tokens=16)
        for mode in ("window", "chunk"):
            ours = model.generate(ids, assistant_model=model, draft_cache=mode, kv_budget=16, max_new_tokens=16,
                                  do_sample=False, num_assistant_tokens=3)
            assert torch.equal(ours, greedy)


def test_another_rotary_recipe_raises_not_implemented():
    """GPT-J's rotary embedding takes no (cos, sin) pair: refused with NotImplementedError, not a TypeError."""
    from transformers import GPTJConfig, GPTJForCausalLM

    model = GPTJForCausalLM(GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=4, rotary_dim=8,
                                       n_positions=256)).eval()
    with pytest.raises(NotImplementedError, match="GPTJAttention"):
        model.generate(prompt(40, seed=3), past_key_values=ChunkBudgetCache(16), max_new_tokens=2, do_sample=False)


def _phi3(layers: int = 1):
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    return Phi3ForCausalLM(Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=0,
    )).eval().double()


def test_self_chunk_under_any_attention_implementation():
    """Self-drafting on a chunk budget runs on the engine's own attention during the call, whatever the model's
    implementation (here a custom registered one, under which the query hooks could not take the queries):
    lossless, and the model's implementation is restored."""
    from hf_sparsekv.generation import engine as static_engine

    model = _phi3()
    ids = prompt(40, seed=3)
    reference = model.generate(ids, max_new_tokens=6, do_sample=False)
    model.set_attn_implementation("test_record")
    out = model.generate(ids, assistant_model=model, kv_budget=16, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, reference)
    assert static_engine.current_engine(model).spec.mode == "chunk"
    assert model.config._attn_implementation == "test_record"


@pytest.mark.parametrize("arch", ["phi3", "stablelm", "gpt_neox", "llama"])
def test_sparsekv_attention_selects_from_the_queries_the_attention_receives(arch):
    """Stock generate() on a ChunkBudgetCache under the "sparsekv" attention selects exactly the chunks the
    brute-force selection picks from the queries the attention function receives (recorded by the test attention),
    for fused qkv (Phi-3, GPT-NeoX) and partial rotary (StableLM, GPT-NeoX) alike."""
    model = copy.deepcopy(tiny_model(arch))
    ids, budget = prompt(77, seed=5), 24
    recorded = _recorded_prompt_queries(model, ids)
    want = {i: _bruteforce_observed(q, k, scaling, 8, budget, False) for i, (q, k, scaling) in recorded.items()}
    model.set_attn_implementation("sparsekv")
    cache = ChunkBudgetCache(budget)
    model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False)
    got = {i: [set(row.tolist()) for row in layer.kept_indices[0]] for i, layer in enumerate(cache.layers)}
    assert got == want and len(want) == 2 and len(want[0][0]) <= budget


def test_stock_generate_with_a_chunk_cache_on_partial_rotary():
    """StableLM rotates a quarter of each head: the hooks of stock generate() rotate that part only, so the
    selection is the brute-force one on the real queries and the output the masked-attention greedy reference."""
    model = tiny_model("stablelm", layers=1)  # one layer: one selection, expressible as one mask
    budget, p, n_new = 32, 100, 10
    ids = prompt(p, seed=4)
    out = model.generate(ids, past_key_values=ChunkBudgetCache(budget), max_new_tokens=n_new, do_sample=False)
    q, k, scaling = _recorded_prompt_queries(model, ids)[0]
    kept = sorted(_bruteforce_observed(q, k, scaling, 8, budget, False)[0])
    assert out[0, p:].tolist() == _masked_greedy(model, ids, kept, n_new)


def test_stock_generate_refuses_a_fused_qkv_with_partial_rotary_clearly():
    """GPT-NeoX (fused query_key_value): stock generate() with a chunk cache cannot recompute the queries; the
    error names the module and the way out, raised by us (never a shape error inside transformers)."""
    with pytest.raises(NotImplementedError, match="GPTNeoXAttention.*attn_implementation='sparsekv'"):
        _neox().generate(prompt(40, seed=3), past_key_values=ChunkBudgetCache(16), max_new_tokens=2, do_sample=False)


def test_chunked_prefill_is_refused_rather_than_left_uncompressed():
    """With ``prefill_chunk_size`` the cache would select from the first piece and keep every later one."""
    model = copy.deepcopy(tiny_model("llama"))
    cache = ChunkBudgetCache(16)
    with pytest.raises(NotImplementedError, match="prefill_chunk_size=16"):
        model.generate(prompt(40, seed=3), past_key_values=cache, max_new_tokens=2, do_sample=False,
                       prefill_chunk_size=16)
    model.generation_config.prefill_chunk_size = 24
    with pytest.raises(NotImplementedError, match="prefill_chunk_size=24"):
        model.generate(prompt(40, seed=3), past_key_values=ChunkBudgetCache(16), max_new_tokens=2, do_sample=False)
    assert cache.get_seq_length() == 0  # refused before any forward
