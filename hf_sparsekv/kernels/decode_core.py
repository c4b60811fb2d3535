"""Split-KV (flash-decoding) Triton kernel shared by the chunk-budget and the hierarchical-quantized attention.

One launch computes, for each KV head, the attention of its ``group·L`` query rows (``group`` query heads x ``L``
query tokens, packed as the rows of one tile) over two segments:

* an optional **quantized segment** of ``T_q`` tokens (all visible to every query): packed INT4 upper codes and,
  in the INT8 view, lower codes, read as bytes and dequantized in registers. The dequantization is folded into the
  operands: a key is ``z + s·cu (+ s/14·cl)`` per channel, so ``q·k = (q⊙s)·cu (+ (q⊙s/14)·cl) + q·z`` with the
  group's ``s, z`` loaded once per block of tokens; a value is ``z_n + s_n·cv`` per token, so
  ``Σ p_n v_n = (p⊙s)·cv (+ (p⊙s/14)·cl) + Σ p_n z_n``. Both implementations combine the INT8 view's upper and
  lower codes as integers first (``C = 14·u + l``, 0..225, exact in fp16/bf16; the lower codes' offset of 8 goes
  into the zero-point term), so INT8 takes as many dots/conversions per block as INT4 (except bfloat16 on the
  compiled tensor-core path, which runs upper and lower codes as two dots). ``QUANT_CONFIG["path"]``:
  "dot": codes enter tensor-core dots (query rows padded to 16), turned into float16 (or bfloat16, INT4 view) by a
  mantissa trick in the dot's operand layout; bfloat16 INT8 codes as on the register path below;
  "vec" (for <= 4 query rows per KV head, e.g. decode without or with small GQA): no tensor cores, everything in
  registers (broadcast multiply + sum), codes turned into float32 with one mask|OR + one subtraction (no int->float
  convert); with one row the value sums stay per token with lazy rescaling (one FMA per code).
* a **full-precision segment** of ``S`` tokens whose last ``L`` are the queries' own tokens (causal among them);
  or, with ``positions`` (a ring buffer, slots in any order), the slots each query sees are decided by the logical
  positions the slots hold: ``0 <= s <= q`` and (``s < sink`` or ``s >= q - window``).

On CUDA, in float16/bfloat16 with head_dim 64 or 128, the quantized segment's splits run in a separate kernel instead
(:mod:`.quant_gluon`, written in Gluon: one warp per program, tokens on the MMA's M side), which writes the same
partial outputs; the kernel of this module then runs the full-precision splits alone.

The token ranges are cut into splits (one program per split and KV head, and per block of ``block_m`` query rows
where a KV head has more rows); each writes a partial output and its base-2 log-sum-exp, and a second small kernel
merges the splits (or, given the caller's ``tickets`` and where the partials fit a few tiles, the last program of
each row block to finish merges them in the same launch). Keys before the queries' own ``L`` are seen by every
query, so whole blocks of them run unmasked; only the blocks that reach the queries' own apply the causal or tree
mask (LongSpec's prefix and tree parts, in one pass). With a single split the first kernel writes the final output
directly. Softmax runs in float32 (base 2), dots accumulate in float32.

Invariants the launcher guarantees: every quantized block of ``qblock`` tokens lies in one key group
(``group_size % qblock == 0``, blocks start at multiples of ``qblock``); ``S >= L``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from typing import NamedTuple

import torch

from . import quant_gluon, runtime
from .quant_reference import QuantizedTensor

LOG2E = 1.4426950408889634

# Launch configuration (benchmarks/kernel_sweep.py --sweep measures alternatives for the quantized segment):
# * kernel: "gluon" runs the quantized segment by the Gluon kernel of quant_gluon where it can (CUDA, float16/
#   bfloat16, head_dim 64/128), one warp and 8 query rows per program, ``gluon_int4`` / ``gluon_int8`` = (tokens per
#   block, cp.async ring stages) per view, ``gluon_per_sm`` programs per SM and ``gluon_min_split`` tokens per split
#   at least (fill as below); ``gluon_int4_rows16`` / ``gluon_int8_rows16`` = (tokens per block, stages) of programs
#   of 16 query rows, which run the view's launches with more than 8 rows per KV head (verification: queries x the
#   GQA group), two MMA N tiles sharing each block's code conversion; None: programs of 8 rows. H100, Llama-3-8B
#   shape, fp16, 6 queries (24 rows), 32K / 128K (2026-11-27): INT8 80.8 / 238.7 µs in 8-row programs, 77.8 / 211.3
#   at (16, 3) in 16-row ones (bf16 128K: 326 -> 281 µs); INT4 55.2 / 142.2 against 77.5 / 209.2, so INT4 keeps 8 rows
#   (benchmarks/results/quant-8b-h100-2026-11-27b/); "triton" (and any launch Gluon cannot take) the Triton kernel's
#   paths below. H200 sweep,
#   Llama-3-8B shape, fp16, 64K / 128K (2026-11-27): INT4 47 / 68 µs at (64, 2) against 60 / 92 µs without the ring
#   and 120 / 196 µs on the Triton kernel; INT8 68 / 108 µs at (32, 3) (117 / 203 at (64, 2), spilling); 6 or 12
#   programs per SM lost to 8 (benchmarks/results/quant-gluon-h200-2026-11-27/);
# * path: "dot" = tensor-core tiles (query rows padded to 16); "vec" = registers only, broadcast multiply + sum, used
#   when the query rows per KV head (group x L) are at most ``vec_max_rows`` (<= 4), else "dot";
# * qblock: tokens per block (the largest of these dividing the group size); num_warps; num_stages (pipelining);
# * programs_per_sm: the split count aims at this many programs per SM; min_split (register path) and
#   dot_min_split (tensor-core path): no split has fewer tokens, unless that would leave fewer than ``fill_per_sm``
#   programs per SM (short context, few KV heads): then splits shrink, down to one block, until the GPU holds that
#   many. Longer splits pay on the tensor-core path, whose programs start with more work (query tile, scales):
#   Llama-3 64K INT4 / INT8 0.089 / 0.117 ms at 512 tokens, 0.079 / 0.103 ms at 1024, while the register path was
#   3 % slower at 1024 (H100 sweep of 2026-11-25, benchmarks/results/kernels-quant-h100-2026-11-25/splits/). Without
#   the fill, 1024-token splits left most SMs idle below 64K: the bundled verifier (2 KV heads) at 4K ran 6 programs
#   on 132 SMs (61 µs per call against 10 µs with the fill; Llama-3 at 16K 61 -> 28 µs; 128K unchanged;
#   benchmarks/results/kernels-quant-h100-2026-11-25b/). Two programs per SM, not four: the bundled verifier's step
#   of 12 launches at 16K (benchmarks/quant_splits.py, H100, 2026-12-05) took 169 / 124 / 171 µs (plain INT8, INT4
#   draft, verification of 6) against 195 / 158 / 206 at four (264 splits of one block each, 132 at two; one program
#   per SM lost, 251 µs plain); at 4K the split count is the same (one block each); the Triton route at Llama-3 shape
#   (the Gluon kernel's where it cannot run) was not measured at two;
# * trans_load ("dot"): code tiles loaded transposed ([D/2, N], the dot's right operand);
# * prefetch ("vec"): the next block's codes are loaded before the current one is computed;
# * asm_codes ("dot", compiled kernels): codes become float16/bfloat16 operands by inline PTX, four bytes per call
#   (_decode_triton._codes_asm); bfloat16 INT8 then runs upper and lower codes through separate dots. Off, or under
#   the Triton interpreter (which cannot run inline assembly), the same conversion in Triton ops;
# Value accumulators of the register path for one row per KV head are always folded to the rows one repetition of
# the code tile's layout covers (:func:`_fold_rows`); tensor-core codes are converted in the dot's operand layout.
# The fold and the float16 codes won the H100 sweep of 2026-11-25 (64K tokens, q = 1): Llama-2 INT4 / INT8 0.160 ->
# 0.146 / 0.310 -> 0.274 ms, Llama-3 INT4 0.106 -> 0.096 ms, Llama-3 INT8 unchanged
# (benchmarks/results/kernels-quant-h100-2026-11-25/sweep2/); the PTX then took Llama-3 fp16 INT4 / INT8 to 0.088 /
# 0.117 ms (.../asm/).
# Default: the fastest of that sweep: the register path for one query row per KV head, tensor cores for more, both
# with 64-token blocks, 2 warps and 3 pipeline stages. Fewer warps per program matter most: at 4 warps the kernel
# needed 240-255 registers per thread, leaving 12.5 % occupancy, and was latency-bound (ncu;
# benchmarks/results/HISTORY.md).
# Override without editing code: HF_SPARSEKV_QUANT_CONFIG = a JSON object or the path of a JSON file holding one
# (e.g. the ``quant_config.json`` benchmarks/kernel_sweep.py --sweep writes), read at import; or :func:`quant_config`.
QUANT_CONFIG = dict(
    kernel="gluon", gluon_int4=(64, 2), gluon_int8=(32, 3), gluon_min_split=512, gluon_per_sm=8,
    gluon_int4_rows16=None, gluon_int8_rows16=(16, 3), path="vec", qblock=64, num_warps=2, num_stages=3,
    programs_per_sm=16, min_split=512, dot_min_split=1024, fill_per_sm=2, trans_load=True, prefetch=False,
    vec_max_rows=1, asm_codes=True, gluon_min_work=1 << 22,
)
# ``gluon_min_work``: the Gluon kernel takes the quantized segment only where KV heads x code capacity x head_dim
# reaches this; below it one Triton launch reads both segments (the Gluon kernel needs a launch of its own for the
# buffer). H200: the bundled verifier (2 x 16K x 64 = 2^21; benchmarks/step_kernels.py --mode int4) runs its plain
# step in 0.315 against 0.352 ms, 6 drafts in 1.76 against 2.05 ms, verification of 6 in 0.42 against 0.50 ms; at
# Llama-3-8B shape from 4K (8 x 4K x 128 = 2^22) the Gluon kernel stays (benchmarks/kernel_sweep.py --quant-only at 8K:
# 15.7 against 22.5 µs INT4, 21.4 against 29.3 µs INT8). 0 puts every launch on the Gluon kernel.
QUANT_CONFIG_ENV = "HF_SPARSEKV_QUANT_CONFIG"
# The full-precision segment: ``block_n`` tokens per block (None: 64 for head_dim <= 64, else 32), warps, pipeline
# stages; ``programs_per_sm``: the split count aims at this many programs per SM, with no split shorter than
# ``min_split`` tokens of the capacity. With lengths on the device the split count is fixed at launch (from the
# capacity) and each program takes an equal share of the row's *current* length, computed in the kernel, so the GPU
# stays busy when a captured launch reads a length far below the capacity it was sized for.
# Default: the fastest of benchmarks/decode_kernel.py --sweep (H200, Llama-3-8B shape, bf16, 8K/32K/128K, q 1 and 6;
# 72 settings within 2 % of each other at 8K, up to 1.8x apart at 128K; results/decode-kernel-h200-2026-11-26/).
FP_CONFIG = dict(block_n=64, num_warps=4, num_stages=3, programs_per_sm=2, min_split=256, block_m=64,
                 merge_per_warp=2048, merge_tiles=4)
# ``block_m``: query rows per program. More rows (tree verification: group x (N + 1) rows) run as further programs of
# the same split, side by side in the grid so that they can share the keys through L2. Swept for trees of 17 and 33
# queries at Llama-3-8B shape, 16K/32K (benchmarks/decode_kernel.py --tree-sweep, H100, 2026-11-27): 64 rows with these
# settings was fastest (33 queries at 32K: 85 us; the best 128-row settings 100-107 us, 32-row ones 148 us or more;
# 339 us before, when every block was masked and 128-row tiles ran one after the other).
# Launches of several batch rows (the KV heads of all rows in one grid) take the settings of the first entry of
# FP_BATCH_CONFIG whose ``min_heads`` the launch's KV heads (rows x heads per row) reach, over FP_CONFIG's. H100 sweeps
# at Llama-3 shape (benchmarks/decode_kernel.py --sweep --sweep-batch B; results/decode-batch-h100-2026-11-26/):
# batch 4 (32 KV heads) put 4 stages and 4 programs per SM first (interleaved A/B at 128K, one query: 711 µs against
# 765 µs with the batch-1 settings, flash 714; six queries 727 against 925); batch 16 (128 KV heads) put 2 stages and
# 2 programs per SM first (32K: 716 against 748 µs for batch 4's settings, flash 704), and so did batch 8 (64 KV
# heads; results/decode-batch8-h100-2026-11-26/: one query, 8K / 32K, 103.7 / 363.3 µs against 110.1 / 394.3 µs with
# batch 4's settings). Batch 1 keeps FP_CONFIG (batch 4's settings lose there: 32K, six queries, 72.6 against 62.4 µs).
FP_BATCH_CONFIG = [
    dict(min_heads=64, num_stages=2, programs_per_sm=2),
    dict(min_heads=16, num_stages=4, programs_per_sm=4),
]


@contextlib.contextmanager
def _overridden(config: dict, settings: dict):
    """``config`` updated with ``settings`` inside the block, restored after it."""
    saved = dict(config)
    config.update(settings)
    try:
        yield config
    finally:
        config.clear()
        config.update(saved)


@contextlib.contextmanager
def fp_config(**settings):
    """``with fp_config(block_n=64, num_warps=8):`` launches the full-precision segment with these settings, for one
    batch row and several alike."""
    unknown = set(settings) - set(FP_CONFIG)
    if unknown:
        raise ValueError(f"unknown full-precision launch settings {sorted(unknown)}; known: {sorted(FP_CONFIG)}")
    saved = [dict(entry) for entry in FP_BATCH_CONFIG]
    for entry in FP_BATCH_CONFIG:  # explicit settings hold for batched launches too
        entry.update({k: v for k, v in settings.items() if k in entry})
    try:
        with _overridden(FP_CONFIG, settings):
            yield FP_CONFIG
    finally:
        FP_BATCH_CONFIG[:] = saved


def _fp_settings(batch_rows: int, kv_heads: int) -> dict:
    """FP_CONFIG, with a batched launch's entry of FP_BATCH_CONFIG over it (``kv_heads``: rows x heads per row)."""
    if batch_rows > 1:
        for entry in FP_BATCH_CONFIG:
            if kv_heads >= entry["min_heads"]:
                return {**FP_CONFIG, **{k: v for k, v in entry.items() if k != "min_heads"}}
    return FP_CONFIG


