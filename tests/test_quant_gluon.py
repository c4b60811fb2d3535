"""The Gluon kernel of the quantized segment (hf_sparsekv.kernels.quant_gluon).

CPU: its index chains, replayed with torch ops on code bytes (what each PTX call puts in which register slot, then
the kernel's reshapes and permutes), against the stored layout of :mod:`~hf_sparsekv.kernels.quant_reference`; and
the kernel compiled for sm_90 with both views and dtypes (its layout conversions are asserted to move no data).
CUDA: the kernel against the float32 reference and the Triton kernel (1 to 8 query rows per KV head, head_dim 64 and
128, odd group counts), every launch setting, int4 self-speculation on the graph path, and the fallback to the Triton
kernel (batch rows with lengths on the device: tests/test_kernels.py's real-size quantized tests)."""

from __future__ import annotations

import pytest
import torch

from hf_sparsekv.kernels.quant_gluon import key_channel, value_channel
from hf_sparsekv.kernels.quant_reference import unpack_nibbles

gluon_kernel = pytest.importorskip("hf_sparsekv.kernels._quant_gluon", reason="a Triton with Gluon")


def _nibble(byte: torch.Tensor, high: int) -> torch.Tensor:
    return (byte >> 4) if high else (byte & 15)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block", [32, 64])
