"""Triton kernels against their PyTorch references, and the "sparsekv" attention wiring.

On CPU the kernels run through Triton's interpreter at small sizes. The interpreter must be chosen before Triton is
first imported (``TRITON_INTERPRET=1``), and ``conftest`` has already imported it by the time this module loads, so
a plain ``pytest tests`` runs this module's CPU tests in one child pytest process with ``TRITON_INTERPRET=1`` (the
test ``test_kernels_in_triton_interpreter``, which shows the child's report on failure; the parent leaves them out of
its own count and prints the child's counts in its summary); running
``TRITON_INTERPRET=1 pytest tests/test_kernels.py`` runs them directly. The ``cuda``-marked tests run the compiled
kernels at real sizes on a GPU (skipped on CPU). Inputs are fresh random tensors with ragged lengths; outputs are
compared to the float32 references by relative error ``||out - ref|| / ||ref||``.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from transformers import DynamicCache  # noqa: E402

from hf_sparsekv import ChunkBudgetCache, HierarchicalQuantCache, SinkWindowCache  # noqa: E402
from hf_sparsekv.caches.prefill_quantize import quantize_into  # noqa: E402
from hf_sparsekv.kernels.quant_reference import QuantizedTensor  # noqa: E402
from hf_sparsekv.kernels import runtime  # noqa: E402
from hf_sparsekv.kernels.chunk_attention import chunk_decode_attention, chunk_decode_attention_reference  # noqa: E402
from hf_sparsekv.kernels.gated_linear import gated_linear, gated_linear_reference  # noqa: E402
from hf_sparsekv.kernels.gated_linear import kernel_takes as gated_takes  # noqa: E402
from hf_sparsekv.kernels.grouped_linear import grouped_linear, kernel_takes  # noqa: E402
from hf_sparsekv.kernels.normed_linear import kernel_takes as normed_takes  # noqa: E402
from hf_sparsekv.kernels.normed_linear import normed_linear, normed_linear_reference  # noqa: E402
from hf_sparsekv.kernels.quant_attention import quant_decode_attention, quant_decode_attention_reference  # noqa: E402
from hf_sparsekv.kernels.quantize import (  # noqa: E402
    quantize_keys,
    quantize_keys_reference,
    quantize_values,
    quantize_values_reference,
)
from hf_sparsekv.kernels.reference import ancestor_bits, ancestor_mask, masked_attention_reference  # noqa: E402
from hf_sparsekv.kernels.verify_attention import verify_attention, verify_attention_reference  # noqa: E402

from .conftest import CHILD_SUMMARY  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF_DTYPES = [torch.float16, torch.bfloat16]
TOL = 1e-2



def _interpreter_active() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(triton.language.zeros, InterpretedFunction)


NEEDS_CHILD = DEVICE == "cpu" and not _interpreter_active()


@pytest.fixture(autouse=True)
def _kernels_on(request):
    # With NEEDS_CHILD, conftest leaves this module's other tests out of the parent run (they run in the child).
    with runtime.use_kernels(True):
        yield


@pytest.mark.extended  # ~500 s of CPU: make test-extended (and CI); on a GPU, make test-cuda runs the kernels directly
@pytest.mark.skipif(not NEEDS_CHILD, reason="the kernels already run here (GPU or interpreter)")
def test_kernels_in_triton_interpreter(request):
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-x", "-p", "no:cacheprovider"],
        cwd=root, env=env, capture_output=True, text=True, timeout=900,
    )
    lines = proc.stdout.strip().splitlines()
    request.config.stash[CHILD_SUMMARY] = lines[-1].strip("= ") if lines else "no output"
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _qkv(hq, hkv, length, d, s, dtype, seed, device=DEVICE):
    g = torch.Generator(device="cpu").manual_seed(seed)
    # query as transformers makes it: [1, L, Hq, D] projected, then transposed (non-contiguous for L > 1)
    q = torch.randn(1, length, hq, d, generator=g).transpose(1, 2)
    k = torch.randn(1, hkv, s, d, generator=g) * 1.5 + 0.3
    v = torch.randn(1, hkv, s, d, generator=g)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


# ---------------------------------------------------------------- grouped linear layers (decode-step GEMV)

GROUPED_CASES = [  # (rows, K, output sizes, bias): one row (the FMA route) and several (tensor cores); K and N not
    (1, 64, (48, 16, 16), False),  # multiples of the blocks; one to three weights
    (1, 80, (24,), True),
    (3, 128, (32, 40), True),
    (5, 48, (20, 36, 8), False),
    (16, 272, (64, 17, 64), True),
    (17, 96, (40, 24), False),  # row tiles of 32
    (32, 160, (72, 16, 8), True),
]


def _grouped_inputs(rows, k, ns, bias, dtype, seed, device=DEVICE):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    ws = [torch.randn(n, k, generator=g) / k**0.5 for n in ns]
    bs = [torch.randn(n, generator=g) for n in ns] if bias else []
    return x.to(device, dtype), [w.to(device, dtype) for w in ws], [b.to(device, dtype) for b in bs]


def _grouped_reference(x, ws, bs):
    """float64 ``x @ w.T + b``."""
    return [x.double() @ w.double().T + (bs[i].double() if bs else 0) for i, w in enumerate(ws)]


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("case", GROUPED_CASES, ids=lambda c: "r{}-k{}-n{}-{}".format(c[0], c[1], "_".join(map(str, c[2])),
                                                                                      "bias" if c[3] else "nobias"))
def test_grouped_linear_matches_reference(case, dtype):
    rows, k, ns, bias = case
    x, ws, bs = _grouped_inputs(rows, k, ns, bias, dtype, seed=rows * k)
    x = x.reshape(1, rows, k)  # as a step calls it: [B, L, K]
    assert kernel_takes(x, ws, bs)
    outs = grouped_linear(x, ws, bs)
    for out, ref, n in zip(outs, _grouped_reference(x, ws, bs), ns):
        assert out.shape == (1, rows, n) and out.dtype == dtype and out.is_contiguous()
        assert _rel(out, ref) < TOL


def test_grouped_linear_leaves_other_calls_to_the_reference():
    """Calls the kernel does not take (float32, more rows than one pass serves, a transposed weight) are computed by
    ``F.linear``: exact against it."""
    x, ws, bs = _grouped_inputs(3, 64, (32, 16), True, torch.float32, seed=1)
    cases = [(x, ws, bs), (torch.randn(33, 64).to(DEVICE, torch.float16), [w.half() for w in ws], []),
             (x.half(), [ws[0].half().T.contiguous().T], [])]
    for xi, wi, bi in cases:
        assert not kernel_takes(xi, wi, bi)
        for out, w, b in zip(grouped_linear(xi, wi, bi), wi, bi or [None] * len(wi)):
            assert torch.equal(out, torch.nn.functional.linear(xi, w, b))


def _gated_reference(x, w_gate, w_up):
    """``silu(x @ w_gate.T) * (x @ w_up.T)`` in float64, the projections rounded to ``x``'s dtype first (as the
    kernel, and separate projections, store them)."""
    gate, up = (x.double() @ w.double().T for w in (w_gate, w_up))
    gate, up = gate.to(x.dtype).double(), up.to(x.dtype).double()
    return torch.nn.functional.silu(gate) * up


GATED_CASES = [(1, 64, 48), (1, 80, 24), (3, 128, 40), (16, 272, 64), (17, 96, 40), (32, 48, 20)]  # (rows, K, N)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("case", GATED_CASES, ids=lambda c: "r{}-k{}-n{}".format(*c))
def test_gated_linear_matches_reference(case, dtype):
    rows, k, n = case
    x, (w_gate, w_up), _ = _grouped_inputs(rows, k, (n, n), False, dtype, seed=rows * k + 7)
    x = x.reshape(1, rows, k) * 2  # (a wider spread of gate values: silu's curved part and its negative side)
    assert gated_takes(x, w_gate, w_up)
    out = gated_linear(x, w_gate, w_up)
    assert out.shape == (1, rows, n) and out.dtype == dtype and out.is_contiguous()
    # Triton 3.6's interpreter converts float32 to bfloat16 by truncation (1 + 2^-8 + 2^-10 -> 1.0, not 1 + 2^-7):
    # three truncations (gate, up, product) bias the result towards zero by up to 3 x 2^-8
    tol = 2e-2 if dtype == torch.bfloat16 and runtime.interpreting() else TOL
    assert _rel(out, _gated_reference(x, w_gate, w_up)) < tol


def test_gated_linear_leaves_other_calls_to_the_reference():
    """Calls the kernel does not take (float32, gate and up of different shapes, more rows than one pass serves) are
    computed by eager PyTorch: exact against it."""
    x, (w_gate, w_up, w_other), _ = _grouped_inputs(3, 64, (32, 32, 16), False, torch.float32, seed=2)
    cases = [(x, w_gate, w_up), (x.half(), w_gate.half(), w_other.half()),
             (torch.randn(33, 64).to(DEVICE, torch.float16), w_gate.half(), w_up.half())]
    for xi, gi, ui in cases:
        assert not gated_takes(xi, gi, ui)
        if gi.shape == ui.shape:
            assert torch.equal(gated_linear(xi, gi, ui), gated_linear_reference(xi, gi, ui))


def _normed_reference(x, delta, norm_weight, eps, weights, biases, gated):
    """float64, rounded to ``x``'s dtype where the model's eager code rounds: the residual sum, the normalised rows,
    their product with the norm weight (then :func:`_grouped_reference` / :func:`_gated_reference`)."""
    dt = x.dtype
    h = x if delta is None else (x.double() + delta.double()).to(dt)
    h64 = h.double()
    normed = (h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
    normed = (norm_weight.double() * normed.double()).to(dt)
    outs = [_gated_reference(normed, *weights)] if gated else _grouped_reference(normed, weights, biases)
    return h, outs


NORMED_CASES = [  # (rows, K, output sizes, bias, residual, gated)
    (1, 64, (48, 16, 16), False, True, False),
    (1, 80, (24,), True, False, False),
    (3, 128, (40, 40), False, True, True),
    (1, 96, (32, 32), False, False, True),
    (17, 96, (40, 24), False, True, False),
    (5, 48, (20, 20), False, True, True),
]


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("case", NORMED_CASES, ids=lambda c: "r{}-k{}-n{}{}{}{}".format(
    c[0], c[1], "_".join(map(str, c[2])), "-bias" * c[3], "-residual" * c[4], "-gated" * c[5]))
def test_normed_linear_matches_reference(case, dtype):
    """The projections of an RMSNorm's output (of a residual sum, or of the rows themselves), and the sum, against
    float64 with the model's roundings."""
    rows, k, ns, bias, residual, gated = case
    x, ws, bs = _grouped_inputs(rows, k, ns, bias, dtype, seed=rows * k + 3)
    g = torch.Generator(device="cpu").manual_seed(k)
    delta = torch.randn(rows, k, generator=g).to(DEVICE, dtype).reshape(1, rows, k) if residual else None
    norm_weight = (1 + 0.3 * torch.randn(k, generator=g)).to(DEVICE, dtype)
    x = x.reshape(1, rows, k) * 3
    assert normed_takes(x, delta, norm_weight, ws, bs, gated)
    outs = normed_linear(x, delta, norm_weight, 1e-5, ws, bs, gated)
    h, refs = _normed_reference(x, delta, norm_weight, 1e-5, ws, bs, gated)
    if residual:
        total, outs = outs[0], outs[1:]
        assert total.shape == x.shape and total.dtype == dtype
        if dtype == torch.float16 or not runtime.interpreting():
            assert torch.equal(total, h)
        else:  # (the interpreter's bfloat16 rounding truncates, see test_gated_linear_matches_reference)
            assert _rel(total, h) < 1e-2
    assert len(outs) == len(refs)
    # (under the interpreter, bfloat16 truncations at the sum, the normalised rows, their product with the weight,
    # and for the gated kernel at gate, up and their product: up to 6 x 2^-8 towards zero)
    tol = (4e-2 if gated else 2e-2) if dtype == torch.bfloat16 and runtime.interpreting() else TOL
    for out, ref in zip(outs, refs):
        assert out.shape == (1, rows, ref.shape[-1]) and out.dtype == dtype
        assert _rel(out, ref) < tol


def test_normed_linear_leaves_other_calls_to_the_reference():
    """Calls the kernels do not take (float32; more rows than one pass serves) are the model's eager computation:
    exact against it."""
    x, ws, _ = _grouped_inputs(2, 64, (32, 32), False, torch.float32, seed=4)
    wide = torch.randn(33, 64, device=DEVICE, dtype=torch.float16)
    for xi, wi in ((x, ws), (wide, [w.half() for w in ws])):
        nw = torch.ones(64, device=DEVICE, dtype=xi.dtype)
        assert not normed_takes(xi, xi, nw, wi, [], True)
        expected = normed_linear_reference(xi, xi, nw, 1e-6, wi, [], True)
        got = normed_linear(xi, xi, nw, 1e-6, wi, [], True)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


# ---------------------------------------------------------------- chunk-budget decode attention

CHUNK_CASES = [  # (Hq, Hkv, L, D, stored tokens)
    (4, 4, 1, 64, 8),
    (4, 1, 3, 128, 37),
    (8, 1, 16, 64, 203),
    (8, 2, 5, 128, 131),
    (4, 4, 16, 64, 1000),
    (8, 8, 1, 128, 517),
]


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("case", CHUNK_CASES, ids=lambda c: "hq{}-hkv{}-L{}-d{}-s{}".format(*c))
def test_chunk_attention_matches_reference(case, dtype):
    hq, hkv, length, d, s = case
    q, k, v = _qkv(hq, hkv, length, d, s, dtype, seed=s)
    scaling = d**-0.5
    ref = chunk_decode_attention_reference(q.float(), k.float(), v.float(), scaling)
    out = chunk_decode_attention(q, k, v, scaling)
    assert out.shape == (1, length, hq, d) and out.dtype == dtype
    assert _rel(out, ref) < TOL


def test_chunk_attention_reads_strided_views_and_float32():
    """Views of preallocated storage (a longer buffer cut to the stored length) and float32 (IEEE dots)."""
    q, k, v = _qkv(8, 2, 4, 64, 300, torch.float32, seed=3)
    ks, vs = k[:, :, :157], v[:, :, :157]
    ref = chunk_decode_attention_reference(q, ks, vs, 0.125)
    assert _rel(chunk_decode_attention(q, ks, vs, 0.125), ref) < 1e-5


