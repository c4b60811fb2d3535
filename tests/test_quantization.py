"""Hierarchical INT4/INT8 quantization and the double full-precision buffer."""

from __future__ import annotations

import pytest
import torch

from hf_sparsekv import HierarchicalQuantCache
from hf_sparsekv.kernels.quant_reference import (
    dequantize_keys,
    dequantize_values,
    pack_nibbles,
    quantize_keys,
    quantize_values,
    unpack_nibbles,
)


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed), codes)
    with pytest.raises(ValueError, match="even"):
        pack_nibbles(torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_key_and_value_errors_within_scale_bounds(dtype):
    g = torch.Generator().manual_seed(0)
    keys = (torch.randn(1, 2, 64, 32, generator=g) * 3 + torch.linspace(-5, 5, 32)).to(dtype)
    values = torch.randn(1, 2, 64, 32, generator=g).to(dtype)
    qk = quantize_keys(keys, group_size=16)
    qv = quantize_values(values)
    assert qk.scale.shape == (1, 2, 4, 32) and qv.scale.shape == (1, 2, 64, 1)
    # Bounds from the stored scales: INT4 ≤ s/2, INT8 ≤ s/28 (float32 arithmetic slack 1e-5 relative).
    k_scale = qk.scale.float().repeat_interleave(16, dim=2)
    v_scale = qv.scale.float()
    for x, deq, scale in (
        (keys, lambda v: dequantize_keys(qk, 16, v, torch.float32), k_scale),
        (values, lambda v: dequantize_values(qv, v, torch.float32), v_scale),
    ):
        err4 = (deq(False) - x.float()).abs()
        err8 = (deq(True) - x.float()).abs()
        slack = 1e-5 * x.float().abs().max()
        assert bool((err4 <= scale / 2 + slack).all())
        assert bool((err8 <= scale / 28 + slack).all())
        assert err8.mean() < err4.mean() / 8  # INT8 far below INT4


def test_constant_group_is_exact():
    keys = torch.full((1, 1, 16, 4), 0.75)
    q = quantize_keys(keys, 16)
    assert torch.equal(dequantize_keys(q, 16, True, torch.float32), keys)


def _feed(cache, n, seed=0, d=8):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(1, 2, n, d, generator=g), torch.randn(1, 2, n, d, generator=g)
    return cache.update(k, v, 0), (k, v)


def test_prefill_leaves_between_g_and_2g_tokens_in_full_precision():
    for prompt_len, expected_buffer in ((5, 5), (16, 16), (31, 31), (32, 16), (47, 31), (100, 20)):
        cache = HierarchicalQuantCache(group_size=16)
        (keys, _), (k, _) = _feed(cache, prompt_len)
        assert torch.equal(keys, k)  # the prefill attends in full precision
        assert cache.buffer_length() == expected_buffer
        assert cache.layers[0].quantized_length == prompt_len - expected_buffer


def test_buffer_flushes_at_2g_and_views_differ():
    cache = HierarchicalQuantCache(group_size=16)
    _feed(cache, 20)
    for i in range(12):
        _feed(cache, 1, seed=100 + i)
    assert cache.buffer_length() == 32  # 2G reached: flushed by the next update, not before
    (keys8, _), _ = _feed(cache, 1, seed=7)
    assert cache.buffer_length() == 17 and cache.layers[0].quantized_length == 16
    cache.crop(-1)
    cache.set_view("int4")
    (keys4, _), _ = _feed(cache, 1, seed=7)
    assert keys8.shape == keys4.shape == (1, 2, 33, 8)
    assert torch.equal(keys8[..., 16:, :], keys4[..., 16:, :])  # the buffer is full precision in both views
    assert not torch.equal(keys8[..., :16, :], keys4[..., :16, :])


def test_rollback_inside_buffer_is_exact_and_never_into_quantized_part():
    cache = HierarchicalQuantCache(group_size=16)
    _feed(cache, 40)
    before = cache.layers[0].keys.clone(), cache.layers[0].qkeys.upper.clone()
    _feed(cache, 5, seed=3)
    cache.crop(-5)
    assert torch.equal(cache.layers[0].keys, before[0]) and torch.equal(cache.layers[0].qkeys.upper, before[1])
    with pytest.raises(ValueError, match="quantized"):
        cache.crop(-(cache.buffer_length() + 1))


def test_uniform_room_counts_tokens_before_the_next_flush():
    cache = HierarchicalQuantCache(group_size=16)
    assert cache.uniform_room() == 32
    _feed(cache, 20)  # buffer 20
    assert cache.uniform_room() == 12
    _feed(cache, 12)  # buffer 32: the next update flushes 16 first
    assert cache.uniform_room() == 16


def test_memory_below_half_of_fp16_for_long_contexts():
    cache = HierarchicalQuantCache(group_size=128)
    k = torch.randn(1, 8, 4096, 128, dtype=torch.float16)
    cache.update(k, k.clone(), 0)
    fp16_bytes = 2 * k.numel() * 2
    assert cache.nbytes() < 0.6 * fp16_bytes


def test_static_store_reads_any_span_as_verification_sees_it():
    """The static store's ``sequence(layer, row, start, end)`` (the returned cache of an int4 call) dequantizes only the
    groups a span needs: it equals the whole INT8 view (every code dequantized, then the full-precision buffer) cut to
    the span, for spans inside the codes, across their end, inside the buffer, and of one token."""
    from hf_sparsekv.caches.static import StaticQuantCache
    from hf_sparsekv.generation import engine as static_engine
    from hf_sparsekv.kernels.quant_reference import QuantizedTensor
    from .conftest import prompt, tiny_model

    model = tiny_model("llama")
    n = 150
    model.generate(prompt(n - 20, seed=2), assistant_model=model, draft_cache=HierarchicalQuantCache(group_size=16), max_new_tokens=20,
                   min_new_tokens=20, do_sample=False)
    store = static_engine.current_engine(model).verifier_cache
    assert isinstance(store, StaticQuantCache)
    t, g = store.quantized[0], store.group_size
    assert 0 < t < n - 1 and t % g == 0
    for i in (0, len(store.layers) - 1):
        layer = store.layers[i]
        codes = [QuantizedTensor(q.upper[:1], q.lower[:1], q.scale[:1], q.zero[:1]) for q in (layer.qkeys, layer.qvalues)]
        whole = (torch.cat([dequantize_keys(codes[0], g, True, layer.keys.dtype)[:, :, :t], layer.keys[:1, :, : n - t]], -2),
                 torch.cat([dequantize_values(codes[1], True, layer.values.dtype)[:, :, :t], layer.values[:1, :, : n - t]], -2))
        for start, end in ((0, n - 1), (0, t), (g // 2, t - 3), (t - 5, t + 7), (t, n - 1), (t + 3, t + 4), (g + 1, g + 2)):
            keys, values = store.sequence(i, 0, start, end)
            assert torch.equal(keys, whole[0][:, :, start:end]) and torch.equal(values, whole[1][:, :, start:end])