def test_key_tile_chain_puts_stored_channel_key_channel_in_each_column(head_dim, block):
    """The key PTX returns, per word of 4 bytes, low (then high) nibbles of bytes 0, 2, 1, 3 in its 4 slots; the
    join / reshape / permute chain then must leave stored channel ``key_channel(kappa)`` in operand column kappa."""
    g = torch.Generator().manual_seed(head_dim + block)
    codes = torch.randint(0, 256, (block, head_dim // 2), generator=g, dtype=torch.uint8)
    words = codes.view(block, head_dim // 8, 4)
    slot_byte = torch.tensor([0, 2, 1, 3])
    lo, hi = (_nibble(words[:, :, slot_byte], h).reshape(block, head_dim // 2) for h in (0, 1))
    tile = torch.stack((lo, hi), -1).reshape(gluon_kernel.key_tile_shape(block, head_dim))
    tile = tile.permute(*gluon_kernel.order("key")).reshape(block, head_dim)
    kappa = torch.arange(head_dim)
    expected = unpack_nibbles(codes)[:, key_channel(kappa, head_dim)]
    assert torch.equal(tile, expected)
    assert sorted(key_channel(kappa, head_dim).tolist()) == kappa.tolist()  # a permutation


@pytest.mark.parametrize("head_dim", [64, 128])
def test_query_side_chain_matches_the_key_columns(head_dim):
    """Query rows and key scales are loaded in stored channel order and permuted by the "channel" order: column kappa of
    the result must hold channel ``key_channel(kappa)``, the channel of the key operand's column kappa."""
    rows = 8
    stored = torch.arange(head_dim)[:, None].expand(head_dim, rows)
    permuted = stored.reshape(gluon_kernel.channel_shape(head_dim, rows)).permute(*gluon_kernel.order("channel"))
    permuted = permuted.reshape(head_dim, rows)
    assert torch.equal(permuted[:, 0], key_channel(torch.arange(head_dim), head_dim))
    assert torch.equal(permuted, permuted[:, :1].expand(head_dim, rows))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block", [32, 64])
def test_value_tile_chain_puts_stored_channel_value_channel_in_each_row(head_dim, block):
    """The value PTX takes 4 bytes of an even and of the next, odd token and returns in X_k (k = 0..3) the (even, odd)
    pairs of bytes 2·(k % 2) + {0, 1}, nibble k // 2; the chain must leave ``value_channel(mu)`` of each token in
    operand row mu, column = token."""
    g = torch.Generator().manual_seed(head_dim * block)
    codes = torch.randint(0, 256, (block, head_dim // 2), generator=g, dtype=torch.uint8)
    even, odd = codes[0::2], codes[1::2]
    words = torch.stack((even, odd), -1).view(block // 2, head_dim // 8, 4, 2)  # [p, word, byte, τ]
    xs = []
    for k in range(4):
        pair = words[:, :, 2 * (k % 2): 2 * (k % 2) + 2, :]  # [p, word, β, τ]
        xs.append(_nibble(pair, k // 2).reshape(block // 2, head_dim // 2))  # slot 2β + τ of each word
    v = torch.stack((torch.stack((xs[0], xs[1]), -1), torch.stack((xs[2], xs[3]), -1)), -1)
    v = v.reshape(gluon_kernel.value_tile_shape(block, head_dim)).permute(*gluon_kernel.order("value"))
    v = v.reshape(block, 8, head_dim // 8).permute(2, 1, 0).reshape(head_dim, block)
    mu = torch.arange(head_dim)
    assert torch.equal(v, unpack_nibbles(codes)[:, value_channel(mu, head_dim)].T)
    assert sorted(value_channel(mu, head_dim).tolist()) == mu.tolist()


@pytest.mark.parametrize("view,dtype,lengths_on_device", [
    ("int4", torch.float16, False),
    ("int8", torch.bfloat16, True),
], ids=["int4-fp16", "int8-bf16-device-lengths"])
def test_gluon_kernel_compiles_for_hopper_with_operands_straight_from_registers(kernel_asm, view, dtype,
                                                                               lengths_on_device):
    """Every layout conversion on the code tiles is compiled with ``assert_trivial`` (a conversion that would move
    data fails the compile); the loop copies codes by cp.async (LDGSTS), multiplies on tensor cores, converts no
    code to float (a handful of I2F for the launch's own integers, against hundreds per block if codes were converted
    so) and keeps its operands out of local memory."""
    fn, call = kernel_asm.recorded_gluon_launch("llama3-8b", view, 1, dtype, lengths_on_device=lengths_on_device)
    assert fn.is_gluon()
    kernel = kernel_asm.compile_for(fn, call, 90)
    mix, _ = kernel_asm.sass_mix(kernel, top=200)
    ops = dict(mix)
    assert "HMMA" in ops and "LDGSTS" in ops and "LDS" in ops
    assert ops.get("I2F", 0) + ops.get("I2FP", 0) <= 4
    res = kernel_asm.resources(kernel)
    assert res["registers"] <= 255 and res["shared"] > 0


@pytest.mark.parametrize("view,dtype", [("int8", torch.float16), ("int4", torch.bfloat16)], ids=["int8-fp16", "int4-bf16"])
def test_sixteen_rows_per_program_compile_for_hopper(kernel_asm, view, dtype):
    """Programs of 16 rows for a verification block (6 queries, 24 rows per KV head: two programs per split) with
    16-token blocks: the layouts hold (every code-tile conversion trivial) and the MMA's N side is two tiles."""
    from hf_sparsekv.kernels import decode_core

    with decode_core.quant_config(**{f"gluon_{view}_rows16": (16, 3)}):
        fn, call = kernel_asm.recorded_gluon_launch("llama3-8b", view, 6, dtype)
    grid, _, kwargs = call
    assert kwargs["N_ROWS"] == 16 and kwargs["BLOCK"] == 16 and grid[0] == 2
    kernel = kernel_asm.compile_for(fn, call, 90)
    assert "HMMA" in dict(kernel_asm.sass_mix(kernel, top=200)[0])
    assert kernel_asm.resources(kernel)["registers"] <= 255


# ---------------------------------------------------------------- CUDA

def _quantized(hq, hkv, d, length, t_q, buffered, dtype, seed):
    from hf_sparsekv.kernels.quantize import quantize_keys, quantize_values

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, length, d, generator=g).to("cuda", dtype)
    k = (torch.randn(1, hkv, t_q + buffered, d, generator=g) * 1.5 + 0.3).to("cuda", dtype)
    v = torch.randn(1, hkv, t_q + buffered, d, generator=g).to("cuda", dtype)
    return q, quantize_keys(k[:, :, :t_q], 128), quantize_values(v[:, :, :t_q]), k[:, :, t_q:], v[:, :, t_q:]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


_GLUON_SHAPES = {"gqa4-q1": (32, 8, 128, 1), "gqa4-q6": (32, 8, 128, 6), "mha-q1": (32, 32, 128, 1),
                 "gqa7-q6": (28, 4, 128, 6), "d64-gqa8-q1": (16, 2, 64, 1), "d64-gqa2-q16": (4, 2, 64, 16)}
# make test-cuda: one case per dtype, query count, head size and grouping (each new shape compiles for 8-23 s on a
# fresh machine); make test-cuda-slow: the rest of the grid
_GLUON_DEFAULT = {("gqa4-q6", "bf16"), ("mha-q1", "fp16"), ("d64-gqa2-q16", "fp16")}


@pytest.mark.cuda
@pytest.mark.parametrize("hq,hkv,d,length,dtype", [
    pytest.param(*shape, dtype, id=f"{name}-{dname}",
                 marks=() if (name, dname) in _GLUON_DEFAULT else (pytest.mark.slow,))
    for name, shape in _GLUON_SHAPES.items() for dname, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16))
])
def test_cuda_gluon_kernel_matches_the_reference(hq, hkv, d, length, dtype):
    """Both views against the float32 reference and against the Triton kernel, on 3 and 37 key groups (odd split
    tails) with a buffer of 40 tokens; the two kernels agree as closely as each agrees with the reference."""
    from hf_sparsekv.kernels import decode_core, quant_gluon
    from hf_sparsekv.kernels.quant_attention import quant_decode_attention, quant_decode_attention_reference
    for t_q in (3 * 128, 37 * 128):
        q, qk, qv, bk, bv = _quantized(hq, hkv, d, length, t_q, 40, dtype, seed=t_q + length)
        assert quant_gluon.usable(q, d, 128)
        for int8 in (False, True):
            ref = quant_decode_attention_reference(q, qk.float32(), qv.float32(), bk, bv, 128, int8, d**-0.5)
            with decode_core.quant_config(kernel="gluon", gluon_min_work=0):
                out = quant_decode_attention(q, qk, qv, bk, bv, 128, int8, d**-0.5)
            with decode_core.quant_config(kernel="triton"):
                triton_out = quant_decode_attention(q, qk, qv, bk, bv, 128, int8, d**-0.5)
            tol = 3e-3 if dtype == torch.float16 else 2e-2
            assert _rel(out, ref) < tol, (t_q, int8)
            assert _rel(out, triton_out) < 2 * tol


@pytest.mark.cuda
@pytest.mark.parametrize("view", ["int4", "int8"])
def test_cuda_gluon_kernel_launch_settings_agree(view):
    """Every (block, stages) setting the launch config accepts gives the same result (float16, Llama-3 shape, 5
    key groups so that a 3-stage ring wraps), the ring's slots reused correctly."""
    from hf_sparsekv.kernels import decode_core
    from hf_sparsekv.kernels.quant_attention import quant_decode_attention

    q, qk, qv, bk, bv = _quantized(32, 8, 128, 1, 5 * 128, 9, torch.float16, seed=5)
    outs = []
    for block, stages in ((32, 2), (64, 2), (32, 3), (64, 3), (32, 4)):
        with decode_core.quant_config(kernel="gluon", gluon_min_work=0, **{f"gluon_{view}": (block, stages)},
                                      gluon_min_split=128):
            outs.append(quant_decode_attention(q, qk, qv, bk, bv, 128, view == "int8", 128**-0.5))
    for out in outs[1:]:
        assert _rel(out, outs[0]) < 1e-3


@pytest.mark.cuda
@pytest.mark.parametrize("view", ["int4", "int8"])
def test_cuda_sixteen_rows_per_program_agree_with_eight(view):
    """Verification (6 queries: 24 rows per KV head) in programs of 16 rows with 16-token blocks against the default
    (programs of 8 rows), and both against the float32 reference."""
    from hf_sparsekv.kernels import decode_core
    from hf_sparsekv.kernels.quant_attention import quant_decode_attention, quant_decode_attention_reference

    q, qk, qv, bk, bv = _quantized(32, 8, 128, 6, 5 * 128, 9, torch.float16, seed=6)
    int8 = view == "int8"
    outs = []
    for cfg in ({f"gluon_{view}_rows16": None}, {f"gluon_{view}_rows16": (16, 3)}, {f"gluon_{view}_rows16": (32, 3)}):
        with decode_core.quant_config(kernel="gluon", gluon_min_work=0, gluon_min_split=128, **cfg):
            outs.append(quant_decode_attention(q, qk, qv, bk, bv, 128, int8, 128**-0.5))
    ref = quant_decode_attention_reference(q.float(), qk.float32(), qv.float32(), bk.float(), bv.float(), 128, int8,
                                           128**-0.5)
    for out in outs:
        assert _rel(out, ref) < 1e-2
    for out in outs[1:]:
        assert _rel(out, outs[0]) < 1e-3


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_int4_self_speculation_on_the_graph_path_runs_the_gluon_kernel_losslessly(dtype, monkeypatch):
    """int4 self-speculation (QuantSpec) with head_dim 64 and G = 128, so the quantized segment takes the Gluon
    kernel (counted), on the captured graph path: token-identical to the same speculation run uncaptured, and, in
    float16, to greedy AR on the INT8 view (logits spread wide, as the tiny test models have them)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_sparsekv import HierarchicalQuantCache
    from hf_sparsekv.kernels import decode_core, quant_gluon

    from .conftest import VOCAB, prompt

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model = model.to("cuda", dtype)
    launches = []
    real = quant_gluon.launch_quant_splits
    monkeypatch.setattr(quant_gluon, "launch_quant_splits", lambda *a, **k: launches.append(1) or real(*a, **k))
    monkeypatch.setitem(decode_core.QUANT_CONFIG, "gluon_min_work", 0)  # (these small launches: Triton's otherwise)
    for seed, length in enumerate((700, 1100)):
        ids = prompt(length, seed).cuda()
        kwargs = dict(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
        spec = lambda: dict(assistant_model=model, draft_cache=HierarchicalQuantCache(group_size=128),  # noqa: E731
                            num_assistant_tokens=5)
        graphed = model.generate(ids, **spec(), **kwargs)
        monkeypatch.setenv("HF_SPARSEKV_GRAPHS", "0")
        eager = model.generate(ids, **spec(), **kwargs)
        monkeypatch.setenv("HF_SPARSEKV_GRAPHS", "auto")
        assert torch.equal(graphed, eager), length
        if dtype == torch.float16:
            reference = model.generate(ids, past_key_values=HierarchicalQuantCache(group_size=128), **kwargs)
            assert torch.equal(graphed, reference), length
    assert launches


def test_a_triton_whose_gluon_does_not_import_falls_back_with_a_warning(monkeypatch, caplog):
    """An import failure (a Triton without Gluon, or with an API the kernel does not know) disables the Gluon
    kernel once, with a warning that says why; launches then take the Triton kernel (``usable`` is False)."""
    import sys

    from hf_sparsekv import kernels
    from hf_sparsekv.kernels import quant_gluon

    monkeypatch.setattr(quant_gluon, "_MODULE", False)
    monkeypatch.setitem(sys.modules, "hf_sparsekv.kernels._quant_gluon", None)  # importing it raises ImportError
    monkeypatch.delattr(kernels, "_quant_gluon", raising=False)
    with caplog.at_level("WARNING", logger="hf_sparsekv.kernels.quant_gluon"):
        assert quant_gluon._module() is None
        assert quant_gluon._module() is None  # decided once
    assert sum("Gluon quantized-attention kernel is unavailable" in r.message for r in caplog.records) == 1
    assert not quant_gluon.usable(torch.zeros(1, 4, 1, 64, dtype=torch.float16), 64, 128)


@pytest.mark.cuda
def test_cuda_a_gluon_compile_failure_falls_back_to_the_triton_kernel(monkeypatch):
    """A kernel this Triton's Gluon cannot compile: the launch that hit it returns the Triton kernel's result (equal
    to the reference), and later launches go straight to the Triton kernel."""
    from triton.compiler.errors import CompilationError

    from hf_sparsekv.kernels import decode_core, quant_gluon
    from hf_sparsekv.kernels.quant_attention import quant_decode_attention, quant_decode_attention_reference

    def broken(*args, **kwargs):
        raise CompilationError("", None, "a Gluon API this kernel does not know")

    monkeypatch.setitem(decode_core.QUANT_CONFIG, "gluon_min_work", 0)  # (this small launch: Triton's otherwise)

    quant_gluon._module()  # imported (the real module), then the compile "fails"
    monkeypatch.setattr(quant_gluon, "_launch", broken)
    monkeypatch.setattr(quant_gluon, "_MODULE", quant_gluon._MODULE)  # restored after the test
    q, qk, qv, bk, bv = _quantized(32, 8, 128, 1, 3 * 128, 10, torch.float16, seed=3)
    ref = quant_decode_attention_reference(q, qk.float32(), qv.float32(), bk, bv, 128, False, 128**-0.5)
    assert _rel(quant_decode_attention(q, qk, qv, bk, bv, 128, False, 128**-0.5), ref) < 3e-3
    assert quant_gluon._module() is None and not quant_gluon.usable(q, 128, 128)