def _validated(cfg: dict) -> dict:
    unknown = set(cfg) - set(QUANT_CONFIG)
    if unknown:
        raise ValueError(f"unknown quantized-attention launch settings {sorted(unknown)}; known: {sorted(QUANT_CONFIG)}")
    for view in ("gluon_int4", "gluon_int8", "gluon_int4_rows16", "gluon_int8_rows16"):
        if view in cfg and not (cfg[view] is None and view.endswith("rows16")):  # rows16 None: 8-row programs
            block, stages = cfg[view]
            if block not in (16, 32, 64) or stages not in (2, 3, 4):
                raise ValueError(f"{view} must be (tokens per block 16, 32 or 64, stages 2, 3 or 4), got {cfg[view]!r}")
            cfg[view] = (int(block), int(stages))
    if cfg.get("kernel", "gluon") not in ("gluon", "triton"):
        raise ValueError(f"kernel must be 'gluon' or 'triton', got {cfg['kernel']!r}")
    if cfg.get("path", "dot") not in ("dot", "vec"):
        raise ValueError(f"path must be 'dot' or 'vec', got {cfg['path']!r}")
    if not 0 <= int(cfg.get("vec_max_rows", 4)) <= 4:
        raise ValueError(f"vec_max_rows must be in 0..4, got {cfg['vec_max_rows']!r}")
    if cfg.get("qblock", 128) not in (16, 32, 64, 128):
        raise ValueError(f"qblock must be 16, 32, 64 or 128, got {cfg['qblock']!r}")
    return dict(cfg)


