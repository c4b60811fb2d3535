"""ChunkBudgetCache over long generations: always-kept recent/sink chunks, the budget, the generated-token window
(eviction of the oldest appended chunks), exact rollback with it, and lossless speculative decoding on it."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from hf_sparsekv import ChunkBudgetCache
from hf_sparsekv.caches.chunk_selection import ChunkSelection
from hf_sparsekv.generation import engine as static_engine

from .conftest import prompt, tiny_model
from .test_caches import _masked_reference_logits


def _sparsekv(arch="llama", layers=None):
    model = copy.deepcopy(tiny_model(arch, layers=layers))
    model.set_attn_implementation("sparsekv")
    return model


@pytest.mark.parametrize("budget,p", [(64, 203), (32, 99), (24, 64)])
def test_recent_and_sink_chunks_always_kept_and_budget_respected(budget, p):
    model = _sparsekv()
    sel = ChunkSelection(recent=16, sink=8)
    cache = ChunkBudgetCache(budget, selection=sel)
    with torch.no_grad():
        model(input_ids=prompt(p, seed=p), past_key_values=cache, use_cache=True)
    for layer in cache.layers:
        kept = set(layer.kept_indices[0, 0].tolist())
        assert len(kept) <= budget and layer.keys.shape[-2] == len(kept)
        assert set(range(p - 16, p)) <= kept  # the recent window
        assert set(range(8)) <= kept  # the sink chunk


def _window_visible(kept, p, w, s):
    """What a one-token step at position t sees with generated_window w: the kept prompt tokens, the appended
    positions from max(p, s·⌊(t - w)/s⌋) on, and itself."""
    return lambda t: kept + list(range(max(p, (t - w) // s * s), t + 1))


@pytest.mark.parametrize("w", [1, 8, 13])
def test_generated_window_logits_match_masked_full_attention(w):
    model = _sparsekv(layers=1)  # one layer: one selection, expressible as one mask
    p, n, budget = 70, 40, 24
    ids = prompt(p + n, seed=w)
    cache = ChunkBudgetCache(budget, generated_window=w, max_rollback=3)
    with torch.no_grad():
        model(input_ids=ids[:, :p], past_key_values=cache, use_cache=True)
        got, stored = [], []
        for t in range(p, p + n):
            got.append(model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[0, -1])
            stored.append(cache.layers[0].keys.shape[-2])
    kept = cache.layers[0].kept_indices[0, 0].tolist()
    with torch.no_grad():
        want = _masked_reference_logits(model, ids, p, _window_visible(kept, p, w, 8))
    torch.testing.assert_close(torch.stack(got), want, rtol=1e-9, atol=1e-9)
    assert max(stored) <= len(kept) + w + 8 - 1 + 3 + 1  # B + window + s - 1 + max_rollback + the step
    assert cache.get_seq_length() == p + n


def _logits_after(model, cache, ids, p, steps):
    """Prefill ``ids[:, :p]`` then feed ``steps`` (a list of token blocks); the logits of the last block."""
    with torch.no_grad():
        model(input_ids=ids[:, :p], past_key_values=cache, use_cache=True)
        out = None
        for block in steps:
            out = model(input_ids=block, past_key_values=cache, use_cache=True).logits[0]
    return out


def test_rollback_with_generated_window_is_exact():
    """Rounds of 5 appended tokens of which 1..5 are right, the rest rolled back: the cache ends up exactly (same
    stored keys, same logits) as one that was fed only the kept blocks, across many evictions."""
    model = _sparsekv()
    p = 50
    ids = prompt(p + 80, seed=5)
    rolled = ChunkBudgetCache(16, generated_window=9, max_rollback=4)
    blocks = []  # what a cache that never saw the rejected tokens is fed
    with torch.no_grad():
        model(input_ids=ids[:, :p], past_key_values=rolled, use_cache=True)
        fed = p
        for i in range(12):
            right = ids[:, fed : fed + 5]
            keep = 1 + i % 5  # at most 4 rolled back
            wrong = right.clone()
            wrong[:, keep:] = (wrong[:, keep:] + 7) % 90 + 3
            model(input_ids=wrong, past_key_values=rolled, use_cache=True)
            rolled.crop(-(5 - keep))
            blocks.append(right[:, :keep])
            fed += keep
        got = model(input_ids=ids[:, fed : fed + 3], past_key_values=rolled, use_cache=True).logits[0]
    straight = ChunkBudgetCache(16, generated_window=9, max_rollback=4)
    want = _logits_after(model, straight, ids, p, blocks + [ids[:, fed : fed + 3]])
    assert rolled.get_seq_length() == straight.get_seq_length() == fed + 3
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    for a, b in zip(rolled.layers, straight.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-12, atol=1e-12)  # same tokens (blocks differ in shape)
    assert rolled.layers[0].appended_start > p  # appended chunks were evicted on the way


def test_rollback_beyond_max_rollback_raises():
    model = _sparsekv()
    cache = ChunkBudgetCache(16, generated_window=4, max_rollback=2)
    ids = prompt(90, seed=1)
    _logits_after(model, cache, ids, 40, [ids[:, t : t + 1] for t in range(40, 80)])
    cache.crop(-2)
    with pytest.raises(ValueError, match="max_rollback"):
        cache.crop(-8)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("gamma", [2, 5])
def test_speculative_decoding_on_a_generated_window_is_lossless(arch, gamma):
    verifier = tiny_model(arch)
    drafter = tiny_model(arch, role="drafter")
    ids = prompt(150, seed=gamma)
    kwargs = dict(max_new_tokens=60, do_sample=False)
    reference = verifier.generate(ids, **kwargs)
    draft_cache = ChunkBudgetCache(32, generated_window=8, max_rollback=gamma - 1)
    out = verifier.generate(ids, assistant_model=drafter, draft_cache=draft_cache, num_assistant_tokens=gamma,
                            **kwargs)
    assert torch.equal(out, reference)
    cache = static_engine.current_engine(verifier).drafter_cache  # bounded: kept chunks, then the window's ring
    assert cache.window == 8 and cache.capacity == 32 + 8 + gamma + 1 + 1


def test_drop_in_generate_with_generated_window_matches_masked_greedy():
    """generate(past_key_values=ChunkBudgetCache(..., generated_window=w)) on a stock (SDPA) model: the hooks pick
    the chunks, and each step sees what the masked full-attention reference lets it see."""
    model = tiny_model("llama", layers=1)
    p, n, w = 80, 30, 8
    ids = prompt(p, seed=11)
    cache = ChunkBudgetCache(24, generated_window=w)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=n, do_sample=False)
    kept = cache.layers[0].kept_indices[0, 0].tolist()
    visible = _window_visible(kept, p, w, 8)
    full = DynamicCache()
    with torch.no_grad():
        token = model(input_ids=ids, past_key_values=full, use_cache=True).logits[0, -1].argmax()
        tokens = [int(token)]
        for t in range(p, p + n - 1):
            mask = torch.zeros(1, 1, 1, t + 1, dtype=torch.bool)
            mask[..., visible(t)] = True
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=full,
                           position_ids=torch.tensor([[t]]), attention_mask=mask, use_cache=True).logits[0, -1]
            tokens.append(int(logits.argmax()))
    eos = model.generation_config.eos_token_id
    if eos in tokens:  # generate() stops at EOS; the reference loop does not
        tokens = tokens[: tokens.index(eos) + 1]
    assert out[0, p:].tolist() == tokens
