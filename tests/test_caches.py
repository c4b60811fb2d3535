"""The three caches against DynamicCache and against independent references."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from hf_sparsekv import ChunkBudgetCache, HierarchicalQuantCache, SinkWindowCache
from hf_sparsekv.caches.chunk_selection import ChunkSelection, cumulative_attention, top_chunk_indices

from .conftest import prompt, tiny_model


def _with_sparsekv(model):
    model = copy.deepcopy(model)
    model.set_attn_implementation("sparsekv")
    return model


@pytest.mark.parametrize(
    "make_cache",
    [
        lambda: ChunkBudgetCache(budget=512),
        lambda: SinkWindowCache(sink=4, window=512),
        lambda: HierarchicalQuantCache(group_size=512),
    ],
    ids=["chunk", "window", "quant"],
)
def test_roomy_cache_generates_like_dynamic_cache(arch, make_cache):
    model = _with_sparsekv(tiny_model(arch))
    ids = prompt(120, seed=1)
    reference = model.generate(ids, max_new_tokens=24, do_sample=False, past_key_values=DynamicCache())
    out = model.generate(ids, max_new_tokens=24, do_sample=False, past_key_values=make_cache())
    assert torch.equal(out, reference)


def _masked_reference_logits(model, ids, prefix_len, visible):
    """Logits of the tokens after the prefix, each computed by full attention with a boolean 4D mask that hides
    every key not in ``visible(t)`` (t = query position); keys stay at their real positions."""
    cache = DynamicCache()
    model(input_ids=ids[:, :prefix_len], past_key_values=cache, use_cache=True)
    logits = []
    for t in range(prefix_len, ids.shape[1]):
        mask = torch.zeros(1, 1, 1, t + 1, dtype=torch.bool)
        mask[..., visible(t)] = True
        out = model(
            input_ids=ids[:, t : t + 1],
            past_key_values=cache,
            position_ids=torch.tensor([[t]]),
            attention_mask=mask,
            use_cache=True,
        )
        logits.append(out.logits[0, -1])
    return torch.stack(logits)


def _cache_logits(model, ids, prefix_len, cache):
    model(input_ids=ids[:, :prefix_len], past_key_values=cache, use_cache=True)
    logits = []
    for t in range(prefix_len, ids.shape[1]):
        logits.append(model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[0, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("budget,prefix_len", [(8, 37), (24, 40), (64, 203)])
def test_chunk_budget_logits_match_masked_full_attention(arch, budget, prefix_len):
    model = _with_sparsekv(tiny_model(arch, layers=1))  # one layer: one selection, expressible as one mask
    ids = prompt(prefix_len + 6, seed=budget)
    cache = ChunkBudgetCache(budget)
    got = _cache_logits(model, ids, prefix_len, cache)
    kept = cache.layers[0].kept_indices[0, 0].tolist()
    assert len(kept) <= budget
    want = _masked_reference_logits(model, ids, prefix_len, lambda t: kept + list(range(prefix_len, t + 1)))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("sink,window", [(4, 8), (0, 5), (2, 30)])
def test_sink_window_logits_match_masked_full_attention(arch, sink, window):
    model = tiny_model(arch)
    prefix_len = 50
    ids = prompt(prefix_len + 12, seed=window)
    got = _cache_logits(model, ids, prefix_len, SinkWindowCache(sink=sink, window=window))

    def visible(t):
        return list(range(min(sink, t))) + list(range(max(sink, t - window), t + 1))

    want = _masked_reference_logits(model, ids, prefix_len, visible)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def _bruteforce_chunks(q, k, scaling, chunk_size, budget, per_head, window=None):
    """float64, full P×P softmax; returns the set of kept token indices per selection group."""
    b, hq, p, d = q.shape
    hkv = k.shape[1]
    kk = k.double().repeat_interleave(hq // hkv, dim=1)
    logits = q.double() @ kk.transpose(-1, -2) * scaling
    logits = logits.masked_fill(torch.ones(p, p, dtype=torch.bool).triu(1), float("-inf"))
    weights = logits.softmax(-1)
    if window is not None:
        weights = weights[:, :, p - window :]
    per_token = weights.sum(-2)  # [B, Hq, P]
    groups = per_token.view(b, hkv, hq // hkv, p).sum(2) if per_head else per_token.sum(1, keepdim=True)
    n_full, tail = divmod(p, chunk_size)
    n_keep = budget // chunk_size - (1 if tail else 0)
    result = []
    for g in range(groups.shape[1]):
        chunk = [float(groups[0, g, c * chunk_size : (c + 1) * chunk_size].sum()) for c in range(n_full)]
        best = sorted(range(n_full), key=lambda c: -chunk[c])[: min(n_keep, n_full)]
        tokens = {c * chunk_size + i for c in best for i in range(chunk_size)}
        result.append(tokens | set(range(n_full * chunk_size, p)))
    return result


def _bruteforce_observed(q, k, scaling, chunk_size, budget, per_head, sel=ChunkSelection()):
    """float64 reference of the observed selection (full P×P softmax, loops); the set of kept token indices per
    selection group."""
    b, hq, p, d = q.shape
    hkv = k.shape[1]
    kk = k.double().repeat_interleave(hq // hkv, dim=1)
    logits = q.double() @ kk.transpose(-1, -2) * scaling
    logits = logits.masked_fill(torch.ones(p, p, dtype=torch.bool).triu(1), float("-inf"))
    weights = logits.softmax(-1)[0]  # [Hq, P, P]
    voters = range(max(0, p - sel.observe), p)
    groups = [list(range(g * hq // hkv, (g + 1) * hq // hkv)) for g in range(hkv)] if per_head else [list(range(hq))]
    s = chunk_size
    chunks = [list(range(c, min(c + s, p))) for c in range(0, p, s)]
    n_keep = min(len(chunks), budget // s)
    result = []
    for heads in groups:
        token = []
        for j in range(p):
            votes = [i for i in voters if i >= j]
            token.append(sum(float(weights[h, i, j]) for h in heads for i in votes) / len(votes))
        half = sel.pool // 2
        pooled = [max(token[max(0, j - half) : j + half + 1]) for j in range(p)]
        n_recent = min(sel.recent, int(sel.recent_cap * budget))
        recent = [c for c, toks in enumerate(chunks) if toks[-1] >= p - n_recent or len(toks) < s]
        sinks = [c for c, toks in enumerate(chunks) if toks[0] < sel.sink]
        kept = sorted(recent, reverse=True)[:n_keep]
        kept += [c for c in sinks if c not in kept][: n_keep - len(kept)]
        rest = sorted((c for c in range(len(chunks)) if c not in kept), key=lambda c: -sum(pooled[t] for t in chunks[c]))
        kept += rest[: n_keep - len(kept)]
        result.append({t for c in kept for t in chunks[c]})
    return result


@pytest.mark.parametrize("p,budget,chunk_size,per_head,sel", [
    (120, 48, 8, False, ChunkSelection(observe=16, pool=3, recent=8, sink=8)),
    (131, 56, 8, True, ChunkSelection(observe=20, pool=5, recent=16, sink=4)),
    (100, 40, 4, False, ChunkSelection(observe=200, pool=1, recent=0, sink=0)),  # every query votes, normalised
    (90, 24, 8, False, ChunkSelection(recent=64, recent_cap=1.0)),  # the recent chunks fill the whole budget
    (300, 96, 8, True, ChunkSelection()),  # the defaults: 3/4 of the budget recent
    (400, 384, 8, False, ChunkSelection()),  # the defaults: 256 recent
    (77, 40, 8, True, ChunkSelection(observe=8, pool=7, recent=30, sink=20)),  # recent + sinks exceed the budget
    (40, 200, 8, False, ChunkSelection()),  # nothing to drop
])
def test_observed_selection_equals_float64_reference(p, budget, chunk_size, per_head, sel):
    from dataclasses import replace

    from hf_sparsekv.caches.chunk_selection import select_chunks

    g = torch.Generator().manual_seed(p + budget)
    q = torch.randn(1, 4, p, 16, generator=g) * 2
    k = torch.randn(1, 2, p, 16, generator=g)
    got = select_chunks(q, k, 0.25, budget, chunk_size, replace(sel, per_kv_head=per_head))
    want = _bruteforce_observed(q, k, 0.25, chunk_size, budget, per_head, sel)
    assert [set(row.tolist()) for row in got[0]] == want
    assert all(row.tolist() == sorted(row.tolist()) for row in got[0])
    assert got.shape[-1] <= budget and got.shape[-1] == min(p, len(want[0]))
    n_recent = sel.recent_tokens(budget)
    tail = set(range(max(0, p - max(n_recent, p % chunk_size)), p)) if budget >= n_recent + chunk_size else set()
    assert all(tail <= kept for kept in want)  # the recent window, whenever it fits, is kept


@pytest.mark.parametrize("sel", [ChunkSelection(), ChunkSelection(observe=8, pool=7),
                                 ChunkSelection(method="cumulative", score_window=16)])
def test_the_voting_queries_alone_select_what_all_the_queries_do(sel):
    """A deferred self-drafter keeps only its prompt's last voting queries: scored from those (the rows before them
    absent), the kept chunks are those of the whole queries; fewer than the voting ones are refused."""
    from hf_sparsekv.caches.chunk_selection import select_chunks, voting_queries

    g = torch.Generator().manual_seed(11)
    p = 700  # more than the default 512 observed queries
    q, k = torch.randn(1, 4, p, 16, generator=g) * 2, torch.randn(1, 2, p, 16, generator=g)
    w = voting_queries(sel, p)
    assert w == min(sel.score_window or sel.observe, p) and w < p
    whole = select_chunks(q, k, 0.25, 64, 8, sel)
    assert torch.equal(select_chunks(q[:, :, -w:].clone(), k, 0.25, 64, 8, sel), whole)
    with pytest.raises(ValueError, match="cannot vote"):
        select_chunks(q[:, :, -(w - 1):], k, 0.25, 64, 8, sel)


@pytest.mark.parametrize("p,budget,chunk_size,per_head,window", [
    (64, 16, 8, False, None), (77, 24, 8, False, None), (100, 40, 4, True, None),
    (33, 200, 8, False, None), (96, 32, 8, True, 16), (50, 8, 8, False, None),
])
def test_chunk_selection_equals_bruteforce(p, budget, chunk_size, per_head, window):
    g = torch.Generator().manual_seed(p + budget)
    q = torch.randn(1, 4, p, 16, generator=g)
    k = torch.randn(1, 2, p, 16, generator=g)
    scores = cumulative_attention(q, k, 0.25, score_window=window, block_size=7)
    scores = scores.view(1, 2, 2, p).sum(2) if per_head else scores.sum(1, keepdim=True)
    got = top_chunk_indices(scores, budget, chunk_size)
    want = _bruteforce_chunks(q, k, 0.25, chunk_size, budget, per_head, window)
    assert [set(row.tolist()) for row in got[0]] == want
    assert all(row.tolist() == sorted(row.tolist()) for row in got[0])


def test_chunk_cache_keeps_post_rope_keys_at_real_positions(arch):
    model = _with_sparsekv(tiny_model(arch))
    ids = prompt(90, seed=3)
    full, sparse = DynamicCache(), ChunkBudgetCache(32, per_kv_head=True)
    model(input_ids=ids, past_key_values=full, use_cache=True)
    model(input_ids=ids, past_key_values=sparse, use_cache=True)
    for layer_full, layer in zip(full.layers, sparse.layers):
        idx = layer.kept_indices  # [1, Hkv, N]
        assert idx.shape[-1] <= 32
        for h in range(idx.shape[1]):
            assert torch.equal(layer.keys[0, h], layer_full.keys[0, h, idx[0, h]])
            assert torch.equal(layer.values[0, h], layer_full.values[0, h, idx[0, h]])
    assert sparse.get_seq_length() == 90


def test_chunk_cache_memory_is_independent_of_prompt_length():
    model = _with_sparsekv(tiny_model("llama"))
    sizes = []
    for length in (104, 400):  # both multiples of the chunk size: exactly 64 tokens kept
        cache = ChunkBudgetCache(64)
        model(input_ids=prompt(length, seed=length), past_key_values=cache, use_cache=True)
        sizes.append(cache.nbytes())
    assert sizes[0] == sizes[1] > 0


def test_cumulative_attention_blockwise_equals_one_block():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 300, 8, generator=g), torch.randn(1, 2, 300, 8, generator=g)
    torch.testing.assert_close(
        cumulative_attention(q, k, 0.3, block_size=17), cumulative_attention(q, k, 0.3, block_size=300)
    )


def test_chunk_cache_without_sparsekv_attention_raises():
    model = tiny_model("llama")  # plain sdpa: the prompt's queries never reach the cache
    cache = ChunkBudgetCache(16)
    model(input_ids=prompt(40, seed=0), past_key_values=cache, use_cache=True)
    with pytest.raises(RuntimeError, match="attn_implementation='sparsekv'"):
        model(input_ids=prompt(1, seed=1), past_key_values=cache, use_cache=True)


def _state(cache):
    tensors = []
    for layer in cache.layers:
        for name, value in sorted(vars(layer).items()):
            if isinstance(value, torch.Tensor):
                tensors.append((name, value.clone()))
            elif hasattr(value, "upper"):  # QuantizedTensor
                tensors += [(f"{name}.{k}", v.clone()) for k, v in vars(value).items()]
        tensors.append(("seen", layer.seen))
    return tensors


def _assert_same_state(a, b):
    assert [n for n, _ in a] == [n for n, _ in b]
    for (name, x), (_, y) in zip(a, b):
        assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), name


@pytest.mark.parametrize(
    "make_cache,prefix_len,k",
    [
        (lambda: ChunkBudgetCache(16), 60, 5),
        (lambda: SinkWindowCache(sink=4, window=32, max_rollback=8), 20, 8),
        (lambda: HierarchicalQuantCache(group_size=16), 70, 7),
    ],
    ids=["chunk", "window", "quant"],
)
def test_append_then_crop_restores_state_bit_for_bit(make_cache, prefix_len, k):
    model = _with_sparsekv(tiny_model("qwen2"))
    cache = make_cache()
    ids = prompt(prefix_len + k + 3, seed=k)
    model(input_ids=ids[:, :prefix_len], past_key_values=cache, use_cache=True)
    model(input_ids=ids[:, prefix_len : prefix_len + 2], past_key_values=cache, use_cache=True)
    before = _state(cache)
    for t in range(prefix_len + 2, prefix_len + 2 + k):  # one token at a time, as drafting does
        model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True)
    cache.crop(-k)
    _assert_same_state(before, _state(cache))
    # and a k-token block, as verification does
    model(input_ids=ids[:, prefix_len + 2 : prefix_len + 2 + k], past_key_values=cache, use_cache=True)
    cache.crop(prefix_len + 2)  # legacy absolute form
    _assert_same_state(before, _state(cache))


def test_sink_window_rollback_within_slack_is_exact_after_eviction():
    model = tiny_model("llama")
    ids = prompt(140, seed=9)
    rolled, straight = SinkWindowCache(4, 16, max_rollback=6), SinkWindowCache(4, 16, max_rollback=6)
    model(input_ids=ids[:, :100], past_key_values=rolled, use_cache=True)
    model(input_ids=ids[:, :100], past_key_values=straight, use_cache=True)
    for t in range(100, 130):  # rounds of: append 6 garbage, roll back 5, keep 1
        for j in range(6):
            model(input_ids=ids[:, 139 - j : 140 - j], past_key_values=rolled, use_cache=True)
        rolled.crop(-6)
        model(input_ids=ids[:, t : t + 1], past_key_values=rolled, use_cache=True)
        model(input_ids=ids[:, t : t + 1], past_key_values=straight, use_cache=True)
    a = model(input_ids=ids[:, 130:131], past_key_values=rolled, use_cache=True).logits
    b = model(input_ids=ids[:, 130:131], past_key_values=straight, use_cache=True).logits
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="max_rollback"):
        rolled.crop(-20)


def test_reset_empties_every_cache():
    model = _with_sparsekv(tiny_model("mistral"))
    for cache in (ChunkBudgetCache(16), SinkWindowCache(2, 8), HierarchicalQuantCache(16)):
        model(input_ids=prompt(50, seed=0), past_key_values=cache, use_cache=True)
        assert cache.get_seq_length() == 50 and cache.nbytes() > 0
        cache.reset()
        assert cache.get_seq_length() == 0 and cache.nbytes() == 0
        reference = model.generate(prompt(30, 1), max_new_tokens=5, do_sample=False)
        assert torch.equal(model.generate(prompt(30, 1), max_new_tokens=5, do_sample=False, past_key_values=cache)[:, :30], reference[:, :30])


@pytest.mark.parametrize(
    "factory,match",
    [
        (lambda: ChunkBudgetCache(0), "budget"),
        (lambda: ChunkBudgetCache(4, chunk_size=8), "budget"),
        (lambda: ChunkBudgetCache(16, chunk_size=0), "chunk_size"),
        (lambda: ChunkBudgetCache(16, score_window=0), "score_window"),
        (lambda: ChunkBudgetCache(16, score_window=8), "score_window"),  # belongs to selection="cumulative"
        (lambda: ChunkBudgetCache(16, selection="snap"), "selection"),
        (lambda: ChunkBudgetCache(16, generated_window=0), "generated_window"),
        (lambda: ChunkBudgetCache(16, max_rollback=-1), "max_rollback"),
        (lambda: ChunkSelection(pool=4), "pool"),
        (lambda: ChunkSelection(recent=-8), "recent"),
        (lambda: ChunkSelection(recent=1.5), "recent"),
        (lambda: ChunkSelection(recent_cap=1.5), "recent_cap"),
        (lambda: ChunkBudgetCache(16, per_kv_head=True, selection=ChunkSelection()), "per_kv_head"),
        (lambda: SinkWindowCache(window=0), "window"),
        (lambda: SinkWindowCache(sink=-1), "sink"),
        (lambda: HierarchicalQuantCache(group_size=12), "group_size"),
        (lambda: HierarchicalQuantCache(group_size=0), "group_size"),
        (lambda: HierarchicalQuantCache(view="int2"), "view"),
        (lambda: ChunkBudgetCache(64, chunk_size=True), "chunk_size"),
        (lambda: SinkWindowCache(window=64, max_rollback=True), "max_rollback"),
        (lambda: HierarchicalQuantCache(group_size=16.0), "group_size"),
    ],
)
def test_bad_arguments_raise_value_error(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


def test_numpy_integer_settings_work_as_python_ints():
    """Settings taken from a NumPy sweep (np.int64) build the same caches as Python ints, and store Python ints."""
    np = pytest.importorskip("numpy")
    model = _with_sparsekv(tiny_model("llama"))
    ids = prompt(70, seed=3)
    for numpy_made, plain in [
        (ChunkBudgetCache(np.int64(32), chunk_size=np.int32(8), score_window=np.int64(16), selection="cumulative"),
         ChunkBudgetCache(32, 8, score_window=16, selection="cumulative")),
        (ChunkBudgetCache(np.int64(32), generated_window=np.int64(9), max_rollback=np.int64(4)),
         ChunkBudgetCache(32, generated_window=9, max_rollback=4)),
        (SinkWindowCache(sink=np.int64(4), window=np.int64(24), max_rollback=np.int64(3)), SinkWindowCache(4, 24, 3)),
        (HierarchicalQuantCache(group_size=np.int64(16)), HierarchicalQuantCache(16)),
    ]:
        out_numpy = model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=numpy_made)
        out_plain = model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=plain)
        assert torch.equal(out_numpy, out_plain)
        assert all(type(v) is int for k, v in vars(numpy_made).items() if k in ("budget", "chunk_size", "sink", "window", "max_rollback", "group_size", "generated_window") and v is not None)
        if isinstance(numpy_made, ChunkBudgetCache) and numpy_made.selection.score_window is not None:
            assert type(numpy_made.selection.score_window) is int


@pytest.mark.parametrize("make_cache", [lambda: ChunkBudgetCache(16), lambda: SinkWindowCache(), lambda: HierarchicalQuantCache(16)])
def test_batch_size_above_one_raises(make_cache):
    model = _with_sparsekv(tiny_model("llama"))
    with pytest.raises(NotImplementedError, match="batch size"):
        model(input_ids=torch.randint(3, 90, (2, 20)), past_key_values=make_cache(), use_cache=True)


def test_stale_scoring_request_is_never_served_to_another_model():
    plain, scoring = tiny_model("llama"), _with_sparsekv(tiny_model("qwen2"))
    stale = ChunkBudgetCache(16)
    plain(input_ids=prompt(40, seed=0), past_key_values=stale, use_cache=True)  # leaves a request nobody serves
    fresh = ChunkBudgetCache(16)
    scoring(input_ids=prompt(40, seed=1), past_key_values=DynamicCache(), use_cache=True)
    scoring(input_ids=prompt(40, seed=1), past_key_values=fresh, use_cache=True)
    assert stale.layers[0].awaiting_scores and stale.get_seq_length() == 40
    assert all(layer.stored_length() <= 16 for layer in fresh.layers)


@pytest.mark.parametrize("window", [None, 40])
def test_cumulative_attention_equals_a_float64_reference(window):
    """Each query head against its KV head's keys (GQA, 3 query heads per KV head), causal softmax in float64,
    summed over the voting queries."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 6, 90, 8, generator=g), torch.randn(2, 2, 90, 8, generator=g)
    logits = (q.double() @ k.double().repeat_interleave(3, dim=1).transpose(-1, -2)) * 0.3
    logits.masked_fill_(torch.ones(90, 90, dtype=torch.bool).triu(1), float("-inf"))
    first = 0 if window is None else 90 - window
    want = torch.softmax(logits, -1)[:, :, first:].sum(-2)
    got = cumulative_attention(q, k, 0.3, score_window=window, block_size=16)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