def load_quant_config(spec: str) -> dict:
    """A launch config from a JSON object string or the path of a JSON file (``{"config": {...}}`` also accepted,
    the shape of benchmarks/kernel_sweep.py's quant_config.json)."""
    text = spec if spec.lstrip().startswith("{") else open(spec).read()
    cfg = json.loads(text)
    if isinstance(cfg, dict) and isinstance(cfg.get("config"), dict):
        cfg = cfg["config"]
    if not isinstance(cfg, dict):
        raise ValueError(f"{QUANT_CONFIG_ENV} must hold a JSON object, got {type(cfg).__name__}")
    return _validated(cfg)


def quant_config(**settings):
    """``with quant_config(path="vec", qblock=64):`` launches the quantized segment with these settings."""
    return _overridden(QUANT_CONFIG, _validated(settings))


if os.environ.get(QUANT_CONFIG_ENV):
    QUANT_CONFIG.update(load_quant_config(os.environ[QUANT_CONFIG_ENV]))
SPLIT_MERGE_ENV = "HF_SPARSEKV_SPLIT_MERGE"  # "0": the merge of split results is always a launch of its own
if os.environ.get(SPLIT_MERGE_ENV) == "0":
    FP_CONFIG["merge_per_warp"] = 0


def gluon_settings(rows: int, int8: bool) -> tuple[int, int, int]:
    """(query rows per program, tokens per block, ring stages) of the Gluon kernel for ``rows`` query rows per KV
    head in the INT8 or INT4 view (QUANT_CONFIG)."""
    view = "gluon_int8" if int8 else "gluon_int4"
    wide = QUANT_CONFIG[view + "_rows16"] if rows > quant_gluon.ROWS else None
    return (16, *wide) if wide else (quant_gluon.ROWS, *QUANT_CONFIG[view])