@pytest.mark.parametrize("batch", [1, 3])
def test_chunk_attention_reads_a_transposed_query(batch):
    """Queries as the attention layer hands them over, ``[B, L, Hq, D]`` transposed to ``[B, Hq, L, D]`` (no copy):
    the kernel reads them through their strides, bitwise as it reads a contiguous copy."""
    rows = [_qkv(8, 2, 5, 64, 256, torch.bfloat16, seed=20 + b) for b in range(batch)]
    q, k, v = (torch.cat(parts) for parts in zip(*rows))
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous() and torch.equal(strided, q)
    n = torch.tensor([256, 131, 40][:batch], dtype=torch.int32, device=k.device)
    out = chunk_decode_attention(strided, k, v, 0.125, length=n)
    assert torch.equal(out, chunk_decode_attention(q, k, v, 0.125, length=n))
    ref = chunk_decode_attention_reference(q.float(), k.float(), v.float(), 0.125, length=n)
    assert _rel(out, ref) < TOL


@pytest.mark.parametrize("dtype", HALF_DTYPES + [torch.float32], ids=str)
@pytest.mark.parametrize("hq,hkv,length,stored", [(4, 2, 1, 9), (8, 2, 6, 300), (4, 4, 16, 70)])
def test_chunk_attention_reads_its_length_from_the_device(dtype, hq, hkv, length, stored):
    """Preallocated buffers (capacity 512, garbage past the length) and the length in a device tensor, as the
    CUDA-graph path launches it: the same result as the reference on the first ``stored`` tokens."""
    q, k, v = _qkv(hq, hkv, length, 64, 512, dtype, seed=stored)
    k[:, :, stored:] = 1e4  # never read
    n = torch.tensor([stored], dtype=torch.int32, device=k.device)
    ref = chunk_decode_attention_reference(q.float(), k[:, :, :stored].float(), v[:, :, :stored].float(), 0.125)
    out = chunk_decode_attention(q, k, v, 0.125, length=n)
    assert _rel(out, ref) < (1e-5 if dtype == torch.float32 else TOL)
    n.fill_(stored - 1 if stored > length else stored)  # the same launch arguments, another length
    shorter = min(stored, max(int(n), length))
    ref = chunk_decode_attention_reference(q.float(), k[:, :, :shorter].float(), v[:, :, :shorter].float(), 0.125)
    assert _rel(chunk_decode_attention(q, k, v, 0.125, length=n), ref) < (1e-5 if dtype == torch.float32 else TOL)


def test_a_block_of_the_longest_chain_is_causal_among_its_queries():
    """A block of :data:`MAX_QUERIES` queries without a tree (a lagging drafter's catch-up block, the engine's
    ``LAG_BLOCK``) over a preallocated buffer: each query sees the stored tokens before the block and the block up to
    itself, as the reference's causal rule says."""
    from hf_sparsekv.generation.engine import LAG_BLOCK
    from hf_sparsekv.kernels.chunk_attention import MAX_QUERIES

    assert LAG_BLOCK == MAX_QUERIES
    q, k, v = _qkv(2, 1, MAX_QUERIES, 64, 96, torch.float32, seed=63)
    k[:, :, 70:] = 1e4  # never read
    n = torch.tensor([70], dtype=torch.int32, device=k.device)
    ref = chunk_decode_attention_reference(q, k[:, :, :70], v[:, :, :70], 0.125)
    assert _rel(chunk_decode_attention(q, k, v, 0.125, length=n), ref) < 1e-5


@pytest.mark.parametrize("dtype", HALF_DTYPES + [torch.float32], ids=str)
@pytest.mark.parametrize("hq,hkv,length", [(4, 4, 1), (8, 2, 4), (16, 2, 3)])
def test_batched_rows_read_their_own_lengths(dtype, hq, hkv, length):
    """A batch of rows over preallocated ``[B, Hkv, S, D]`` buffers with one device length per row (the batched
    static engine's launch): each row equals the reference on its own first ``lengths[b]`` tokens."""
    lengths = [length, 300, 77, 512]
    rows = [_qkv(hq, hkv, length, 64, 512, dtype, seed=10 + b) for b in range(len(lengths))]
    q, k, v = (torch.cat(parts) for parts in zip(*rows))
    for b, n in enumerate(lengths):
        k[b, :, n:] = 1e4  # never read
    n = torch.tensor(lengths, dtype=torch.int32, device=k.device)
    out = chunk_decode_attention(q, k, v, 0.125, length=n)
    ref = chunk_decode_attention_reference(q.float(), k.float(), v.float(), 0.125, length=n)
    assert out.shape == (len(lengths), length, hq, 64)
    assert _rel(out, ref) < (1e-5 if dtype == torch.float32 else TOL)
    n[1] = 31  # the same launch arguments, other lengths
    ref = chunk_decode_attention_reference(q.float(), k.float(), v.float(), 0.125, length=n)
    assert _rel(chunk_decode_attention(q, k, v, 0.125, length=n), ref) < (1e-5 if dtype == torch.float32 else TOL)


def _two_chains(gamma: int) -> torch.Tensor:
    """The tree of a drafter's chain and a retrieved chain sharing the root: nodes 0 (root), 1..γ, γ+1..2γ."""
    parents = [-1] + list(range(gamma)) + [0] + list(range(gamma + 1, 2 * gamma))
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def _tree_batch(hq, hkv, length, lengths, dtype, seed, bits):
    """A batch of rows of ``lengths`` tokens (the last ``length`` the tree block's queries) through the kernel with
    the tree ``bits``: ``(q, k, v, lengths, tolerance, reference)``, the kernel's output checked against the
    reference."""
    rows = [_qkv(hq, hkv, length, 64, 320, dtype, seed=seed + b) for b in range(len(lengths))]
    q, k, v = (torch.cat(parts) for parts in zip(*rows))
    n = torch.tensor(lengths, dtype=torch.int32, device=k.device)
    tol = 1e-5 if dtype == torch.float32 else TOL
    out = chunk_decode_attention(q, k, v, 0.125, length=n, tree=bits)
    ref = chunk_decode_attention_reference(q.float(), k.float(), v.float(), 0.125, length=n, tree=bits)
    assert _rel(out, ref) < tol
    return q, k, v, n, tol, ref


@pytest.mark.parametrize("dtype", HALF_DTYPES + [torch.float32], ids=str)
@pytest.mark.parametrize("hq,hkv,gamma", [(4, 2, 1), (8, 2, 3), (4, 4, 7)])
def test_tree_blocks_see_only_their_ancestors(dtype, hq, hkv, gamma):
    """A verify block that is a tree (two chains from one root): each query sees every key before the block and,
    within it, its ancestors and itself (bits of ``tree``); rows of a batch at different lengths, and batch 1 without
    device lengths. Against the reference with the same mask; the causal reading of the block must differ."""
    mask = _two_chains(gamma)
    length = mask.shape[0]
    bits = ancestor_bits(mask).to(DEVICE)
    assert torch.equal(ancestor_mask(bits).cpu(), mask)
    q, k, v, n, tol, ref = _tree_batch(hq, hkv, length, [length, 300, 77, 131], dtype, 40, bits)
    chain = chunk_decode_attention_reference(q.float(), k.float(), v.float(), 0.125, length=n)
    assert _rel(chain, ref) > 10 * tol  # the mask matters
    one = chunk_decode_attention(q[1:2], k[1:2, :, :131], v[1:2, :, :131], 0.125, tree=bits)
    assert _rel(one, chunk_decode_attention_reference(q[1:2].float(), k[1:2, :, :131].float(),
                                                      v[1:2, :, :131].float(), 0.125, tree=bits)) < tol


def _random_tree(length: int, seed: int) -> torch.Tensor:
    """The visibility mask ``[L, L]`` of a random tree of ``length`` nodes (node 0 the root, every parent before its
    child)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.eye(length, dtype=torch.bool)
    for i in range(1, length):
        mask[i] |= mask[int(torch.randint(0, i, (1,), generator=g))]
    return mask


@pytest.mark.parametrize("dtype", HALF_DTYPES + [torch.float32], ids=str)
@pytest.mark.parametrize("hq,hkv,length,block_m", [(4, 2, 5, None), (8, 2, 33, None), (8, 2, 33, 32)])
def test_tree_blocks_of_one_tree_per_row(dtype, hq, hkv, length, block_m):
    """Each row of a batch verifies its own tree (ancestor bits ``[B, L]``): every row against the reference with its
    own mask, and a row's result must differ from what the first row's tree gives it. 33 queries of group 4 are 132
    rows per KV head: three programs of 64 rows per split by default, five of 32 with ``block_m=32``."""
    from hf_sparsekv.kernels.decode_core import fp_config

    lengths = [300, length, 77, 131]  # row 1 holds only its block
    bits = torch.stack([ancestor_bits(_random_tree(length, seed=b)) for b in range(len(lengths))]).to(DEVICE)
    assert not torch.equal(bits[0], bits[1])
    with fp_config(**({} if block_m is None else dict(block_m=block_m))):
        q, k, v, n, tol, ref = _tree_batch(hq, hkv, length, lengths, dtype, 60, bits)
    shared = chunk_decode_attention_reference(q.float(), k.float(), v.float(), 0.125, length=n, tree=bits[0])
    assert _rel(shared[1], ref[1]) > 10 * tol  # the rows' own trees are read
    with pytest.raises(ValueError, match="one ancestor mask per query"):
        chunk_decode_attention(q, k, v, 0.125, length=n, tree=bits[:2])


def _ring_rows(ends, length, sink, ring, overshoot):
    """Slot positions of sink+window rings (capacity sink + ring) whose rows wrote positions 0..ends[b] +
    overshoot[b] (later positions overwrite earlier ones; the overshoot is what a rollback leaves behind), and the
    queries' positions ``ends[b] - length + 1 .. ends[b]``."""
    slots = torch.full((len(ends), sink + ring), -1, dtype=torch.long)
    for b, (end, extra) in enumerate(zip(ends, overshoot)):
        last = end + extra  # the sinks, then the ring's last `ring` positions (each in a slot of its own)
        kept = torch.cat([torch.arange(min(sink, last + 1)), torch.arange(max(sink, last - ring + 1), last + 1)])
        slots[b, torch.where(kept < sink, kept, sink + (kept - sink) % ring)] = kept
    queries = torch.stack([torch.arange(end - length + 1, end + 1) for end in ends])
    return slots.to(DEVICE), queries.to(DEVICE)


@pytest.mark.parametrize("dtype", HALF_DTYPES + [torch.float32], ids=str)
@pytest.mark.parametrize("hq,hkv,length,sink,window", [(4, 2, 1, 4, 40), (8, 2, 4, 4, 100), (4, 4, 3, 0, 60)])
def test_window_attention_reads_slots_by_position(dtype, hq, hkv, length, sink, window):
    """Sink+window rings as the static cache leaves them (wrapped, partly empty, stale positions past a rollback),
    batch of 4 with one finished row whose length is cut to the query count: equal to the reference, and the
    reference agrees with the cache's own mask rule (attention over exactly the visible slots, in float32)."""
    from hf_sparsekv.kernels.window_attention import window_decode_attention, window_decode_attention_reference

    ring = window + 8  # room for the overshoot and the step's own queries, as max_rollback leaves in the cache
    capacity = sink + ring
    ends = [length + 2, 3 * capacity + 5, capacity + 1, 2 * capacity]
    slots, queries = _ring_rows(ends, length, sink, ring, overshoot=[0, 3, 0, 1])
    rows = [_qkv(hq, hkv, length, 64, capacity, dtype, seed=30 + b) for b in range(len(ends))]
    q, k, v = (torch.cat(parts) for parts in zip(*rows))
    n = torch.tensor([capacity, capacity, capacity, length], dtype=torch.int32, device=DEVICE)
    out = window_decode_attention(q, k, v, 0.125, n, slots, queries, sink, window)
    ref = window_decode_attention_reference(q.float(), k.float(), v.float(), 0.125, n, slots, queries, sink, window)
    assert out.shape == (4, length, hq, 64)
    assert _rel(out[:3], ref[:3]) < (1e-5 if dtype == torch.float32 else TOL)
    assert torch.isfinite(out[3]).all()  # the finished row: whatever it reads, never NaN
    for b in range(3):  # the reference against the visible slots gathered by hand, query by query
        for i in range(length):
            p = int(queries[b, i])
            seen = [j for j in range(capacity) if 0 <= slots[b, j] <= p and (slots[b, j] < sink or slots[b, j] >= p - window)]
            assert len(seen) == min(p + 1, sink + window + 1) if p >= sink else len(seen) == p + 1
            idx = torch.tensor(seen, device=DEVICE)
            want = masked_attention_reference(q[b : b + 1, :, i : i + 1].float(), k[b : b + 1, :, idx].float(),
                                              v[b : b + 1, :, idx].float(), 0.125, spec_mask=torch.ones(1, 1))
            assert _rel(ref[b, i], want[0, 0]) < 1e-5