def _kernels():
    from . import _decode_triton as tk

    return tk.decode_split_kernel, tk.combine_kernel


def dot_config(dtype: torch.dtype):
    """(input_precision, operand dtype) of the kernels' ``tl.dot``: the model dtype on the GPU (float32 in exact IEEE
    mode, not TF32). Triton 3.6's interpreter computes bfloat16 dots wrongly, so under ``TRITON_INTERPRET=1``
    bfloat16 operands are widened to float32 (tests only; the compiled path keeps bfloat16)."""
    import triton.language as tl

    if dtype == torch.float32 or (dtype == torch.bfloat16 and runtime.interpreting()):
        return "ieee", tl.float32
    return "tf32", {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few splits, so that tests exercise the merge


def _split_tokens(
    tokens: int, programs_per_split: int, block: int, device: torch.device, min_tokens: int, per_sm: int = 4,
    fill_per_sm: int = 0,
) -> int:
    """Tokens per split (a multiple of ``block``) so that about ``per_sm`` programs per SM run, none with fewer than
    ``min_tokens`` tokens unless that leaves fewer than ``fill_per_sm`` programs per SM (then splits get shorter, down
    to one block, to reach it)."""
    if tokens <= 0:
        return block
    sms = _sm_count(device)
    want = max(1, math.ceil(per_sm * sms / programs_per_split))
    enough = tokens // min_tokens
    if fill_per_sm:
        enough = max(enough, min(math.ceil(fill_per_sm * sms / programs_per_split), tokens // block))
    splits = max(1, min(want, enough))
    per = math.ceil(tokens / splits)
    return math.ceil(per / block) * block


def _fold_rows(qblock: int, head_dim: int, num_warps: int) -> int:
    """Rows of the register path's value accumulators: the block rows one repetition of the code tile's layout covers
    (16-byte vectors: ``D/32`` threads per row of ``D/2`` code bytes, so ``32·32/D`` rows per warp), at most
    ``qblock``; block rows folded onto one accumulator row are registers of one thread (no data movement)."""
    rows_per_warp = max(1, 32 // max(1, head_dim // 32))
    return min(qblock, rows_per_warp * num_warps)


# The merge of split results: channels per program, and partial-output elements a program loads at once (the split
# chunk is COMBINE_TILE / COMBINE_BLOCK_D splits: 256 splits of 16 channels, 32 registers per thread at 4 warps).
COMBINE_BLOCK_D, COMBINE_TILE = 16, 4096
COMBINE_MIN_SPLITS = 512  # the merge kernel's split weights loaded at once, at least (masked past the count)

NO_CHUNK = 1 << 62  # the kernel's chunk size where there are no chunks (every position in chunk 0)
MAX_BLOCK_M = 128  # query rows per program at most (FP_CONFIG's block_m); the quantized segment takes one program
# ``merge_per_warp`` (FP_CONFIG): with ``tickets`` given, the split kernel's last program of each row block merges
# the splits itself (:func:`~._decode_triton._merge_when_last`) where the partial outputs it reads, splits x rows x
# head_dim (each rounded up to a power of two), are at most this many float32 values per warp of the launch (one
# tile) times ``merge_tiles`` (read one tile after another); larger merges, or none given, run the merge kernel as a
# launch of its own. 0: always that launch. Four tiles take the quantized store's splits on the bundled verifier (65
# splits of 2 query rows at 4K, 32 to a tile), where a launch of its own cost 2 µs a layer (H100 profile).


def _merge_splits(rows: int, head_dim: int, num_warps: int) -> int:
    """The splits one in-kernel merge takes (see ``merge_per_warp``): as many as fill its tile with the partials of
    ``rows`` rows (0: not even one). The tile, not the split count, sets the kernel's ``MERGE_S``, so that engines
    of every capacity (their split counts differ) launch one compiled kernel."""
    room = FP_CONFIG["merge_per_warp"] * num_warps // (triton_next_pow2(rows) * head_dim)
    return 1 << (room.bit_length() - 1) if room else 0


def _merges_in_kernel(tickets, n_splits: int, row_blocks: int, kv_heads: int, merge_splits: int) -> bool:
    """Whether the split kernel merges its splits itself: a ticket per row block and KV head, and the partials of
    one row block in at most ``merge_tiles`` tiles (of ``merge_splits`` splits, :func:`_merge_splits`)."""
    return (tickets is not None and tickets.numel() >= row_blocks * kv_heads
            and n_splits <= merge_splits * FP_CONFIG["merge_tiles"])


def _block_m(rows: int) -> int:
    return max(16, triton_next_pow2(rows))


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@runtime.on_input_device
def launch_decode(
    q: torch.Tensor,
    scaling: float,
    k: torch.Tensor,
    v: torch.Tensor,
    quant: tuple | None = None,
    group_size: int = 0,
    int8: bool = False,
    fp_min_split: int | None = None,
    q_min_split: int | None = None,
    fp_length: torch.Tensor | None = None,
    quant_length: torch.Tensor | None = None,
    positions: tuple | None = None,
    tree: torch.Tensor | None = None,
    tickets: torch.Tensor | None = None,
    rope: tuple | None = None,
) -> torch.Tensor:
    """Launch the split-KV kernel(s). ``q [B, Hq, L, D]``; ``k/v [B, Hkv, S, D]`` (last dim contiguous), the
    full-precision segment; ``quant`` = (key QuantizedTensor, value QuantizedTensor) of the quantized segment or
    None. Returns ``[B, L, Hq, D]`` in ``q.dtype``. Callers validate shapes (see runtime.check_attention_inputs).

    Lengths on the device (CUDA-graph capture): with ``fp_length`` (int32 ``[B]``, one length per row) ``k/v`` are
    preallocated buffers of capacity S and only the first ``fp_length[b]`` tokens of row b are read (the last L of
    those are the queries' own); ``quant_length`` likewise for the code buffers of ``quant``. The grid is sized from
    the capacities and nothing is read on the host, so the launch can be captured and replayed as lengths change.
    B > 1 needs lengths on the device and ``k/v`` (and the code buffers of ``quant``) whose rows are laid out one
    after another (the preallocated buffers): rows are run as extra KV heads.

    ``positions = (slot_positions [B, S], query_positions [B, L], sink, window[, chunk])`` (int64 on the device; needs
    ``fp_length``, no ``quant``): of the first ``fp_length[b]`` slots of row b, query i sees the slots whose
    position s has ``0 <= s <= q`` and ``s < sink or s >= max(q - window, q - q % chunk)`` (q: the query's
    position ``query_positions[b, i]``; ``chunk``: chunked attention, 0 for none) (a sink+window ring buffer, or a
    cache in position order read by the positions its slots hold; a slot holding -1 is empty).

    ``tree`` (int64 ``[L]``, or ``[B, L]`` for one tree per row, on the device): the last L keys read (the queries'
    own) form a tree block, and query i of row b sees block key j iff bit j of ``tree[b, i]`` is set (its ancestors
    and itself: the ``spec_mask`` of :func:`~hf_sparsekv.kernels.reference.masked_attention_reference`); every key
    before the block is seen by every query (with ``positions``: by the positions rule above).

    ``tickets`` (int32, on the device, all zero, at least row blocks x KV heads: the caller's, e.g. a static cache's
    :meth:`~hf_sparsekv.caches.static.PreallocatedCache.tickets`, used by one launch at a time): the split kernel's
    last program of each row block merges the splits (one launch, not two) where they fit ``merge_tiles`` tiles; the
    kernel leaves them zero.

    ``rope = (key_new, value_new, cos, sin, slots, rows)`` (needs ``fp_length``; no ``quant``, nor ``tree`` with
    ``positions``): the step's rotary embedding and cache write in the same launch. ``q`` is then the queries before
    the rotary embedding, ``key_new/value_new [B, Hkv, L, D]`` the projections' keys (before it) and values,
    ``cos/sin [B, L, D]`` transformers' position embeddings (any strides, channels contiguous), ``slots [B, L]`` and
    ``rows [B]`` (int64) where the keys (rotated) and values go in ``k/v``: row ``rows[b]``, slots ``slots[b]`` (what
    ``k[rows[:, None], :, slots] = rotated keys`` writes; the rows distinct; with ``positions``, slots whose
    ``slot_positions`` are the step's ``query_positions``). The kernel folds the new keys in from registers (where
    the slots are a live row's last L slots read, in position order; always on a ring); the output is the kernel's
    over the written buffers (:func:`~.rope_attention.rope_decode_attention_reference`)."""
    tree = _checked_launch(q, quant, fp_length, quant_length, positions, tree, rope)
    runtime.require(q, k, v)
    batch = q.shape[0]
    if batch > 1:
        return _launch_rows(q, scaling, k, v, fp_min_split, fp_length, positions, quant, group_size, int8,
                            q_min_split, quant_length, tree, tickets, rope)
    decode_split_kernel, combine_kernel = _kernels()
    _, hq, length, d = q.shape
    hkv, s_fp = k.shape[1], k.shape[2]
    group = hq // hkv
    rows = group * length
    batch_rows = fp_length.numel() if fp_length is not None else 1  # a batch arrives folded into KV heads
    fcfg = _fp_settings(batch_rows, k.shape[1])
    block_m, block_n = _tiles(q, rows, quant is not None, fcfg)
    device = q.device
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("query/key/value must be contiguous in the last (head_dim) dimension")
    qcfg = QUANT_CONFIG
    gluon = (quant is not None and qcfg["kernel"] == "gluon"
             and hkv * quant[0].upper.shape[-2] * d >= qcfg["gluon_min_work"] and quant_gluon.usable(q, d, group_size))
    # Beside the Gluon kernel the full-precision segment is a launch of its own over the short buffer: one block per
    # program where that reaches programs_per_sm, so its few programs each wait on memory once.
    fsplit = _split_tokens(s_fp, hkv, block_n, device, fp_min_split or fcfg["min_split"], fcfg["programs_per_sm"],
                           fcfg["programs_per_sm"] if gluon else 0)
    vec_m = triton_next_pow2(rows) if qcfg["path"] == "vec" and rows <= min(4, qcfg["vec_max_rows"]) else 0
    n_fsplits = max(1, math.ceil(s_fp / fsplit))
    seg = _quant_segment(quant, k, group_size, int8, rows, hkv, device, q_min_split, vec_m, gluon)
    t_q, qblock, qsplit, n_qsplits = seg.tokens, seg.block, seg.split, seg.n_splits
    n_splits = n_qsplits + n_fsplits
    final = n_splits == 1 and not gluon
    out, op, lp, op_strides, lp_strides = _outputs(q, hkv, n_splits, rows, final)
    dot_prec, dot_dtype = dot_config(q.dtype)
    on_device = fp_length is not None
    s_ptr = fp_length if on_device else out
    row_heads = hkv // batch_rows
    t_ptr = quant_length if quant_length is not None else s_ptr
    pos_args = _position_args(positions, s_ptr)
    split_base = 0
    if gluon:  # the quantized splits by the Gluon kernel, then the full-precision ones below
        if n_qsplits:
            try:
                quant_gluon.launch_quant_splits(q, scaling * LOG2E, quant, group_size, int8, t_q, qsplit, n_qsplits, op,
                                                lp, quant_length, row_heads, length, *seg.gluon)
            except quant_gluon.CompileFailed:  # this Triton's Gluon: the Triton kernel from now on
                return launch_decode(q, scaling, k, v, quant=quant, group_size=group_size, int8=int8,
                                     fp_min_split=fp_min_split, q_min_split=q_min_split, fp_length=fp_length,
                                     quant_length=quant_length, positions=positions, tree=tree, tickets=tickets)
        split_base, n_splits_here, quant = n_qsplits, n_fsplits, None
    else:
        n_splits_here = n_splits
    row_blocks = math.ceil(rows / block_m)
    num_warps = qcfg["num_warps"] if quant is not None else fcfg["num_warps"]
    merge_splits = _merge_splits(min(rows, block_m), d, num_warps)
    merge = not final and _merges_in_kernel(tickets, n_splits, row_blocks, hkv, merge_splits)
    # without rope its 15 arguments are placeholders (pointers KN, VN, CS, SN, SL, RW and strides), never read
    rope_args = _rope_args(rope, k, length) if rope is not None else (s_ptr,) * 2 + (0,) * 6 + (s_ptr,) * 2 + (
        0, 0, s_ptr, 0, s_ptr)
    runtime.launch(
        decode_split_kernel, (row_blocks, n_splits_here, hkv),
        q, q.stride(1), q.stride(2),
        k, v, k.stride(1), k.stride(2), v.stride(1), v.stride(2), s_fp,
        *seg.keys.kernel_args(), *seg.values.kernel_args(), t_q,
        op, lp, *op_strides, *lp_strides,
        out, out.stride(0), out.stride(1),
        scaling * LOG2E, length, n_qsplits, qsplit, n_fsplits, fsplit, 0x4B000000, s_ptr, t_ptr, row_heads, *pos_args,
        s_ptr if tree is None else tree, 0 if tree is None or tree.shape[0] == 1 else tree.stride(0), split_base,
        tickets if merge else s_ptr, n_splits, *rope_args,
        GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, QBLOCK_N=qblock,
        KEY_GROUP=max(group_size, 1), HAS_QUANT=quant is not None, INT8=int8, FINAL=final, DOT_PREC=dot_prec,
        DOT_DTYPE=dot_dtype, TRANS_LOAD=bool(qcfg["trans_load"]), VEC_M=vec_m, PREFETCH=bool(qcfg["prefetch"]),
        LENGTHS_ON_DEVICE=on_device, BY_POSITION=positions is not None,
        ACC_ROWS=_fold_rows(qblock, d, qcfg["num_warps"]),
        ASM_CODES=bool(qcfg["asm_codes"]) and not runtime.interpreting(), TREE=tree is not None,
        MERGE=merge, MERGE_S=merge_splits if merge else 1,
        MERGE_R=triton_next_pow2(min(rows, block_m)) if merge else 1,
        ROPE=rope is not None, BLOCK_L=max(16, triton_next_pow2(length)) if rope is not None else 16,
        num_warps=num_warps,
        num_stages=qcfg["num_stages"] if quant is not None else fcfg["num_stages"], **runtime.LAUNCH_OPTIONS,
    )
    if not final and not merge:
        _combine(combine_kernel, op, lp, out, n_splits, group)
    return out.unsqueeze(0)


def _tiles(q: torch.Tensor, rows: int, quantized: bool, fcfg: dict) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)``: query rows per program (without a quantized segment, more rows than one tile take
    several programs per split) and full-precision tokens per loop step."""
    block_m = _block_m(rows)
    if not quantized:
        block_m = min(block_m, fcfg["block_m"], MAX_BLOCK_M)
    elif block_m > MAX_BLOCK_M:
        raise NotImplementedError(f"{rows} query rows per KV head over a quantized segment (at most {MAX_BLOCK_M})")
    d = q.shape[-1]
    block_n = fcfg["block_n"] or (64 if d <= 64 else 32)
    if q.dtype == torch.float32 and d > 64:  # float32 tiles of 64 x 128 over 3 stages overflow shared memory
        block_n = min(block_n, 32)
    return block_m, block_n


def _checked_launch(q, quant, fp_length, quant_length, positions, tree, rope) -> torch.Tensor | None:
    """:func:`launch_decode`'s arguments checked together; its ``tree`` as ``[B or 1, L]`` (one row of bits: every
    row's)."""
    if rope is not None and (fp_length is None or quant is not None or (positions is not None and tree is not None)):
        raise ValueError("rope needs fp_length (lengths on the device), no quantized segment, and no tree on a ring")
    if tree is not None:
        if tree.dtype != torch.int64 or tree.shape[-1] != q.shape[2] or tree.dim() > 2 or (
                tree.dim() == 2 and tree.shape[0] not in (1, q.shape[0] if fp_length is None else fp_length.numel())):
            raise ValueError(f"tree must be int64 [{q.shape[2]}] or [B, {q.shape[2]}] (one ancestor mask per query, "
                             "per row)")
        tree = tree if tree.dim() == 2 else tree[None]
    if quant is not None and (fp_length is None) != (quant_length is None):
        raise ValueError("fp_length and quant_length are given together (lengths on the device) or not at all")
    if positions is not None and (fp_length is None or quant is not None):
        raise ValueError("positions need fp_length (lengths on the device) and no quantized segment")
    return tree


class _QuantSegment(NamedTuple):
    """How a launch reads its quantized segment (:func:`_quant_segment`)."""

    tokens: int  # T_Q: the code buffers' tokens (their capacity where lengths are on the device)
    block: int  # tokens a program's loop step reads (the Triton kernel's QBLOCK_N)
    split: int  # tokens a split reads
    n_splits: int  # its splits (0: no quantized segment, or an empty one)
    keys: QuantizedTensor  # the keys' codes; placeholders without a segment
    values: QuantizedTensor  # the values' codes
    gluon: tuple | None  # the Gluon kernel's (block, stages, query rows per program), where it runs the segment


def _quant_segment(quant, k, group_size, int8, rows, hkv, device, q_min_split, vec_m, gluon) -> _QuantSegment:
    """The quantized segment's tiling: splits of whole key groups for the Gluon kernel (``gluon``: one warp per
    program, 8 or 16 query rows), or of ``block`` tokens for the Triton kernel; without ``quant``, placeholders the
    kernel never reads (``k`` stands in for the scale and zero pointers)."""
    qcfg = QUANT_CONFIG
    if quant is None:
        placeholder = QuantizedTensor(*(torch.empty(1, 1, 1, 1, dtype=torch.uint8, device=device),) * 2, k, k)
        return _QuantSegment(0, 16, 16, 0, placeholder, placeholder, None)
    qk, qv = quant
    t_q = qk.upper.shape[-2]
    qblock = next(b for b in (qcfg["qblock"], 64, 32, 16) if group_size % b == 0)
    settings = None
    if gluon:
        n_rows, block, stages = gluon_settings(rows, int8)
        settings = (block, stages, n_rows)
        qsplit = _split_tokens(t_q, hkv * math.ceil(rows / n_rows), group_size, device,
                               q_min_split or qcfg["gluon_min_split"], qcfg["gluon_per_sm"], qcfg["gluon_per_sm"])
    else:
        if q_min_split is None:
            q_min_split = qcfg["min_split"] if vec_m else qcfg["dot_min_split"]
        qsplit = _split_tokens(t_q, hkv, qblock, device, q_min_split, qcfg["programs_per_sm"], qcfg["fill_per_sm"])
    return _QuantSegment(t_q, qblock, qsplit, math.ceil(t_q / qsplit) if t_q else 0, qk, qv, settings)


def _outputs(q: torch.Tensor, hkv: int, n_splits: int, rows: int, final: bool) -> tuple:
    """``(out [L, Hq, D], partial outputs [Hkv, splits, rows, D], their log-sum-exps [Hkv, splits, rows], the
    partials' strides, the log-sum-exps' strides)``; a ``final`` launch (one split, no Gluon kernel) writes ``out``
    directly (the partials are ``out`` with zero strides, never read)."""
    _, hq, length, d = q.shape
    out = torch.empty(length, hq, d, dtype=q.dtype, device=q.device)
    if final:
        return out, out, out, (0, 0, 0), (0, 0)
    op = torch.empty(hkv, n_splits, rows, d, dtype=torch.float32, device=q.device)
    lp = torch.empty(hkv, n_splits, rows, dtype=torch.float32, device=q.device)
    return out, op, lp, op.stride()[:3], lp.stride()[:2]


def _position_args(positions: tuple | None, placeholder: torch.Tensor) -> tuple:
    """The split kernel's position arguments: slot positions and their row stride, query positions and theirs, sink,
    window, chunk (:data:`NO_CHUNK` for none); without ``positions``, placeholders never read."""
    if positions is None:
        return placeholder, 0, placeholder, 0, 0, 0, NO_CHUNK
    slot_pos, query_pos, sink, window, *chunk = positions
    return (slot_pos, slot_pos.stride(0), query_pos, query_pos.stride(0), int(sink), int(window),
            int(chunk[0]) if chunk and chunk[0] else NO_CHUNK)


def _combine(combine_kernel, op: torch.Tensor, lp: torch.Tensor, out: torch.Tensor, n_splits: int, group: int) -> None:
    """The merge of the splits' partial outputs ``op`` and log-sum-exps ``lp`` into ``out`` in a launch of its own
    (where the split kernel did not merge them): every split count up to :data:`COMBINE_MIN_SPLITS` in one compiled
    kernel (engines of every capacity)."""
    hkv, _, rows, d = op.shape
    block_s, block_d = max(triton_next_pow2(n_splits), COMBINE_MIN_SPLITS), min(d, COMBINE_BLOCK_D)
    runtime.launch(
        combine_kernel, (hkv, rows, d // block_d),
        op, lp, *op.stride()[:3], *lp.stride()[:2], out, out.stride(0), out.stride(1), n_splits, out.shape[0],
        GROUP=group, HEAD_DIM=d, BLOCK_S=block_s, BLOCK_D=block_d,
        CHUNK_S=min(block_s, COMBINE_TILE // block_d), num_warps=4, **runtime.LAUNCH_OPTIONS,
    )


def _rope_args(rope: tuple, k: torch.Tensor, length: int) -> tuple:
    """The split kernel's arguments for ``rope`` (see :func:`launch_decode`), checked against ``k [1, B·Hkv, S, D]``
    and the ``length`` queries."""
    key_new, value_new, cos, sin, slots, rows = rope
    batch, hkv, n, d = key_new.shape
    if value_new.shape != key_new.shape or n != length or batch * hkv != k.shape[1] or d != k.shape[-1]:
        raise ValueError(f"rope's keys/values must be [B, Hkv, {length}, {k.shape[-1]}] with B·Hkv = {k.shape[1]}, "
                         f"got {tuple(key_new.shape)} and {tuple(value_new.shape)}")
    if cos.shape != (batch, length, d) or sin.shape != cos.shape or slots.shape != (batch, length) or \
            rows.shape != (batch,):
        raise ValueError(f"rope's cos/sin must be [{batch}, {length}, {d}], slots [{batch}, {length}], rows [{batch}]")
    for t in (key_new, value_new, cos, sin, slots, rows):
        if t.stride(-1) != 1 or t.device != k.device:
            raise ValueError(f"rope's tensors must be on {k.device} with the last dimension contiguous")
    if slots.dtype != torch.int64 or rows.dtype != torch.int64:
        raise ValueError("rope's slots and rows must be int64")
    if sin.stride() != cos.stride():  # the kernel reads both with cos's strides
        cos, sin = cos.contiguous(), sin.contiguous()
    return (key_new, value_new, *key_new.stride()[:3], *value_new.stride()[:3], cos, sin, cos.stride(0), cos.stride(1),
            slots, slots.stride(0), rows)


def _launch_rows(q, scaling, k, v, fp_min_split, fp_length, positions, quant, group_size, int8, q_min_split,
                 quant_length, tree, tickets, rope=None) -> torch.Tensor:
    """A batch ``q [B, Hq, L, D]`` over preallocated ``k/v [B, Hkv, S, D]`` (and code buffers ``[B, Hkv, ...]``) with
    ``fp_length [B]`` (and ``quant_length [B]``): the rows become B·Hkv KV heads of one launch (each reads its row's
    lengths, and its row of ``positions``) -> ``[B, L, Hq, D]``."""
    batch, hq, length, d = q.shape
    hkv = k.shape[1]
    if fp_length is None or fp_length.numel() != batch:
        raise ValueError(f"a batch of {batch} rows needs fp_length with one length per row on the device")
    if quant is not None and quant_length.numel() != batch:
        raise ValueError(f"a batch of {batch} rows needs quant_length with one length per row on the device")

    def folded(t: torch.Tensor) -> torch.Tensor:  # [B, Hkv, ...] -> [1, B·Hkv, ...] without a copy
        if t.shape[0] != batch or t.shape[1] != hkv or t.stride(0) != hkv * t.stride(1):
            raise ValueError("batched key/value and code buffers must be [B, Hkv, ...] with rows one after another")
        return t.reshape(1, batch * hkv, *t.shape[2:])

    if quant is not None:
        quant = tuple(QuantizedTensor(*(folded(t) for t in (x.upper, x.lower, x.scale, x.zero))) for x in quant)
    out = launch_decode(
        q.reshape(1, batch * hq, length, d), scaling, folded(k), folded(v), quant=quant, group_size=group_size,
        int8=int8, fp_min_split=fp_min_split, q_min_split=q_min_split, fp_length=fp_length, quant_length=quant_length,
        positions=positions, tree=tree, tickets=tickets, rope=rope,
    )
    return out.view(length, batch, hq, d).transpose(0, 1).contiguous()