@pytest.mark.parametrize("dtype", HALF_DTYPES + [torch.float32], ids=str)
@pytest.mark.parametrize("hq,hkv,length,window,chunk", [(4, 2, 1, None, 16), (8, 2, 5, None, 24), (4, 4, 3, 20, 32)])
def test_chunked_attention_on_a_cache_in_position_order(dtype, hq, hkv, length, window, chunk):
    """Chunked attention (Llama 4), with or without a sliding window, on a cache whose slots are its positions (the
    full cache read by its slots' positions, sink 0), a batch of 4 whose queries straddle chunk boundaries, one row
    finished: equal to the reference, and the reference to attention over the visible slots gathered by hand
    (keys of the query's own chunk, within the window)."""
    from hf_sparsekv.kernels.window_attention import window_decode_attention, window_decode_attention_reference

    capacity = 96
    ends = [chunk + 1, 2 * chunk, 70, length - 1]  # queries at ends[b] - length + 1 .. ends[b]
    slots = torch.arange(capacity).repeat(4, 1)
    for b, end in enumerate(ends):
        slots[b, end + 1 + 2 :] = -1  # two stale slots past the sequence, then empty ones
    queries = torch.stack([torch.arange(end - length + 1, end + 1) for end in ends])
    slots, queries = slots.to(DEVICE), queries.to(DEVICE)
    rows = [_qkv(hq, hkv, length, 64, capacity, dtype, seed=50 + b) for b in range(4)]
    q, k, v = (torch.cat(parts) for parts in zip(*rows))
    n = torch.tensor([e + 1 for e in ends[:3]] + [length], dtype=torch.int32, device=DEVICE)
    kernel_window = (1 << 40) if window is None else window - 1
    out = window_decode_attention(q, k, v, 0.125, n, slots, queries, 0, kernel_window, chunk=chunk)
    ref = window_decode_attention_reference(q.float(), k.float(), v.float(), 0.125, n, slots, queries, 0,
                                            kernel_window, chunk=chunk)
    assert _rel(out[:3], ref[:3]) < (1e-5 if dtype == torch.float32 else TOL)
    assert torch.isfinite(out[3]).all()
    for b in range(3):
        for i in range(length):
            p = int(queries[b, i])
            seen = [j for j in range(p + 1) if j // chunk == p // chunk and (window is None or j > p - window)]
            idx = torch.tensor(seen, device=DEVICE)
            want = masked_attention_reference(q[b : b + 1, :, i : i + 1].float(), k[b : b + 1, :, idx].float(),
                                              v[b : b + 1, :, idx].float(), 0.125, spec_mask=torch.ones(1, 1))
            assert _rel(ref[b, i], want[0, 0]) < 1e-5


@pytest.mark.parametrize("dtype", HALF_DTYPES + [torch.float32], ids=str)
@pytest.mark.parametrize("hq,hkv,length", [(4, 2, 6), (8, 2, 28)])
def test_window_attention_with_a_tree_block_after_the_ring(dtype, hq, hkv, length):
    """A drafter's tree on a sink+window ring: the L queries' own keys in L slots after the ring (a forest whose
    depth-1 nodes hang from the root, a ring position), each query seeing the ring by its position and the block by
    its ancestor bits alone (not by the positions its block slots hold). Batch of 3 with one tree per row, against
    the reference, and the reference against the visible slots gathered by hand."""
    from hf_sparsekv.kernels.window_attention import window_decode_attention, window_decode_attention_reference

    sink, window = 4, 50
    ring = window + 8
    capacity = sink + ring + length
    ends = [3 * ring + 5, ring + 1, 2 * ring]  # the root's position in each row
    g = torch.Generator().manual_seed(7)
    bits, depths = torch.zeros(len(ends), length, dtype=torch.long), torch.zeros(len(ends), length, dtype=torch.long)
    for b in range(len(ends)):
        for i in range(length):
            parent = int(torch.randint(-1, i, (1,), generator=g))  # -1: the root (outside the block)
            bits[b, i] = (1 << i) | (0 if parent < 0 else int(bits[b, parent]))
            depths[b, i] = 1 + (0 if parent < 0 else int(depths[b, parent]))
    ring_slots, _ = _ring_rows(ends, 1, sink, ring, overshoot=[0, 0, 0])
    queries = (torch.tensor(ends)[:, None] + depths).to(DEVICE)
    slots = torch.cat([ring_slots, queries], 1)  # the block's slots hold its nodes' positions
    bits = bits.to(DEVICE)
    rows = [_qkv(hq, hkv, length, 64, capacity, dtype, seed=80 + b) for b in range(len(ends))]
    q, k, v = (torch.cat(parts) for parts in zip(*rows))
    n = torch.full((len(ends),), capacity, dtype=torch.int32, device=DEVICE)
    out = window_decode_attention(q, k, v, 0.125, n, slots, queries, sink, window, tree=bits)
    ref = window_decode_attention_reference(q.float(), k.float(), v.float(), 0.125, n, slots, queries, sink, window,
                                            tree=bits)
    assert _rel(out, ref) < (1e-5 if dtype == torch.float32 else TOL)
    by_position = window_decode_attention_reference(q.float(), k.float(), v.float(), 0.125, n, slots, queries, sink,
                                                    window)
    assert _rel(by_position, ref) > 10 * TOL  # the block is read by the bits
    for b in range(len(ends)):
        for i in range(length):
            p = int(queries[b, i])
            seen = [j for j in range(sink + ring) if 0 <= slots[b, j] <= p and (slots[b, j] < sink or slots[b, j] >= p - window)]
            seen += [sink + ring + j for j in range(length) if (int(bits[b, i]) >> j) & 1]
            idx = torch.tensor(seen, device=DEVICE)
            want = masked_attention_reference(q[b : b + 1, :, i : i + 1].float(), k[b : b + 1, :, idx].float(),
                                              v[b : b + 1, :, idx].float(), 0.125, spec_mask=torch.ones(1, 1))
            assert _rel(ref[b, i], want[0, 0]) < 1e-5


def test_static_decode_operator_matches_the_kernel_and_its_fake():
    """``hf_sparsekv::static_decode`` (the kernel as torch.compile sees it): same result as the reference, and its
    registration (schema, shape function, no aliasing) passes ``torch.library.opcheck``."""
    from hf_sparsekv.static_attention import static_decode

    q, k, v = _qkv(8, 2, 4, 64, 256, torch.float32, seed=11)
    n = torch.tensor([150], dtype=torch.int32, device=k.device)
    ref = chunk_decode_attention_reference(q, k[:, :, :150], v[:, :, :150], 0.125)
    assert _rel(static_decode(q, k, v, n, 0.125), ref) < 1e-5
    torch.library.opcheck(static_decode, (q, k, v, n, 0.125), test_utils=("test_schema", "test_faketensor"))
    q2, k2, v2 = (torch.cat([x, x.flip(2)]) for x in (q, k, v))  # two rows
    n2 = torch.tensor([150, 90], dtype=torch.int32, device=k.device)
    torch.library.opcheck(static_decode, (q2, k2, v2, n2, 0.125), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", HALF_DTYPES + [torch.float32], ids=str)
@pytest.mark.parametrize("quantized,buffered,length", [(64, 37, 1), (0, 20, 4), (128, 80, 3)])
def test_static_quant_decode_reads_its_lengths_from_the_device(dtype, quantized, buffered, length):
    """``hf_sparsekv::static_quant_decode`` over preallocated code and buffer storage (garbage past both lengths) in
    both views: the reference on the first ``quantized`` codes and ``buffered`` buffer tokens."""
    from hf_sparsekv.caches.static import StaticQuantCache
    from hf_sparsekv.static_attention import static_quant_decode

    g = 32
    q, k, v = _qkv(8, 2, length, 64, 128 + 96, dtype, seed=quantized + buffered)
    store = StaticQuantCache(g, 128, 32, 1, 2, 64, dtype, k.device)
    layer = store.layers[0]
    quantize_into(layer.qkeys, layer.qvalues, 0, k[:, :, :128], v[:, :, :128], 0, store.group_size)
    layer.keys.copy_(k[:, :, 128:])
    layer.values.copy_(v[:, :, 128:])
    tq = torch.tensor([quantized], dtype=torch.int32, device=k.device)
    tf = torch.tensor([buffered], dtype=torch.int32, device=k.device)
    qk, qv = layer.qkeys, layer.qvalues
    part = lambda x, n, rows: QuantizedTensor(x.upper[:, :, :n], x.lower[:, :, :n], x.scale[:, :, :rows], x.zero[:, :, :rows])  # noqa: E731
    for int8 in (True, False):
        out = static_quant_decode(q, layer.keys, layer.values, qk.upper, qk.lower, qk.scale, qk.zero, qv.upper, qv.lower,
                                  qv.scale, qv.zero, tf, tq, g, int8, 0.125)
        ref = quant_decode_attention_reference(
            q.float(), part(qk, quantized, quantized // g), part(qv, quantized, quantized),
            layer.keys[:, :, :buffered].float(), layer.values[:, :, :buffered].float(), g, int8, 0.125)
        assert _rel(out, ref) < (1e-4 if dtype == torch.float32 else TOL), int8
    torch.library.opcheck(static_quant_decode, (q, layer.keys, layer.values, qk.upper, qk.lower, qk.scale, qk.zero,
                                                qv.upper, qv.lower, qv.scale, qv.zero, tf, tq, g, True, 0.125),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("kernel", ["triton", pytest.param("gluon", marks=pytest.mark.cuda)])
def test_quantized_splits_share_the_current_length_not_the_capacity(monkeypatch, kernel):
    """With lengths on the device the grid is sized from the capacity (2048 quantized tokens: 16 splits of 128 on
    4 SMs, key groups of 64); at a current length of 1024 every split still gets a share (64 tokens each: a finite
    log-sum-exp), not the first eight of them the whole of it, and the output is the reference's on the first 1024
    codes and 16 buffer tokens. (Gluon: CUDA only.)"""
    from hf_sparsekv.kernels import decode_core, quant_gluon

    if kernel == "gluon" and (DEVICE != "cuda" or not quant_gluon.usable(torch.empty(1, device=DEVICE,
                                                                                       dtype=torch.float16), 64, 64)):
        pytest.skip("the Gluon kernel runs on CUDA (sm80+) only")

    g, cap, cur, buf = 64, 2048, 1024, 16
    q, k, v = _qkv(4, 2, 1, 64, cap + 32, torch.float16, seed=3)
    qk, qv = quantize_keys(k[:, :, :cap], g), quantize_values(v[:, :, :cap])
    split, combine = decode_core._kernels()
    seen = {}

    class Recorded:  # the merge kernel, keeping its partial log-sum-exps
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen["lp"] = args[1]
                return combine[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(decode_core, "_kernels", lambda: (split, Recorded()))
    monkeypatch.setattr(decode_core, "_sm_count", lambda device: 4)  # the interpreter's count, on a GPU too
    lengths = lambda n: torch.tensor([n], dtype=torch.int32, device=q.device)  # noqa: E731
    with decode_core.quant_config(kernel=kernel, gluon_min_work=0):
        out = decode_core.launch_decode(q, 0.125, k[:, :, cap:], v[:, :, cap:], quant=(qk, qv), group_size=g,
                                        q_min_split=128, fp_length=lengths(buf), quant_length=lengths(cur))
    n_qsplits = -(-cap // 128)
    assert seen["lp"].shape[1] > n_qsplits and torch.isfinite(seen["lp"][:, :n_qsplits]).all()
    ref = quant_decode_attention_reference(q.float(), _f32(_first(qk, cur, cur // g)), _f32(_first(qv, cur, cur)),
                                           k[:, :, cap : cap + buf].float(), v[:, :, cap : cap + buf].float(), g,
                                           False, 0.125)
    assert _rel(out, ref) < TOL


def test_the_gluon_kernel_takes_only_launches_of_enough_work(monkeypatch):
    """Below ``gluon_min_work`` (KV heads x code capacity x head_dim) one Triton launch reads both segments; at or
    above it the Gluon kernel takes the quantized one (here a stand-in that records its launch)."""
    from hf_sparsekv.kernels import decode_core, quant_gluon

    g, cap, buf = 32, 256, 16
    q, k, v = _qkv(4, 2, 1, 64, cap + buf, torch.float16, seed=4)
    qk, qv = quantize_keys(k[:, :, :cap], g), quantize_values(v[:, :, :cap])
    launched = []

    class Launched(Exception):
        pass

    def gluon_launch(*args, **kwargs):
        launched.append(args[5])  # t_q: the code capacity
        raise Launched

    monkeypatch.setattr(quant_gluon, "usable", lambda *args: True)
    monkeypatch.setattr(quant_gluon, "launch_quant_splits", gluon_launch)
    ref = quant_decode_attention_reference(q.float(), _f32(qk), _f32(qv), k[:, :, cap:].float(), v[:, :, cap:].float(),
                                           g, False, 0.125)
    for work, gluon in ((2 * cap * 64 + 1, False), (2 * cap * 64, True)):
        with decode_core.quant_config(kernel="gluon", gluon_min_work=work):
            if gluon:
                with pytest.raises(Launched):
                    decode_core.launch_decode(q, 0.125, k[:, :, cap:], v[:, :, cap:], quant=(qk, qv), group_size=g)
            else:
                out = decode_core.launch_decode(q, 0.125, k[:, :, cap:], v[:, :, cap:], quant=(qk, qv), group_size=g)
                assert _rel(out, ref) < TOL
    assert launched == [cap]


@pytest.mark.parametrize("path,dtype,hq,hkv,length", [
    ("dot", torch.bfloat16, 8, 2, 4), ("dot", torch.float32, 8, 1, 1), ("vec", torch.float16, 4, 4, 1),
    ("vec", torch.float32, 8, 2, 1),
], ids=str)
def test_static_quant_decode_batched_rows(path, dtype, hq, hkv, length):
    """A batch of 4 rows of a StaticQuantCache (the batched int4 engine's launch), each with its own quantized and
    buffered lengths on the device (row 3 as a finished row leaves it: no codes, only the step's own slots): every
    row equals the reference on its own codes and buffer, in both views."""
    from hf_sparsekv.caches.static import StaticQuantCache
    from hf_sparsekv.kernels import decode_core
    from hf_sparsekv.static_attention import static_quant_decode

    g, cap, quantized, buffered = 32, 128, [64, 128, 0, 0], [37, 12, length + 50, length]
    store = StaticQuantCache(g, cap, 32, 1, hkv, 64, dtype, DEVICE, batch=4)
    layer = store.layers[0]
    qs = []
    for b in range(4):
        q, k, v = _qkv(hq, hkv, length, 64, cap + 96, dtype, seed=40 + b)
        quantize_into(layer.qkeys, layer.qvalues, b, k[:, :, :cap], v[:, :, :cap], 0, store.group_size)
        layer.keys[b].copy_(k[0, :, cap:])
        layer.values[b].copy_(v[0, :, cap:])
        qs.append(q)
    q = torch.cat(qs)
    tq = torch.tensor(quantized, dtype=torch.int32, device=DEVICE)
    tf = torch.tensor(buffered, dtype=torch.int32, device=DEVICE)
    qk, qv = layer.qkeys, layer.qvalues
    args = (layer.keys, layer.values, qk.upper, qk.lower, qk.scale, qk.zero, qv.upper, qv.lower, qv.scale, qv.zero,
            tf, tq, g)

    def row(x, b, n, groups):
        return QuantizedTensor(x.upper[b : b + 1, :, :n], x.lower[b : b + 1, :, :n], x.scale[b : b + 1, :, :groups],
                               x.zero[b : b + 1, :, :groups]) if n else None

    settings = dict(kernel="triton", path=path, vec_max_rows=4, min_split=32) if path == "vec" else dict(
        kernel="triton", path=path, dot_min_split=32)
    for int8 in (True, False):
        with decode_core.quant_config(**settings):
            out = static_quant_decode(q, *args, int8, 0.125)
        assert out.shape == (4, length, hq, 64)
        for b in range(4):
            n, m = quantized[b], buffered[b]
            ref = quant_decode_attention_reference(
                q[b : b + 1].float(), _f32(row(qk, b, n, n // g)), _f32(row(qv, b, n, n)),
                layer.keys[b : b + 1, :, :m].float(), layer.values[b : b + 1, :, :m].float(), g, int8, 0.125)
            assert _rel(out[b : b + 1], ref) < (1e-4 if dtype == torch.float32 else TOL), (int8, b)
    torch.library.opcheck(static_quant_decode, (q, *args, True, 0.125), test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------- hierarchical quantized decode attention

QUANT_CASES = [  # (Hq, Hkv, L, D, G, quantized tokens, buffer tokens)
    (4, 4, 1, 64, 32, 32, 33),
    (4, 1, 5, 128, 16, 80, 21),
    (8, 2, 16, 64, 32, 224, 63),
    (8, 1, 1, 128, 64, 1088, 70),
    (4, 4, 3, 64, 16, 0, 9),
    # few query rows per KV head: the register ("vec") path serves these when selected
    (8, 8, 1, 128, 64, 1088, 5),  # 1 row, several splits
    (8, 2, 1, 128, 32, 256, 40),  # 4 rows (GQA)
    (6, 2, 1, 64, 16, 96, 17),  # 3 rows (one masked)
    (4, 2, 1, 32, 32, 64, 2),  # 2 rows, head_dim 32
]
QUANT_PATHS = {  # launch settings the quantized-attention tests run under (decode_core.quant_config); the Triton
    # kernel's paths (on a GPU the Gluon kernel would take these launches: tests/test_quant_gluon.py runs it)
    "dot": dict(kernel="triton", path="dot", dot_min_split=64),  # several quantized splits on these small inputs too
    "vec": dict(kernel="triton", path="vec", qblock=128, min_split=32),
    # 16-token blocks: one repetition of the code tile's layout covers the block, so the 1-row path's value
    # accumulators stay one per block token; with 128 (above) they are folded onto fewer rows (decode_core._fold_rows)
    "vec-prefetch-b16": dict(kernel="triton", path="vec", qblock=16, prefetch=True, min_split=32),
    # on a GPU: the Gluon kernel, several splits (on CPU the Triton kernel's default route)
    "gluon": dict(kernel="gluon", gluon_min_split=128, gluon_min_work=0),
}


@pytest.mark.parametrize("path", list(QUANT_PATHS))
@pytest.mark.parametrize("int8", [False, True], ids=["int4", "int8"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("case", QUANT_CASES, ids=lambda c: "hq{}-hkv{}-L{}-d{}-G{}-T{}-b{}".format(*c))
def test_quant_attention_matches_reference(case, dtype, int8, path):
    from hf_sparsekv.kernels import decode_core

    hq, hkv, length, d, g, t_q, n_buf = case
    if path == "gluon" and DEVICE == "cpu":
        pytest.skip("the Gluon kernel needs a CUDA GPU")
    if path.startswith("vec") and hq // hkv * length > 4:
        pytest.skip("more than 4 query rows per KV head: the dot path serves it whatever the setting")
    q, k, v = _qkv(hq, hkv, length, d, t_q + n_buf, dtype, seed=t_q + n_buf)
    qk = quantize_keys_reference(k[:, :, :t_q], g) if t_q else None
    qv = quantize_values_reference(v[:, :, :t_q]) if t_q else None
    bk, bv = k[:, :, t_q:], v[:, :, t_q:]
    scaling = d**-0.5
    ref = quant_decode_attention_reference(q.float(), _f32(qk), _f32(qv), bk.float(), bv.float(), g, int8, scaling)
    with decode_core.quant_config(**QUANT_PATHS[path]):
        out = quant_decode_attention(q, qk, qv, bk, bv, g, int8, scaling)
    assert out.shape == (1, length, hq, d) and out.dtype == dtype
    assert _rel(out, ref) < TOL


@pytest.mark.parametrize("int8", [False, True], ids=["int4", "int8"])
@pytest.mark.parametrize("path", ["dot", pytest.param("gluon", marks=pytest.mark.cuda)])
def test_quant_attention_reads_a_transposed_query(path, int8):
    """A verification's queries as the attention layer hands them over (``[B, L, Hq, D]`` transposed, no copy): the
    quantized segment's kernel (Triton's tensor-core path; on a GPU the Gluon kernel) and the buffer's read them
    through their strides, bitwise as a contiguous copy."""
    from hf_sparsekv.kernels import decode_core

    if path == "gluon" and DEVICE == "cpu":
        pytest.skip("the Gluon kernel needs a CUDA GPU")
    q, k, v = _qkv(8, 2, 5, 64, 512 + 24, torch.bfloat16, seed=8)
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous() and torch.equal(strided, q)
    qk, qv = quantize_keys_reference(k[:, :, :512], 64), quantize_values_reference(v[:, :, :512])
    with decode_core.quant_config(**QUANT_PATHS[path]):
        out = quant_decode_attention(strided, qk, qv, k[:, :, 512:], v[:, :, 512:], 64, int8, 0.125)
        assert torch.equal(out, quant_decode_attention(q, qk, qv, k[:, :, 512:], v[:, :, 512:], 64, int8, 0.125))
    ref = quant_decode_attention_reference(q.float(), _f32(qk), _f32(qv), k[:, :, 512:].float(),
                                           v[:, :, 512:].float(), 64, int8, 0.125)
    assert _rel(out, ref) < TOL


@pytest.mark.parametrize("int8", [False, True], ids=["int4", "int8"])
@pytest.mark.parametrize("path", ["dot", pytest.param("gluon", marks=pytest.mark.cuda)])
def test_float16_values_of_a_small_range_keep_their_precision(path, int8):
    """float16 values spanning about 0.0025 per token: the value operand ``p·s·CF`` would fall among float16's
    subnormals, so the kernels scale it by 2^8 and divide that out. The output stays within 1.2e-3 of the float32
    reference on the same codes (interpreter: 7e-4 INT4, 9e-4 INT8; unscaled 1.5e-3 and 4.7e-2)."""
    from hf_sparsekv.kernels import decode_core

    if path == "gluon" and DEVICE == "cpu":
        pytest.skip("the Gluon kernel needs a CUDA GPU")
    q, k, v = _qkv(8, 2, 2, 64, 512 + 16, torch.float16, seed=5)
    v = (v * 0.0005).to(torch.float16)
    qk, qv = quantize_keys_reference(k[:, :, :512], 64), quantize_values_reference(v[:, :, :512])
    ref = quant_decode_attention_reference(q.float(), _f32(qk), _f32(qv), k[:, :, 512:].float(),
                                           v[:, :, 512:].float(), 64, int8, 0.125)
    with decode_core.quant_config(**QUANT_PATHS[path]):
        out = quant_decode_attention(q, qk, qv, k[:, :, 512:], v[:, :, 512:], 64, int8, 0.125)
    assert _rel(out, ref) < 1.2e-3


def test_quant_vec_path_large_logit_range():
    """Lazy rescaling of the 1-row register path: logits growing along the context (later blocks exceed the running
    maximum by far more than the 2^8 slack) and the views still match the reference."""
    from hf_sparsekv.kernels import decode_core

    q, k, v = _qkv(4, 4, 1, 64, 300, torch.float16, seed=11)
    k = k * torch.linspace(0.1, 6.0, 300, dtype=torch.float16).view(1, 1, -1, 1)
    qk, qv = quantize_keys_reference(k[:, :, :256], 32), quantize_values_reference(v[:, :, :256])
    assert decode_core._fold_rows(32, 64, 1) == 16 and decode_core._fold_rows(32, 64, 2) == 32  # folded / not
    for int8, warps in ((False, 1), (True, 1), (False, 2), (True, 2)):
        ref = quant_decode_attention_reference(q.float(), _f32(qk), _f32(qv), k[:, :, 256:].float(),
                                               v[:, :, 256:].float(), 32, int8, 0.125)
        with decode_core.quant_config(kernel="triton", path="vec", qblock=32, min_split=64, num_warps=warps):
            out = quant_decode_attention(q, qk, qv, k[:, :, 256:], v[:, :, 256:], 32, int8, 0.125)
        assert _rel(out, ref) < TOL


def test_quant_config_override(tmp_path):
    from hf_sparsekv.kernels import decode_core

    before = dict(decode_core.QUANT_CONFIG)
    assert before["path"] == "vec" and before["vec_max_rows"] == 1  # register path for one row, else tensor cores
    with decode_core.quant_config(path="vec", qblock=64) as cfg:
        assert cfg["path"] == "vec" and cfg["qblock"] == 64
    assert decode_core.QUANT_CONFIG == before
    f = tmp_path / "quant_config.json"
    f.write_text('{"config": {"path": "vec", "num_warps": 8}, "gpu": "x"}')
    assert decode_core.load_quant_config(str(f)) == {"path": "vec", "num_warps": 8}
    assert decode_core.load_quant_config('{"prefetch": true}') == {"prefetch": True}
    with pytest.raises(ValueError, match="unknown"):
        decode_core.load_quant_config('{"qblok": 64}')
    with pytest.raises(ValueError, match="path"):
        decode_core.load_quant_config('{"path": "fast"}')
    with pytest.raises(ValueError, match="kernel"):
        decode_core.load_quant_config('{"kernel": "cuda"}')
    assert decode_core.load_quant_config('{"gluon_int8": [64, 3]}') == {"gluon_int8": (64, 3)}
    with pytest.raises(ValueError, match="gluon_int4"):
        decode_core.load_quant_config('{"gluon_int4": [48, 2]}')
    assert decode_core.load_quant_config('{"gluon_int8_rows16": null, "gluon_int4_rows16": [32, 3]}') == {
        "gluon_int8_rows16": None, "gluon_int4_rows16": (32, 3)}
    with pytest.raises(ValueError, match="gluon_int8_rows16"):
        decode_core.load_quant_config('{"gluon_int8_rows16": [16, 5]}')
    with decode_core.quant_config(gluon_int8_rows16=(32, 4)):  # 16-row programs only past 8 rows per KV head
        assert decode_core.gluon_settings(24, True) == (16, 32, 4)
        assert decode_core.gluon_settings(8, True) == (8, *decode_core.QUANT_CONFIG["gluon_int8"])
        assert decode_core.gluon_settings(24, False) == (8, *decode_core.QUANT_CONFIG["gluon_int4"])
    env = dict(os.environ, HF_SPARSEKV_QUANT_CONFIG='{"path": "vec", "qblock": 64}')
    code = "from hf_sparsekv.kernels import decode_core as d; print(d.QUANT_CONFIG['path'], d.QUANT_CONFIG['qblock'])"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["vec", "64"], proc.stderr[-2000:]


def test_batched_decode_launches_take_their_own_settings():
    """A launch of several batch rows takes the FP_BATCH_CONFIG entry its KV heads (rows x heads) reach; batch 1
    keeps FP_CONFIG whatever its heads; ``fp_config`` settings hold for both and are restored after the block."""
    from hf_sparsekv.kernels import decode_core

    one = decode_core._fp_settings(1, 128)
    assert one == decode_core.FP_CONFIG
    four, sixteen = decode_core._fp_settings(4, 32), decode_core._fp_settings(16, 128)
    assert (four["num_stages"], four["programs_per_sm"]) == (4, 4)
    assert (sixteen["num_stages"], sixteen["programs_per_sm"]) == (2, 2)
    assert decode_core._fp_settings(2, 8) == decode_core.FP_CONFIG  # under every min_heads
    before = [dict(e) for e in decode_core.FP_BATCH_CONFIG]
    with decode_core.fp_config(num_stages=3, block_n=32):
        for rows, heads in ((1, 8), (4, 32), (16, 128)):
            cfg = decode_core._fp_settings(rows, heads)
            assert (cfg["num_stages"], cfg["block_n"]) == (3, 32)
    assert decode_core.FP_BATCH_CONFIG == before and decode_core._fp_settings(4, 32) == four


@pytest.mark.parametrize("tokens,kv_heads,min_tokens,expected", [
    (3968, 2, 1024, 64),  # the bundled verifier at 4K: 62 programs of one block (6 of 1024 tokens without the fill)
    (16256, 8, 1024, 256),  # Llama-3 at 16K: 4 programs per SM of 256 tokens
    (65408, 8, 1024, 1024),  # Llama-3 at 64K: the minimum already gives 4 programs per SM
    (130944, 8, 1024, 1088),  # 128K: longer than the minimum (per_sm caps the count), no fill involved
    (100, 2, 1024, 128),  # less than two blocks: one split covers them
])
def test_split_tokens_fill_the_gpu_before_honouring_the_minimum(monkeypatch, tokens, kv_heads, min_tokens, expected):
    """Splits keep ``min_tokens`` while that leaves at least ``fill_per_sm`` programs per SM; below, they shrink (to
    one block at the least) until the GPU holds that many, and never exceed the ``per_sm`` count."""
    from hf_sparsekv.kernels import decode_core

    monkeypatch.setattr(decode_core, "_sm_count", lambda device: 132)
    split = decode_core._split_tokens(tokens, kv_heads, 64, None, min_tokens, per_sm=16, fill_per_sm=4)
    assert split == expected and split % 64 == 0
    unfilled = decode_core._split_tokens(tokens, kv_heads, 64, None, min_tokens, per_sm=16)
    assert unfilled >= split  # the fill only ever shortens splits


@pytest.mark.parametrize("splits", [1, 7, 300])  # 300: more splits than one chunk of the merge (two loads)
def test_combine_merges_split_results_by_their_log_sum_exp(splits):
    """The merge kernel against a float64 log-sum-exp merge of random partial results ``op [Hkv, S, rows, D]`` /
    ``lp [Hkv, S, rows]`` (base 2), with splits that saw no key (lp = -inf, op = 0) and a row no split saw (output
    0); rows are written to ``[L, Hq, D]`` at query head ``kvh·group + row // L``, query ``row % L``."""
    from hf_sparsekv.kernels import decode_core

    hkv, group, length, d = 2, 2, 3, 32
    rows = group * length
    g = torch.Generator().manual_seed(splits)
    lp = torch.randn(hkv, splits, rows, generator=g) * 4
    op = torch.randn(hkv, splits, rows, d, generator=g)
    lp[:, ::3] = float("-inf")
    op[:, ::3] = 0
    lp[1, :, 4] = float("-inf")  # KV head 1, row 4: nothing visible
    out = torch.empty(length, hkv * group, d)
    w = torch.exp2(lp.double() - lp.double().amax(1, keepdim=True).nan_to_num(neginf=0))
    ref = (w[..., None] * op.double()).sum(1) / w.sum(1).clamp_min(1e-300)[..., None]  # [Hkv, rows, D]
    ref = ref.nan_to_num(0).view(hkv, group, length, d).permute(2, 0, 1, 3).reshape(length, hkv * group, d)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    op_d, lp_d, out_d = dev(op), dev(lp), dev(out)
    _, combine = decode_core._kernels()
    block_s, block_d = decode_core.triton_next_pow2(splits), min(d, decode_core.COMBINE_BLOCK_D)
    combine[(hkv, rows, d // block_d)](
        op_d, lp_d, *op_d.stride()[:3], *lp_d.stride()[:2], out_d, out_d.stride(0), out_d.stride(1), splits, length,
        GROUP=group, HEAD_DIM=d, BLOCK_S=block_s, BLOCK_D=block_d,
        CHUNK_S=min(block_s, decode_core.COMBINE_TILE // block_d), num_warps=4)
    assert out_d.cpu()[1, 2 + 1].abs().max() == 0  # KV head 1, row 4 = query head 3, query 1
    assert torch.allclose(out_d.cpu().double(), ref, atol=1e-5, rtol=1e-5)


def _launched(monkeypatch) -> list[str]:
    """The names of the Triton kernels launched through :func:`runtime.launch` from here on (``_launched.last``: the
    last merging split kernel's splits and its merge's splits a tile)."""
    names = []
    launch = runtime.launch

    def recording(kernel, grid, *args, **kwargs):
        names.append(kernel.fn.__name__)
        if kwargs.get("MERGE"):
            _launched.last = (grid[1], kwargs["MERGE_S"])
        return launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(runtime, "launch", recording)
    return names


def _merge_case(case: str, dtype):
    """``(run, reference)``: ``run(tickets)`` launches the kernel on one of the shapes the merge in the split kernel
    covers, with ``tickets`` (None: the merge kernel's launch); ``reference`` is the float32 result."""
    from hf_sparsekv.kernels.window_attention import window_decode_attention, window_decode_attention_reference

    if case == "batch":  # three rows folded into KV heads, each its own length
        rows = [_qkv(4, 2, 1, 64, 512, dtype, seed=30 + b) for b in range(3)]
        q, k, v = (torch.cat(parts) for parts in zip(*rows))
        n = torch.tensor([300, 77, 512], dtype=torch.int32, device=k.device)
        return (lambda t: chunk_decode_attention(q, k, v, 0.125, length=n, tickets=t),
                chunk_decode_attention_reference(q.float(), k.float(), v.float(), 0.125, length=n))
    if case == "window":  # a ring read by the positions its slots hold
        q, k, v = _qkv(8, 2, 3, 64, 512, dtype, seed=41)
        slots = torch.randperm(512, generator=torch.Generator().manual_seed(4))[None].to(k.device)
        qpos = torch.tensor([[509, 510, 511]], device=k.device)
        n = torch.tensor([512], dtype=torch.int32, device=k.device)
        args = (0.125, n, slots, qpos, 4, 300)
        return (lambda t: window_decode_attention(q, k, v, *args, tickets=t),
                window_decode_attention_reference(q.float(), k.float(), v.float(), *args))
    if case == "quant":  # codes and buffer splits of one launch (the Triton kernel's quantized paths)
        from hf_sparsekv.caches.static import StaticQuantCache
        from hf_sparsekv.static_attention import static_quant_decode

        q, k, v = _qkv(8, 2, 3, 64, 512 + 96, dtype, seed=43)
        store = StaticQuantCache(32, 512, 32, 1, 2, 64, dtype, k.device)
        layer = store.layers[0]
        quantize_into(layer.qkeys, layer.qvalues, 0, k[:, :, :512], v[:, :, :512], 0, store.group_size)
        layer.keys.copy_(k[:, :, 512:])
        layer.values.copy_(v[:, :, 512:])
        qk, qv = layer.qkeys, layer.qvalues
        tq = torch.tensor([448], dtype=torch.int32, device=k.device)
        tf = torch.tensor([40], dtype=torch.int32, device=k.device)
        part = lambda x, rows: QuantizedTensor(x.upper[:, :, :448], x.lower[:, :, :448], x.scale[:, :, :rows],  # noqa: E731
                                               x.zero[:, :, :rows])
        ref = quant_decode_attention_reference(q.float(), part(qk, 448 // 32), part(qv, 448),
                                               layer.keys[:, :, :40].float(), layer.values[:, :, :40].float(), 32,
                                               True, 0.125)
        return (lambda t: static_quant_decode(q, layer.keys, layer.values, qk.upper, qk.lower, qk.scale, qk.zero,
                                              qv.upper, qv.lower, qv.scale, qv.zero, tf, tq, 32, True, 0.125, t),
                ref)
    hq, hkv, length = {"chain": (8, 2, 4), "tree": (8, 2, 5), "row-blocks": (16, 1, 9)}[case]
    q, k, v = _qkv(hq, hkv, length, 64, 512, dtype, seed=len(case))
    n = torch.tensor([400], dtype=torch.int32, device=k.device)
    bits = ancestor_bits(_two_chains(2)).to(k.device) if case == "tree" else None
    return (lambda t: chunk_decode_attention(q, k, v, 0.125, length=n, tree=bits, tickets=t),
            chunk_decode_attention_reference(q.float(), k.float(), v.float(), 0.125, length=n, tree=bits))


@pytest.mark.parametrize("tiles", ["one-tile", "tiles"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", ["chain", "batch", "tree", "row-blocks", "window", "quant"])
def test_the_last_split_merges_the_splits_with_tickets(monkeypatch, case, dtype, tiles):
    """With the merge's counters given, one launch: the split kernel's last program of each row block merges every
    split (no ``combine_kernel``), in one tile or one tile after another, with the reference's result and the
    two-launch result, the counters back at zero for the next launch (a captured step's replay), which gives the same
    output."""
    from hf_sparsekv.kernels import decode_core

    run, ref = _merge_case(case, dtype)
    if tiles == "tiles":  # a split a tile
        monkeypatch.setattr(decode_core, "_merge_splits", lambda *args: 1)
    # several splits; 144 rows in three blocks
    with decode_core.fp_config(min_split=64, merge_per_warp=1 << 14, merge_tiles=1 if tiles == "one-tile" else 64):
        plain = run(None)
        kernels = _launched(monkeypatch)
        tickets = torch.zeros(64, dtype=torch.int32, device=DEVICE)
        merged = run(tickets)
        assert "combine_kernel" not in kernels and "decode_split_kernel" in kernels
        splits, tile_splits = _launched.last  # the split kernel's splits and one tile's
        assert (splits > tile_splits) == (tiles == "tiles")
        assert int(tickets.count_nonzero()) == 0
        assert torch.equal(run(tickets), merged)
    tol = 1e-4 if case == "quant" and dtype == torch.float32 else (1e-5 if dtype == torch.float32 else TOL)
    assert _rel(merged, ref) < tol
    # a split a tile adds in another order than the merge kernel: bfloat16 outputs may round one unit apart
    assert _rel(merged, plain) < (1e-3 if tiles == "tiles" and dtype == torch.bfloat16 else 1e-6)


def test_a_merge_larger_than_a_tile_or_without_tickets_takes_its_own_launch(monkeypatch):
    """The merge stays a launch of its own where the partial outputs exceed ``merge_tiles`` tiles (of
    ``merge_per_warp``), where the counters are too few for the launch's row blocks, and without counters."""
    from hf_sparsekv.kernels import decode_core

    q, k, v = _qkv(8, 2, 4, 64, 512, torch.float32, seed=5)
    n = torch.tensor([400], dtype=torch.int32, device=k.device)
    kernels = _launched(monkeypatch)
    with decode_core.fp_config(min_split=64):
        for tickets, per_warp in ((torch.zeros(64, dtype=torch.int32, device=DEVICE), 64),
                                  (torch.zeros(1, dtype=torch.int32, device=DEVICE), 2048), (None, 2048)):
            with decode_core.fp_config(merge_per_warp=per_warp):
                kernels.clear()
                chunk_decode_attention(q, k, v, 0.125, length=n, tickets=tickets)
            assert kernels == ["decode_split_kernel", "combine_kernel"]
            assert tickets is None or int(tickets.count_nonzero()) == 0


def _first(qt, tokens: int, scale_rows: int):
    """The first ``tokens`` codes of a quantized tensor and its first ``scale_rows`` scales and zeros."""
    return type(qt)(qt.upper[:, :, :tokens], qt.lower[:, :, :tokens], qt.scale[:, :, :scale_rows],
                    qt.zero[:, :, :scale_rows])


def _f32(qt):
    if qt is None:
        return None
    return qt.float32()


def test_quant_attention_views_differ_and_int8_is_closer():
    """The INT8 view is closer to full precision than the INT4 view (the kernel reads the lower codes)."""
    q, k, v = _qkv(4, 2, 2, 64, 160, torch.float16, seed=7)
    qk, qv = quantize_keys_reference(k[:, :, :128], 32), quantize_values_reference(v[:, :, :128])
    full = chunk_decode_attention_reference(q.float(), k.float(), v.float(), 0.125)
    err4 = _rel(quant_decode_attention(q, qk, qv, k[:, :, 128:], v[:, :, 128:], 32, False, 0.125), full)
    err8 = _rel(quant_decode_attention(q, qk, qv, k[:, :, 128:], v[:, :, 128:], 32, True, 0.125), full)
    assert err8 < err4 / 3


# ---------------------------------------------------------------- verification (hybrid) attention

VERIFY_CASES = [  # (Hq, Hkv, L, D, cache tokens)
    (4, 4, 2, 64, 45),
    (4, 1, 6, 128, 300),
    (8, 2, 16, 64, 129),
    (8, 8, 9, 128, 16),  # no prefix at all: the block alone
]


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("case", VERIFY_CASES, ids=lambda c: "hq{}-hkv{}-L{}-d{}-s{}".format(*c))
def test_verify_attention_matches_reference(case, dtype, tree):
    hq, hkv, length, d, s = case
    s = max(s, length)
    q, k, v = _qkv(hq, hkv, length, d, s, dtype, seed=s + length)
    mask = None
    if tree:  # a random tree-like mask: every token sees itself and a random subset of earlier block tokens
        g = torch.Generator().manual_seed(length)
        mask = (torch.rand(length, length, generator=g) < 0.5).tril() | torch.eye(length, dtype=torch.bool)
    scaling = d**-0.5
    ref = verify_attention_reference(q.float(), k.float(), v.float(), scaling, mask)
    out = verify_attention(q, k, v, scaling, mask)
    assert out.shape == (1, length, hq, d) and out.dtype == dtype
    assert _rel(out, ref) < TOL


# ---------------------------------------------------------------- quantize / pack

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("g,t,d", [(32, 96, 64), (16, 16, 128), (48, 144, 32)])
def test_quantize_kernels_bit_identical(dtype, g, t, d):
    gen = torch.Generator().manual_seed(t + d)
    x = (torch.randn(1, 3, t, d, generator=gen) * 3 + torch.linspace(-5, 5, d)).to(DEVICE, dtype)
    x[0, 0, :g, 0] = 0.7  # a constant channel group and a constant token (scale 0 -> 1)
    x[0, 1, 5, :] = -1.25
    for got, want in ((quantize_keys(x, g), quantize_keys_reference(x, g)), (quantize_values(x), quantize_values_reference(x))):
        for name in ("upper", "scale", "zero"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        if dtype == torch.float32:  # documented: a lower code may move by one at an exact rounding tie
            diff = (got.lower.int() - want.lower.int()).abs()
            assert (diff > 0).float().mean() < 1e-3
        else:
            assert torch.equal(got.lower, want.lower)


def test_quantize_kernel_reads_a_buffer_slice():
    x = torch.randn(1, 2, 100, 64, dtype=torch.float16, device=DEVICE)
    got, want = quantize_keys(x[:, :, :64], 32), quantize_keys_reference(x[:, :, :64].contiguous(), 32)
    assert torch.equal(got.upper, want.upper) and torch.equal(got.lower, want.lower)


@pytest.mark.parametrize("kernels", ["kernels", "reference"])
def test_quantize_into_writes_a_rows_slots_of_the_store_and_nothing_else(monkeypatch, kernels):
    """``quantize_into`` (a prefill's, a flush's): row 1, positions 32..95 of a store of two rows hold the codes,
    scales and zeros quantizing those keys/values gives, and every other slot keeps what it held; by the kernels
    (writing the store's slots themselves) and by the reference (copied in)."""
    from hf_sparsekv.kernels import quantize as quantize_module

    if kernels == "reference":
        monkeypatch.setattr(quantize_module, "_kernel_ok", lambda x: False)
    g, d = 32, 64
    gen = torch.Generator().manual_seed(3)
    keys, values = (torch.randn(1, 2, 64, d, generator=gen).to(DEVICE, torch.float16) for _ in range(2))
    store = [QuantizedTensor(torch.full((2, 2, 128, d // 2), 7, dtype=torch.uint8, device=DEVICE),
                             torch.full((2, 2, 128, d // 2), 9, dtype=torch.uint8, device=DEVICE),
                             torch.full((2, 2, rows, width), 0.5, dtype=torch.float16, device=DEVICE),
                             torch.full((2, 2, rows, width), -0.5, dtype=torch.float16, device=DEVICE))
             for rows, width in ((128 // g, d), (128, 1))]
    before = [copy.deepcopy(s) for s in store]
    quantize_into(store[0], store[1], 1, keys, values, 32, g)
    for s, old, fresh, first in ((store[0], before[0], quantize_keys_reference(keys, g), 1),
                                 (store[1], before[1], quantize_values_reference(values), 32)):
        for name in ("upper", "lower", "scale", "zero"):
            now, was, want = getattr(s, name), getattr(old, name), getattr(fresh, name)[0]
            begin = 32 if name in ("upper", "lower") else first  # codes by position; keys' scales by group
            end = begin + want.shape[-2]
            assert torch.equal(now[1, :, begin:end], want), name
            now, was = now.clone(), was.clone()
            now[1, :, begin:end] = was[1, :, begin:end] = 0
            assert torch.equal(now, was), name  # nothing else written


def test_quantize_into_refuses_slots_of_another_layout():
    x = torch.randn(1, 2, 32, 64, dtype=torch.float16, device=DEVICE)
    codes = torch.empty(1, 2, 32, 32, dtype=torch.uint8, device=DEVICE)
    scales = torch.empty(1, 2, 1, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="out must hold"):
        quantize_keys(x, 32, out=QuantizedTensor(codes, codes, scales.float(), scales.float()))
    with pytest.raises(ValueError, match="one layout"):
        quantize_keys(x, 32, out=QuantizedTensor(codes, codes.transpose(2, 3).contiguous().transpose(2, 3), scales,
                                                 scales))


# ---------------------------------------------------------------- clear errors

def test_unsupported_inputs_raise():
    q, k, v = _qkv(4, 2, 1, 64, 20, torch.float16, seed=0)
    with pytest.raises(NotImplementedError, match="head_dim"):
        chunk_decode_attention(q[..., :48], k[..., :48], v[..., :48], 0.1)
    with pytest.raises(NotImplementedError, match="dtype"):
        chunk_decode_attention(q.double(), k.double(), v.double(), 0.1)
    with pytest.raises(NotImplementedError, match="query length"):
        chunk_decode_attention(torch.zeros(1, 4, 64, 64, dtype=torch.float16, device=DEVICE), k, v, 0.1)
    with pytest.raises(ValueError, match="multiple"):
        chunk_decode_attention(torch.zeros(1, 3, 1, 64, dtype=torch.float16, device=DEVICE), k, v, 0.1)
    with pytest.raises(NotImplementedError, match="group_size"):
        qk, qv = quantize_keys_reference(k[:, :, :8], 8), quantize_values_reference(v[:, :, :8])
        quant_decode_attention(q, qk, qv, k[:, :, 8:], v[:, :, 8:], 8, False, 0.1)
    with pytest.raises(ValueError, match="group_size"):
        quantize_keys(k[:, :, :20], 16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_kernels_off_on_cpu_unless_forced():
    with runtime.use_kernels(False):
        assert not runtime.enabled("cpu")
    assert runtime.enabled("cpu") == runtime.interpreting()


# ---------------------------------------------------------------- wiring into a model

def _tiny_arch(arch: str, dtype=torch.float32, device=DEVICE, head_dim=32):
    """A tiny model of ``arch`` (llama, qwen2, mistral) with heads the kernel takes (4 query heads, 2 KV heads of
    ``head_dim``; Mistral without its sliding window, which the kernel path leaves to SDPA)."""
    from .conftest import _CLASSES

    config_cls, model_cls = _CLASSES[arch]
    config = config_cls(
        vocab_size=96, hidden_size=4 * head_dim, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        **({"sliding_window": None} if arch == "mistral" else {}),
    )
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model = model.to(device, dtype)
    model.set_attn_implementation("sparsekv")
    return model


class _Counter:
    def __init__(self, monkeypatch, module, name):
        import hf_sparsekv.kernels.chunk_attention  # noqa: F401  (the attribute must exist before patching)
        import hf_sparsekv.kernels.quant_attention  # noqa: F401
        import hf_sparsekv.kernels.verify_attention  # noqa: F401

        self.calls = 0
        original = getattr(module, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize(
    "make_cache,kernel",
    [
        (lambda: ChunkBudgetCache(budget=64), "chunk_attention.chunk_decode_attention"),
        (lambda: SinkWindowCache(sink=4, window=40), "chunk_attention.chunk_decode_attention"),
        (lambda: HierarchicalQuantCache(group_size=32), "quant_attention.quant_decode_attention"),
    ],
    ids=["chunk", "window", "quant"],
)
def test_model_generates_the_same_with_kernels(monkeypatch, make_cache, kernel):
    import hf_sparsekv.kernels as kernels_pkg

    model = _tiny_arch("llama")
    ids = torch.randint(3, 96, (1, 100), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with runtime.use_kernels(False):
        reference = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=make_cache())
    module_name, fn = kernel.split(".")
    import importlib

    counter = _Counter(monkeypatch, importlib.import_module(f"{kernels_pkg.__name__}.{module_name}"), fn)
    cache = make_cache()
    out = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=cache)
    assert torch.equal(out, reference)
    assert counter.calls == 7 * 2  # every decode step of both layers went through the kernel


@torch.no_grad()
def test_quantized_store_is_never_dequantized_with_kernels(monkeypatch):
    from hf_sparsekv.caches import quantized

    model = _tiny_arch("llama")
    ids = torch.randint(3, 96, (1, 100), generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def forbidden(*args, **kwargs):
        raise AssertionError("the store was dequantized on the kernel path")

    cache = HierarchicalQuantCache(group_size=32)
    model(ids, past_key_values=cache)  # prefill: the attention marks the layers
    monkeypatch.setattr(quantized, "dequantize_keys", forbidden)
    for t in range(100, 106):
        model(ids[:, :1], past_key_values=cache, position_ids=torch.tensor([[t]], device=DEVICE))
    keys, _ = cache.layers[0].update(*(torch.zeros(1, 2, 1, 32, device=DEVICE),) * 2)
    assert keys.is_meta  # a placeholder; SDPA or eager attention cannot use it silently


def test_self_speculative_with_kernels_is_lossless():
    model = _tiny_arch("llama")
    ids = torch.randint(3, 96, (1, 70), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    reference = model.generate(ids, max_new_tokens=10, do_sample=False, past_key_values=HierarchicalQuantCache(32))
    out = model.generate(
        ids, max_new_tokens=10, do_sample=False, assistant_model=model,
        draft_cache=HierarchicalQuantCache(group_size=32), num_assistant_tokens=4,
    )
    assert torch.equal(out, reference)


@torch.no_grad()
def test_dense_cache_verify_step_uses_hybrid_attention(monkeypatch):
    import hf_sparsekv.kernels.verify_attention as va

    model = _tiny_arch("llama", dtype=torch.float16)
    ids = torch.randint(3, 96, (1, 80), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    cache = DynamicCache()
    model(ids[:, :74], past_key_values=cache)
    ref_cache = copy.deepcopy(cache)
    counter = _Counter(monkeypatch, va, "verify_attention")
    got = model(ids[:, 74:], past_key_values=cache).logits.float()
    assert counter.calls == 2
    with runtime.use_kernels(False):
        want = model(ids[:, 74:], past_key_values=ref_cache).logits.float()
    assert _rel(got, want) < TOL


@torch.no_grad()
@pytest.mark.parametrize("draft_cache", ["chunk", "window"])
def test_batched_static_steps_use_the_kernel(monkeypatch, draft_cache):
    """A left-padded batch on the static path: every decode/verify step of both rows goes through the Triton kernel
    (no fallback to SDPA over the whole buffer; the window drafter's ring through its by-position launch), and each
    row equals its prompt's greedy generate() alone."""
    import hf_sparsekv.static_attention as sa
    from hf_sparsekv.generation import engine as static_engine

    monkeypatch.setenv("HF_SPARSEKV_GRAPHS", "1")
    model = _tiny_arch("llama")
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 96, (1, n), generator=gen).to(DEVICE) for n in (90, 71)]
    with runtime.use_kernels(False):
        want = [model.generate(p, max_new_tokens=9, do_sample=False) for p in prompts]
    ids = torch.zeros(2, 90, dtype=torch.long, device=DEVICE)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, 90 - p.shape[1]:], mask[row, 90 - p.shape[1]:] = p[0], 1
    kernel = _Counter(monkeypatch, sa, "static_decode")
    ring_kernel = _Counter(monkeypatch, sa, "static_window_decode")
    steps_on_sdpa = []
    sdpa = sa.sdpa_attention_forward

    def fallback(module, query, *args, **kwargs):
        if query.shape[-2] <= 8:
            steps_on_sdpa.append(tuple(query.shape))
        return sdpa(module, query, *args, **kwargs)

    monkeypatch.setattr(sa, "sdpa_attention_forward", fallback)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False, assistant_model=model,
                         kv_budget=32, num_assistant_tokens=3, pad_token_id=0, draft_cache=draft_cache)
    assert static_engine.current_engine(model).spec.batch == 2
    for row, p in enumerate(prompts):
        assert torch.equal(out[row, 90 - p.shape[1]:], want[row][0])
    assert kernel.calls > 0 and steps_on_sdpa == []
    assert (ring_kernel.calls > 0) == (draft_cache == "window")


@torch.no_grad()
@pytest.mark.parametrize("draft_cache", ["chunk", "window"])
def test_static_steps_merge_their_splits_in_the_kernel(monkeypatch, draft_cache):
    """On the static path with several splits a launch, every step (draft, verification, catch-up: small tiles on this
    model) merges in the split kernel on its cache's counters, which stay zero between launches, and the output is
    greedy generate()'s."""
    from hf_sparsekv.generation import engine as static_engine
    from hf_sparsekv.kernels import decode_core

    monkeypatch.setenv("HF_SPARSEKV_GRAPHS", "1")
    model = _tiny_arch("llama")
    prompt = torch.randint(3, 96, (1, 150), generator=torch.Generator().manual_seed(9)).to(DEVICE)
    with runtime.use_kernels(False):
        want = model.generate(prompt, max_new_tokens=9, do_sample=False)
    kernels, merged = _launched(monkeypatch), []
    decide = decode_core._merges_in_kernel
    monkeypatch.setattr(decode_core, "_merges_in_kernel", lambda *a: merged.append(decide(*a)) or merged[-1])
    with decode_core.fp_config(min_split=16):
        out = model.generate(prompt, max_new_tokens=9, do_sample=False, assistant_model=model, kv_budget=64,
                             num_assistant_tokens=3, draft_cache=draft_cache)
    assert torch.equal(out, want)
    assert len(merged) > 10 and all(merged)  # launches of several splits, each merged in the kernel
    assert "combine_kernel" not in kernels
    engine = static_engine.current_engine(model)
    caches = [c for c in vars(engine).values() if hasattr(c, "tickets")]
    assert caches and all(int(c.tickets(prompt.device).count_nonzero()) == 0 for c in caches)


def _rope_case(batch: int, length: int, lengths: list[int], dtype, tree: bool = False, seed: int = 0,
               ring: bool = False):
    """Inputs of :func:`rope_decode_attention` as a static cache's step gives them: queries/keys/values ``[B, *, L,
    D]`` as transposed views of the projections' outputs, cos/sin of the positions ``lengths[b] - length ..``, buffers
    of 200 slots holding earlier keys, the positions' slots each row's last ``length`` (a full cache); with ``ring``
    a sink+window ring of 4 + 40 slots (window 32), its slot positions as the cache's step sets them, and the
    ``ring`` argument last."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, dim, capacity = 4, 2, 32, 44 if ring else 200

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    query = rand(batch, length, hq, dim).transpose(1, 2)
    key_new, value_new = (rand(batch, length, hkv, dim).transpose(1, 2) for _ in range(2))
    positions = (torch.tensor(lengths)[:, None] - length + torch.arange(length)[None]).to(DEVICE)
    slots = torch.where(positions < 4, positions, 4 + (positions - 4) % 40) if ring else positions
    angles = positions[..., None].float() * (1.0 / 10000 ** (torch.arange(0, dim, 2, device=DEVICE) / dim))
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [B, 1, L, D] as the model passes them
    key, value = rand(batch, hkv, capacity, dim), rand(batch, hkv, capacity, dim)
    rows = torch.arange(batch, device=DEVICE)[:, None]
    bits = None
    if tree:  # a tree block: each node sees the root, itself and (odd nodes) the node before
        mask = torch.eye(length, dtype=torch.bool)
        mask[:, 0] = True
        mask[1::2, :-1] |= torch.eye(length, dtype=torch.bool)[1::2, 1:]
        bits = ancestor_bits(mask).to(DEVICE)
    case = (query, key_new, value_new, cos, sin, key, value, rows, slots, dim ** -0.5,
            torch.tensor(lengths, dtype=torch.int32, device=DEVICE), bits)
    if not ring:
        return case
    slot_positions = torch.full((batch, capacity), -1, dtype=torch.long)
    for b, n in enumerate(lengths):  # every position up to the step's last, each at its slot (the latest wins)
        for p in range(n):
            slot_positions[b, p if p < 4 else 4 + (p - 4) % 40] = p
    case[-2].fill_(capacity)  # a ring reads every slot
    return case + ((slot_positions.to(DEVICE), positions, 4, 32),)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["one-query", "chain", "batch", "tree", "batch-finished-row", "ring", "ring-batch",
                                  "chunked"])
def test_the_rotary_embedding_and_cache_write_in_the_decode_kernel(case, dtype):
    """One launch that rotates the queries, writes the step's keys (rotated) and values and attends equals the unfused
    step (the rotary embedding in float32, the indexed write, the float32 reference attention): the buffers as the
    write leaves them and the outputs, with one split or several (merged in the kernel on tickets, which end zero);
    on a cache in position order and on a sink+window ring (whose step positions wrap around it)."""
    from hf_sparsekv.kernels import decode_core
    from hf_sparsekv.kernels.rope_attention import rope_decode_attention, rope_decode_attention_reference

    batch, length, lengths, tree = {
        "one-query": (1, 1, [120], False), "chain": (1, 4, [150], False), "batch": (3, 3, [150, 40, 199], False),
        "tree": (2, 5, [90, 160], True), "batch-finished-row": (2, 3, [150, 100], False),
        "ring": (1, 4, [150], False), "ring-batch": (3, 3, [150, 20, 99], False),
        "chunked": (2, 4, [130, 67], False)}[case]
    tol = 1e-5 if dtype == torch.float32 else TOL
    for settings in ({}, {"min_split": 16, "block_n": 16}):
        *args, bits = _rope_case(batch, length, lengths, dtype, tree)
        ring = {}
        if case.startswith("ring"):
            *args, bits, ring["ring"] = _rope_case(batch, length, lengths, dtype, ring=True)
        if case == "chunked":  # a cache in position order read by its slots' positions, chunks of 64 (queries across)
            positions = torch.arange(200, device=DEVICE).repeat(batch, 1)
            positions[positions >= torch.tensor(lengths, device=DEVICE)[:, None]] = -1
            ring["ring"] = (positions, args[8], 0, 1 << 40, 64)
        ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        live = list(range(batch))
        if case == "batch-finished-row":  # row 1 has finished: it reads only as many slots as it has queries
            args[-1][1] = ref_args[-1][1] = length
            live = [0]
        tickets = torch.zeros(batch * 2 * 16, dtype=torch.int32, device=DEVICE)
        with decode_core.fp_config(**settings):
            out = rope_decode_attention(*args, bits, tickets, **ring)
        want = rope_decode_attention_reference(*ref_args, bits, **ring)
        assert out.shape == want.shape == (batch, length, 4, 32)
        for got, expect in ((args[5], ref_args[5]), (args[6], ref_args[6])):  # the buffers: as the write leaves them
            torch.testing.assert_close(got.float(), expect.float(), rtol=tol, atol=tol)
            written = torch.zeros_like(got, dtype=torch.bool)
            written[args[7], :, args[8]] = True
            assert torch.equal(got[~written], expect[~written])  # nothing else moved
        err = (out[live].float() - want[live].float()).norm() / want[live].float().norm()
        assert err < tol, (case, settings, float(err))
        assert int(tickets.count_nonzero()) == 0


def _counted_rotary_rewrites(monkeypatch) -> list[int]:
    """The number of attention calls :func:`fuse_rotary_writes` rewrites in each step compiled from here on (dynamo
    reset first: the steps are compiled here, not another test's compiled code replayed)."""
    from hf_sparsekv.generation import fused_rotary, graph_steps

    counts = []
    rewrite = fused_rotary.fuse_rotary_writes
    monkeypatch.setattr(graph_steps, "fuse_rotary_writes", lambda gm: counts.append(rewrite(gm)) or counts[-1])
    torch._dynamo.reset()
    return counts


@torch.no_grad()
@pytest.mark.parametrize("draft_cache", ["chunk", "window"])
def test_the_fused_rotary_ops_write_the_caches_in_place(monkeypatch, draft_cache):
    """After Inductor's post-grad passes (reinplacing included) the steps that call ``static_rope_decode`` /
    ``static_rope_window_decode`` hold no tensor shaped like a key/value buffer: the op's declared writes of the
    buffers run in place, not on a copy (a copy would be a buffer-sized kernel a layer on the GPU)."""
    from hf_sparsekv.generation import engine as static_engine
    from hf_sparsekv.generation import graph_steps

    from .test_static import _buffer_copies, _post_grad_recorder

    graphs = []
    monkeypatch.setenv("HF_SPARSEKV_COMPILE", "1")
    monkeypatch.setenv("HF_SPARSEKV_GRAPHS", "1")
    monkeypatch.setattr(graph_steps, "COMPILE_BACKEND", _post_grad_recorder(graphs))
    static_engine.release_engines()
    model = _tiny_arch("llama")
    drafter = _tiny_arch("llama")
    prompt = torch.randint(3, 96, (1, 120), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    # (a window wider than the prompt: a longer prompt's prefill feeds exactly the ring's positions, as many as its
    # slots, whose shared symbolic length would make their keys' rotary embedding look like a buffer's copy here)
    model.generate(prompt, max_new_tokens=6, do_sample=False, assistant_model=drafter,
                   kv_budget=64 if draft_cache == "chunk" else 160, num_assistant_tokens=3, draft_cache=draft_cache)
    engine = static_engine.current_engine(model)
    shapes = {tuple(t.shape) for c in (engine.verifier_cache, engine.drafter_cache) for layer in c.layers
              for t in (layer.keys, layer.values)}
    fused = [n for g in graphs for n in g.nodes if "static_rope" in str(n.target)]
    assert fused, "no step called the fused op"
    for graph in graphs:
        assert _buffer_copies(graph, shapes) == [], "\n".join(_buffer_copies(graph, shapes))
    static_engine.release_engines()
    torch._dynamo.reset()  # later tests compile the steps anew, not replay this backend's graphs


@torch.no_grad()
@pytest.mark.cuda
@pytest.mark.compiled
def test_cuda_inductor_steps_fold_the_rotary_embedding_into_the_attention(monkeypatch, exact_cuda_float32):
    """On the GPU, steps compiled by Inductor and captured call ``static_rope_decode`` in every layer of the AR step
    and of a drafter's chunk-cache step (the mutated cache buffers written in place: a second call gives the same
    tokens), and generate() gives plain greedy's tokens (float32)."""
    model = _tiny_arch("llama")
    drafter = copy.deepcopy(model)
    for p in drafter.parameters():
        p.add_(0.01 * torch.randn_like(p))
    prompt = torch.randint(3, 96, (1, 300), generator=torch.Generator().manual_seed(3)).cuda()
    with runtime.use_kernels(False):
        want = model.generate(prompt, max_new_tokens=16, do_sample=False)
    counts = _counted_rotary_rewrites(monkeypatch)
    for _ in range(2):
        assert torch.equal(model.generate(prompt, max_new_tokens=16, do_sample=False, static_engine=True), want)
        out = model.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=drafter, kv_budget=64,
                             num_assistant_tokens=3, draft_cache="chunk")
        assert torch.equal(out, want)
    assert counts and counts[0] == 2 and max(counts) == 2


@torch.no_grad()
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_compiled_steps_fold_the_rotary_embedding_into_the_attention(monkeypatch, compiled_steps, arch):
    """Compiled steps call ``static_rope_decode`` for each layer of the AR step and of a drafter's step on a chunk
    cache, ``static_rope_window_decode`` on a sink+window ring (the rotary embedding, the cache write and the attention
    in one launch), and generate() still gives plain greedy's tokens: our AR, a separate drafter on either cache, a
    batch of two prompts; with ``HF_SPARSEKV_FUSED_ROTARY=0`` the graphs keep the attention call alone."""
    monkeypatch.setenv("HF_SPARSEKV_GRAPHS", "1")
    model = _tiny_arch(arch)
    drafter = copy.deepcopy(model)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.01 * torch.randn_like(p))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 96, (1, n), generator=gen).to(DEVICE) for n in (150, 120)]
    with runtime.use_kernels(False):
        want = [model.generate(p, max_new_tokens=8, do_sample=False) for p in prompts]
    counts = _counted_rotary_rewrites(monkeypatch)
    out = model.generate(prompts[0], max_new_tokens=8, do_sample=False, static_engine=True)
    assert torch.equal(out, want[0]) and counts == [2]  # the AR step: both layers
    for draft_cache in ("chunk", "window"):
        before = len(counts)
        out = model.generate(prompts[0], max_new_tokens=8, do_sample=False, assistant_model=drafter, kv_budget=64,
                             num_assistant_tokens=3, draft_cache=draft_cache)
        assert torch.equal(out, want[0]) and max(counts[before:]) == 2, draft_cache
    ids = torch.zeros(2, 150, dtype=torch.long, device=DEVICE)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, 150 - p.shape[1]:], mask[row, 150 - p.shape[1]:] = p[0], 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, static_engine=True,
                         pad_token_id=0)
    for row, p in enumerate(prompts):
        assert torch.equal(out[row, 150 - p.shape[1]:], want[row][0])
    monkeypatch.setenv("HF_SPARSEKV_FUSED_ROTARY", "0")
    from hf_sparsekv.generation import engine as static_engine

    static_engine.release_engines()
    before = len(counts)
    assert torch.equal(model.generate(prompts[0], max_new_tokens=8, do_sample=False, static_engine=True), want[0])
    assert len(counts) == before


@pytest.mark.parametrize("draft_cache", ["chunk", "window"])
def test_a_finished_row_stops_reading_its_cache(monkeypatch, draft_cache):
    """Row 0 stops at an EOS while row 1 goes on: after that, the kernel reads only the step's own slots of row 0
    (its length in both caches is the step's query count) and row 1 still equals its prompt's greedy output."""
    from hf_sparsekv.generation import engine as static_engine

    monkeypatch.setenv("HF_SPARSEKV_GRAPHS", "1")
    model = _tiny_arch("llama")
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 96, (1, n), generator=gen).to(DEVICE) for n in (80, 64)]
    with runtime.use_kernels(False):
        free = [model.generate(p, max_new_tokens=12, do_sample=False)[0, p.shape[1]:] for p in prompts]
    eos = next(int(t) for t in free[0][:4] if int(t) not in free[1].tolist())
    with runtime.use_kernels(False):
        want = [model.generate(p, max_new_tokens=12, do_sample=False, eos_token_id=eos) for p in prompts]
    assert want[0].shape[1] < prompts[0].shape[1] + 8 and want[1].shape[1] == prompts[1].shape[1] + 12
    ids = torch.zeros(2, 80, dtype=torch.long, device=DEVICE)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, 80 - p.shape[1]:], mask[row, 80 - p.shape[1]:] = p[0], 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, assistant_model=model,
                         kv_budget=32, num_assistant_tokens=3, pad_token_id=0, eos_token_id=eos,
                         draft_cache=draft_cache)
    for row, p in enumerate(prompts):
        got = out[row, 80 - p.shape[1]:]
        assert torch.equal(got[: want[row].shape[1]], want[row][0]) and not got[want[row].shape[1]:].any()
    engine = static_engine.current_engine(model)
    assert engine.spec.batch == 2 and engine.live.tolist() == [0, 0]
    # the last round drafted 3 tokens one by one and verified 4, the verify step writing both caches (self-drafting):
    # row 0 had finished, so each cache's length is that step's 4 queries; row 1 read its whole sequence
    assert engine.drafter_cache.fp_length[0].item() == 4 and engine.verifier_cache.fp_length[0].item() == 4
    assert engine.drafter_cache.fp_length[1].item() > 32 and engine.verifier_cache.fp_length[1].item() > 64


# ---------------------------------------------------------------- real sizes on the GPU

def _real_size_cases():
    """Every (dtype, shape, query length); each compiles its own Triton specializations, so on a cold machine only a
    diagonal (each shape, each length, once) runs by default and the rest is ``slow``."""
    shapes, lengths = [(32, 32, 128), (32, 8, 128), (16, 2, 64)], [1, 6, 16]
    cases = []
    for dtype in HALF_DTYPES:
        for i, shape in enumerate(shapes):
            for j, length in enumerate(lengths):
                default = dtype == torch.bfloat16 and i == j
                cases.append(pytest.param(dtype, *shape, length, marks=() if default else pytest.mark.slow,
                                          id=f"{str(dtype)[6:]}-{shape[0]}x{shape[1]}x{shape[2]}-q{length}"))
    return cases


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,hq,hkv,d,length", _real_size_cases())
def test_cuda_real_sizes(dtype, hq, hkv, d, length):
    scaling = d**-0.5
    q, k, v = _qkv(hq, hkv, length, d, 2048 + 8 + length, dtype, seed=length)
    assert _rel(chunk_decode_attention(q, k, v, scaling), chunk_decode_attention_reference(q, k, v, scaling)) < TOL
    t_q, g = 16384, 128
    q, k, v = _qkv(hq, hkv, length, d, t_q + 200, dtype, seed=length + 1)
    qk, qv = quantize_keys(k[:, :, :t_q], g), quantize_values(v[:, :, :t_q])
    for int8 in (False, True):
        ref = quant_decode_attention_reference(q, _f32(qk), _f32(qv), k[:, :, t_q:], v[:, :, t_q:], g, int8, scaling)
        assert _rel(quant_decode_attention(q, qk, qv, k[:, :, t_q:], v[:, :, t_q:], g, int8, scaling), ref) < TOL
    if length >= 2:
        q, k, v = _qkv(hq, hkv, length, d, 32768 + 13, dtype, seed=length + 2)
        assert _rel(verify_attention(q, k, v, scaling), verify_attention_reference(q, k, v, scaling)) < TOL


@pytest.mark.cuda
@pytest.mark.parametrize("shape", ["bundled", "llama-3.1-8b", "llama-3.2-1b-batch-4"])
def test_cuda_the_last_split_merges_at_real_size(monkeypatch, shape):
    """At real shapes and lengths on the GPU (tens of splits finishing in any order), the merge in the split kernel
    (merging tiles up to 16K values) gives the two-launch result, launch after launch with the same counters, for a
    decode step and a verification of one draft; a graph of 12 such launches replays to the eager result."""
    from hf_sparsekv.kernels import decode_core

    hq, hkv, d, batch, capacity = {"bundled": (4, 2, 64, 1, 16448), "llama-3.1-8b": (32, 8, 128, 1, 4160),
                                   "llama-3.2-1b-batch-4": (32, 8, 64, 4, 4160)}[shape]
    tickets = torch.zeros(batch * hkv * 16, dtype=torch.int32, device=DEVICE)
    kernels = _launched(monkeypatch)
    with decode_core.fp_config(merge_per_warp=1 << 12):
        for length in (1, 2):
            rows = [_qkv(hq, hkv, length, d, capacity, torch.bfloat16, seed=b + length) for b in range(batch)]
            q, k, v = (torch.cat(parts) for parts in zip(*rows))
            n = torch.randint(capacity // 2, capacity + 1, (batch,), generator=torch.Generator().manual_seed(length))
            n = n.to(torch.int32).to(DEVICE)
            plain = chunk_decode_attention(q, k, v, d**-0.5, length=n)
            kernels.clear()
            merged = [chunk_decode_attention(q, k, v, d**-0.5, length=n, tickets=tickets) for _ in range(20)]
            assert kernels == ["decode_split_kernel"] * 20, (length, sorted(set(kernels)))
            for out in merged:  # the same sums in another order than the merge kernel's: bfloat16 roundings apart
                assert torch.equal(out, merged[0])
            assert _rel(merged[0], plain) < 1e-3
            assert int(tickets.count_nonzero()) == 0
        graph, outs = torch.cuda.CUDAGraph(), []
        with torch.cuda.graph(graph):
            for _ in range(12):
                outs.append(chunk_decode_attention(q, k, v, d**-0.5, length=n, tickets=tickets))
        for _ in range(5):
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(out, merged[0]) for out in outs)
        assert int(tickets.count_nonzero()) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 5, 64])
def test_cuda_batched_rows_at_real_size(batch):
    """The batched engine's launch at Llama-3-8B's attention shape (32 q / 8 KV heads of 128), bf16, a verify block
    of 4 queries: B rows over ``[B, 8, 4096, 128]`` buffers, each with its own device length (some rows finished:
    length 4, the step's own queries), each equal to the float32 reference on its own tokens."""
    g = torch.Generator().manual_seed(batch)
    lengths = torch.randint(4, 4097, (batch,), generator=g)
    lengths[::3] = 4  # finished rows read only the step's own slots
    lengths[-1] = 4096
    q = torch.randn(batch, 4, 32, 128, generator=g).transpose(1, 2).to("cuda", torch.bfloat16)
    k = (torch.randn(batch, 8, 4096, 128, generator=g) * 1.5 + 0.3).to("cuda", torch.bfloat16)
    v = torch.randn(batch, 8, 4096, 128, generator=g).to("cuda", torch.bfloat16)
    n = lengths.to("cuda", torch.int32)
    out = chunk_decode_attention(q, k, v, 128**-0.5, length=n)
    ref = chunk_decode_attention_reference(q.float(), k.float(), v.float(), 128**-0.5, length=n)
    assert out.shape == (batch, 4, 32, 128)
    assert max(_rel(out[b], ref[b]) for b in range(batch)) < TOL


@pytest.mark.cuda
@pytest.mark.parametrize("length", [11, 33])
def test_cuda_tree_block_at_real_size(length):
    """A two-chain tree block of 11 queries (γ = 5), and a random tree of 33 per row, at Llama-3-8B's attention shape,
    bf16, 3 rows of 4-16K tokens."""
    if length == 11:
        bits = ancestor_bits(_two_chains(5)).to("cuda")
    else:
        bits = torch.stack([ancestor_bits(_random_tree(length, seed=b)) for b in range(3)]).to("cuda")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, length, 32, 128, generator=g).transpose(1, 2).to("cuda", torch.bfloat16)
    k = (torch.randn(3, 8, 16384, 128, generator=g) * 1.5 + 0.3).to("cuda", torch.bfloat16)
    v = torch.randn(3, 8, 16384, 128, generator=g).to("cuda", torch.bfloat16)
    n = torch.tensor([4096, 16384, 9001], dtype=torch.int32, device="cuda")
    out = chunk_decode_attention(q, k, v, 128**-0.5, length=n, tree=bits)
    ref = chunk_decode_attention_reference(q.float(), k.float(), v.float(), 128**-0.5, length=n, tree=bits)
    assert max(_rel(out[b], ref[b]) for b in range(3)) < TOL


@pytest.mark.cuda
@pytest.mark.parametrize("length", [1, 6])
def test_cuda_quant_rows_at_real_size(length):
    """The batched int4 engine's launch at Llama-3-8B's attention shape, bf16, G = 128: 8 rows of a StaticQuantCache
    with their own quantized (0-8192) and buffered lengths, one finished row (no codes, only the step's slots), both
    views, against the float32 reference row by row."""
    from hf_sparsekv.caches.static import StaticQuantCache
    from hf_sparsekv.static_attention import static_quant_decode

    batch, g, cap = 8, 128, 8192
    gen = torch.Generator().manual_seed(length)
    quantized = [int(x) * g for x in torch.randint(0, cap // g + 1, (batch,), generator=gen)]
    quantized[3] = 0
    buffered = [int(x) for x in torch.randint(length, 2 * g + length, (batch,), generator=gen)]
    buffered[3] = length  # the finished row
    store = StaticQuantCache(g, cap, length, 1, 8, 128, torch.bfloat16, "cuda", batch=batch)
    layer = store.layers[0]
    keys = (torch.randn(batch, 8, cap, 128, generator=gen) * 1.5 + 0.3).to("cuda", torch.bfloat16)
    values = torch.randn(batch, 8, cap, 128, generator=gen).to("cuda", torch.bfloat16)
    for b in range(batch):
        quantize_into(layer.qkeys, layer.qvalues, b, keys[b : b + 1], values[b : b + 1], 0, store.group_size)
    layer.keys.copy_(torch.randn(layer.keys.shape, generator=gen).to("cuda", torch.bfloat16))
    layer.values.copy_(torch.randn(layer.values.shape, generator=gen).to("cuda", torch.bfloat16))
    q = torch.randn(batch, length, 32, 128, generator=gen).transpose(1, 2).to("cuda", torch.bfloat16)
    tq = torch.tensor(quantized, dtype=torch.int32, device="cuda")
    tf = torch.tensor(buffered, dtype=torch.int32, device="cuda")
    qk, qv = layer.qkeys, layer.qvalues
    for int8 in (False, True):
        out = static_quant_decode(q, layer.keys, layer.values, qk.upper, qk.lower, qk.scale, qk.zero, qv.upper,
                                  qv.lower, qv.scale, qv.zero, tf, tq, g, int8, 128**-0.5)
        for b in range(batch):
            n, m = quantized[b], buffered[b]
            part = lambda x, rows: QuantizedTensor(x.upper[b : b + 1, :, :n], x.lower[b : b + 1, :, :n],  # noqa: E731
                                                   x.scale[b : b + 1, :, :rows].float(), x.zero[b : b + 1, :, :rows].float())
            ref = quant_decode_attention_reference(
                q[b : b + 1].float(), part(qk, n // g) if n else None, part(qv, n) if n else None,
                layer.keys[b : b + 1, :, :m].float(), layer.values[b : b + 1, :, :m].float(), g, int8, 128**-0.5)
            assert _rel(out[b : b + 1], ref) < TOL, (int8, b, n, m)


@pytest.mark.cuda
def test_cuda_window_rows_at_real_size():
    """The window drafter's ring launch at Llama-3-8B's attention shape, bf16, 4 queries: 16 rings of sink 4 +
    window 1024 (+ 8 slots of rollback room), wrapped many times, partly empty or finished, against the reference."""
    from hf_sparsekv.kernels.window_attention import window_decode_attention, window_decode_attention_reference

    sink, window, ring, batch = 4, 1024, 1032, 16
    g = torch.Generator().manual_seed(7)
    ends = [int(e) for e in torch.randint(3, 20000, (batch,), generator=g)]
    ends[0] = 600  # not yet wrapped: empty slots
    slots, queries = _ring_rows(ends, 4, sink, ring, overshoot=[b % 4 for b in range(batch)])
    q = torch.randn(batch, 4, 32, 128, generator=g).transpose(1, 2).to("cuda", torch.bfloat16)
    k = (torch.randn(batch, 8, sink + ring, 128, generator=g) * 1.5 + 0.3).to("cuda", torch.bfloat16)
    v = torch.randn(batch, 8, sink + ring, 128, generator=g).to("cuda", torch.bfloat16)
    n = torch.full((batch,), sink + ring, dtype=torch.int32, device="cuda")
    n[5] = 4  # a finished row
    out = window_decode_attention(q, k, v, 128**-0.5, n, slots, queries, sink, window)
    ref = window_decode_attention_reference(q.float(), k.float(), v.float(), 128**-0.5, n, slots, queries, sink, window)
    assert max(_rel(out[b], ref[b]) for b in range(batch) if b != 5) < TOL and torch.isfinite(out).all()


@pytest.mark.cuda
def test_cuda_chunked_rows_at_real_size():
    """Chunked attention at Llama 4's shape (chunks of 8192, 40 query heads over 8 KV heads of 128, bf16, 4 queries)
    on caches in position order of 5K-20K tokens, queries across a chunk boundary in one row, against the
    reference."""
    from hf_sparsekv.kernels.window_attention import window_decode_attention, window_decode_attention_reference

    batch, capacity, chunk = 4, 20480, 8192
    g = torch.Generator().manual_seed(8)
    ends = [8193, 16000, 20000, 5000]
    slots = torch.arange(capacity).repeat(batch, 1).to("cuda")
    queries = torch.stack([torch.arange(end - 3, end + 1) for end in ends]).to("cuda")
    q = torch.randn(batch, 4, 40, 128, generator=g).transpose(1, 2).to("cuda", torch.bfloat16)
    k = (torch.randn(batch, 8, capacity, 128, generator=g) * 1.5 + 0.3).to("cuda", torch.bfloat16)
    v = torch.randn(batch, 8, capacity, 128, generator=g).to("cuda", torch.bfloat16)
    n = torch.tensor([e + 1 for e in ends], dtype=torch.int32, device="cuda")
    args = (128**-0.5, n, slots, queries, 0, 1 << 40)
    out = window_decode_attention(q, k, v, *args, chunk=chunk)
    ref = window_decode_attention_reference(q.float(), k.float(), v.float(), *args, chunk=chunk)
    assert max(_rel(out[b], ref[b]) for b in range(batch)) < TOL and torch.isfinite(out).all()


@pytest.mark.cuda
@pytest.mark.slow  # 12 Triton configurations compiled from cold: minutes on a fresh machine
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("hq,hkv", [(32, 32), (32, 8), (8, 4)])
@pytest.mark.parametrize("settings", [
    dict(kernel="triton", path="vec", qblock=64, num_warps=4, num_stages=1),
    dict(kernel="triton", path="vec", qblock=128, num_warps=8, num_stages=1, prefetch=True),
    dict(kernel="triton", path="vec", qblock=128, num_warps=2, num_stages=3),
], ids=["vec-b64", "vec-b128-prefetch", "vec-b128-w2"])
def test_cuda_quant_vec_path_real_sizes(dtype, hq, hkv, settings):
    """The register path at real sizes (q = 1: 1, 4 and 2 rows per KV head; with vec_max_rows 1, the 4- and 2-row
    cases take the tensor-core path), both views."""
    from hf_sparsekv.kernels import decode_core

    d, t_q, g = 128, 16384, 128
    q, k, v = _qkv(hq, hkv, 1, d, t_q + 130, dtype, seed=hq + hkv)
    qk, qv = quantize_keys(k[:, :, :t_q], g), quantize_values(v[:, :, :t_q])
    for int8 in (False, True):
        ref = quant_decode_attention_reference(q, _f32(qk), _f32(qv), k[:, :, t_q:], v[:, :, t_q:], g, int8, d**-0.5)
        with decode_core.quant_config(**settings):
            out = quant_decode_attention(q, qk, qv, k[:, :, t_q:], v[:, :, t_q:], g, int8, d**-0.5)
        assert _rel(out, ref) < TOL


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_cuda_quantize_bit_identical_real_size(dtype):
    x = (torch.randn(1, 8, 4096, 128, device="cuda") * 2).to(dtype)
    for got, want in (
        (quantize_keys(x, 128), quantize_keys_reference(x, 128)),
        (quantize_values(x), quantize_values_reference(x)),
    ):
        for name in ("upper", "lower", "scale", "zero"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chunk", "window", "int4"])
def test_cuda_lossless_with_kernels(mode):
    """The losslessness of tests/test_cuda.py with both models on the "sparsekv" attention (kernels on)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    verifier = _tiny_arch("llama", head_dim=64)
    drafter = _tiny_arch("llama", head_dim=32)
    for seed, length in enumerate((5, 140, 400)):
        ids = torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(seed)).cuda()
        kwargs = dict(max_new_tokens=32, do_sample=False)
        if mode == "int4":
            reference = verifier.generate(ids, past_key_values=HierarchicalQuantCache(group_size=32), **kwargs)
        else:
            reference = verifier.generate(ids, **kwargs)
        for gamma in (1, 3, 8):
            if mode == "int4":
                spec = dict(assistant_model=verifier, draft_cache=HierarchicalQuantCache(group_size=32))
            else:
                spec = dict(assistant_model=drafter, draft_cache=mode, kv_budget=64)
            out = verifier.generate(ids, num_assistant_tokens=gamma, **spec, **kwargs)
            assert torch.equal(out, reference)


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 6, 32])
def test_cuda_gated_linear_real_sizes(rows):
    """Llama-3.1-8B's, Qwen2.5-0.5B's and the bundled verifier's gate/up with their activation, bf16, against
    float64."""
    for k, n in [(4096, 14336), (896, 4864), (256, 768)]:
        x, (w_gate, w_up), _ = _grouped_inputs(rows, k, (n, n), False, torch.bfloat16, seed=rows + k)
        assert gated_takes(x, w_gate, w_up)
        assert _rel(gated_linear(x, w_gate, w_up), _gated_reference(x, w_gate, w_up)) < TOL


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 6, 32])
def test_cuda_normed_linear_real_sizes(rows):
    """Llama-3.1-8B's and the bundled verifier's normed q/k/v and gate/up after a residual sum, bf16, against float64
    with the model's roundings; the sum exactly."""
    for k, ns, gated in [(4096, (4096, 1024, 1024), False), (4096, (14336, 14336), True), (256, (256, 128, 128), False),
                         (256, (768, 768), True)]:
        x, ws, _ = _grouped_inputs(rows, k, ns, False, torch.bfloat16, seed=rows + k)
        delta = torch.randn_like(x)
        norm_weight = 1 + 0.3 * torch.randn(k, device=DEVICE, dtype=torch.bfloat16)
        assert normed_takes(x, delta, norm_weight, ws, [], gated)
        total, *outs = normed_linear(x, delta, norm_weight, 1e-5, ws, [], gated)
        h, refs = _normed_reference(x, delta, norm_weight, 1e-5, ws, [], gated)
        assert torch.equal(total, h)
        for out, ref in zip(outs, refs):
            assert _rel(out, ref) < TOL


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 6, 16, 24, 32])
def test_cuda_grouped_linear_real_sizes(rows):
    """Llama-3.1-8B's q/k/v and gate/up projections and a narrow-K case, bf16, against float64."""
    for k, ns in [(4096, (4096, 1024, 1024)), (4096, (14336, 14336)), (896, (896, 128, 128))]:
        x, ws, bs = _grouped_inputs(rows, k, ns, False, torch.bfloat16, seed=rows + k)
        assert kernel_takes(x, ws, bs)
        for out, ref in zip(grouped_linear(x, ws, bs), _grouped_reference(x, ws, bs)):
            assert _rel(out, ref) < TOL


def _compiled_for(kernel, args: tuple, kwargs: dict, unspecialized: tuple) -> tuple:
    """What Triton compiles ``kernel`` for, of a launch's arguments: its constexprs, the dtypes of its tensors, and
    for each integer it specializes whether it is 1 and whether 16 divides it."""
    key = [(k, v) for k, v in sorted(kwargs.items())]
    for name, value in zip(kernel.arg_names, args):
        if isinstance(value, torch.Tensor):
            key.append((name, value.dtype))
        elif isinstance(value, int) and not isinstance(value, bool) and name not in unspecialized:
            key.append((name, value == 1, value % 16 == 0))
    return tuple(key)


def test_engines_of_every_capacity_launch_one_compiled_decode_kernel(monkeypatch):
    """A grown engine (a longer prompt: a larger capacity, so more splits) launches the split kernel, and the merge
    kernel where the splits take a launch of their own, with what Triton compiled for the smaller one: the same
    constexprs, tensor dtypes and classes of the integers it specializes. Capacities up to the in-kernel merge's
    split count share one split kernel; with one tile every larger one shares a second (and one merge kernel).
    Nothing runs: the launches are recorded, with an H100/H200's 132 SMs for the split counts."""
    from hf_sparsekv.kernels import _decode_triton, decode_core

    monkeypatch.setattr(decode_core, "_sm_count", lambda device: 132)
    keys = []

    def recording(kernel, grid, *args, **kwargs):
        names = {"decode_split_kernel": _decode_triton.CAPACITY_ARGS,
                 "combine_kernel": _decode_triton.COMBINE_CAPACITY_ARGS}
        keys[-1].append((kernel.fn.__name__, _compiled_for(kernel, args, kwargs, names[kernel.fn.__name__])))

    monkeypatch.setattr(runtime, "launch", recording)
    capacities = (8192, 8448, 15104, 16384, 32768, 65536, 131072)
    for tiles in (1, 4):  # the in-kernel merge takes one tile of 64 splits, or up to four (the default)
        with decode_core.fp_config(merge_tiles=tiles):
            for capacity in capacities:
                keys.append([])
                q = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16, device=DEVICE)
                k = v = torch.empty(1, 2, capacity, 64, dtype=torch.bfloat16, device=DEVICE)
                n = torch.tensor([capacity - 100], dtype=torch.int32, device=DEVICE)
                chunk_decode_attention(q, k, v, 0.125, length=n,
                                       tickets=torch.zeros(64, dtype=torch.int32, device=DEVICE))
    one_tile, tiles = keys[:len(capacities)], keys[len(capacities):]
    merged, own_launch = one_tile[:4], one_tile[4:]
    assert [len(k) for k in merged] == [1] * 4 and [len(k) for k in own_launch] == [2] * 3
    assert all(k == merged[0] for k in merged) and all(k == own_launch[0] for k in own_launch)
    assert all(k == merged[0] for k in tiles)  # 132 splits at most: every capacity merges in the kernel


@pytest.mark.cuda
def test_cuda_a_grown_capacity_compiles_no_new_decode_kernel(monkeypatch):
    """On the GPU: after a launch at 8,192 positions, launches at 15,104 and 16,384 (a grown engine's caches, more
    splits, merged in the kernel) compile nothing new, and the tokens equal the reference at each."""
    from triton.runtime import jit

    if not hasattr(jit.JITFunction, "_do_compile"):
        pytest.skip("this Triton compiles through another entry point")
    compiled = []
    do_compile = jit.JITFunction._do_compile

    def counting(self, *args, **kwargs):
        compiled.append(self.fn.__name__)
        return do_compile(self, *args, **kwargs)

    monkeypatch.setattr(jit.JITFunction, "_do_compile", counting)
    for i, capacity in enumerate((8192, 15104, 16384)):
        q, k, v = _qkv(4, 2, 1, 64, capacity, torch.bfloat16, seed=40 + i)
        n = torch.tensor([capacity - 700], dtype=torch.int32, device=DEVICE)
        out = chunk_decode_attention(q, k, v, 0.125, length=n, tickets=torch.zeros(64, dtype=torch.int32,
                                                                                  device=DEVICE))
        ref = chunk_decode_attention_reference(q.float(), k.float(), v.float(), 0.125, length=n)
        assert _rel(out, ref) < TOL
        if i == 0:
            compiled.clear()
    assert "decode_split_kernel" not in compiled
