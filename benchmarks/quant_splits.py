"""How the quantized store's decode launches split their work, at the bundled verifier's shape: one CUDA graph of a
step's 12 ``hf_sparsekv::static_quant_decode`` launches (one a layer: 4 query heads, 2 KV heads, head_dim 64, key
groups of 128, bfloat16, the merge counters of a static cache), replayed under each launch setting of ``SETTINGS``.

The setting that matters here is the quantized segment's split count: ``QUANT_CONFIG["fill_per_sm"]`` (splits shrink
until the GPU holds that many programs per SM) and ``FP_CONFIG["merge_tiles"]`` (how many splits the kernel's last
program merges itself instead of a second launch). Each step kind is timed: ``plain`` (one query, INT8 view),
``draft`` (one query, INT4 view), ``verify6`` (7 queries, INT8 view), at each context of ``--contexts`` (the store
holding the context less a buffer's worth of tokens, its capacity 512 more), beside ``ar``: our AR's attention launch
(``hf_sparsekv::static_decode``, one query over a bfloat16 buffer of the whole context, 12 layers). Time: the median
over ``--repeats`` replays of CUDA events around one replay, in µs for the 12 launches (capture and warm-ups outside).
Each row's floor: the bytes its 12 launches must read once (codes of the view, scales, zero points, the buffer; for
``ar`` the bfloat16 keys and values) over the device copy rate of the same run (bytes read + written).

    python benchmarks/quant_splits.py --out runs/quant-splits
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from hf_sparsekv.caches.prefill_quantize import quantize_into
from hf_sparsekv.caches.static import StaticQuantCache
from hf_sparsekv.kernels import decode_core
from hf_sparsekv.static_attention import static_decode, static_quant_decode

from linear_kernels import captured, copy_rate, time_graphs
from provenance import commit

LAYERS, KV_HEADS, QUERY_HEADS, HEAD_DIM, GROUP = 12, 2, 4, 64, 128  # the bundled verifier's attention
STEPS = {"plain": (1, True), "draft": (1, False), "verify6": (7, True)}  # name: (queries, INT8 view)
SETTINGS = {  # name: (QUANT_CONFIG settings, FP_CONFIG settings)
    "fill4": (dict(fill_per_sm=4), {}),
    "fill2": (dict(fill_per_sm=2), {}),
    "fill2-tiles5": (dict(fill_per_sm=2), dict(merge_tiles=5)),
    "fill1": (dict(fill_per_sm=1), {}),
    "fill4-tiles9": (dict(fill_per_sm=4), dict(merge_tiles=9)),
    "fill1-min-split-256": (dict(fill_per_sm=1, min_split=256), {}),
}


def filled_store(context: int, device: str) -> tuple[StaticQuantCache, int]:
    """A store of LAYERS layers holding ``context`` tokens (random), all but the last 130 or so quantized; its
    quantized length."""
    store = StaticQuantCache(GROUP, context + 512, 9, LAYERS, KV_HEADS, HEAD_DIM, torch.bfloat16, device)
    quantized = (context - 130) // GROUP * GROUP
    for layer in store.layers:
        shape = (1, KV_HEADS, quantized, HEAD_DIM)
        quantize_into(layer.qkeys, layer.qvalues, 0, torch.randn(*shape, device=device, dtype=torch.bfloat16),
                      torch.randn(*shape, device=device, dtype=torch.bfloat16), 0, GROUP)
        layer.keys.normal_()
        layer.values.normal_()
    return store, quantized


def captured_step(store: StaticQuantCache, context: int, quantized: int, queries: int, int8: bool,
                  settings: tuple[dict, dict]) -> torch.cuda.CUDAGraph:
    """The 12 launches of one step under ``settings``, captured (:func:`linear_kernels.captured`)."""
    device = store.layers[0].keys.device
    fp_length = torch.tensor([context - quantized], dtype=torch.int32, device=device)
    quant_length = torch.tensor([quantized], dtype=torch.int32, device=device)
    tickets = torch.zeros(KV_HEADS * 16, dtype=torch.int32, device=device)
    query = torch.randn(1, QUERY_HEADS, queries, HEAD_DIM, device=device, dtype=torch.bfloat16)

    def step():
        for layer in store.layers:
            k, v = layer.qkeys, layer.qvalues
            static_quant_decode(query, layer.keys, layer.values, k.upper, k.lower, k.scale, k.zero, v.upper, v.lower,
                                v.scale, v.zero, fp_length, quant_length, GROUP, int8, HEAD_DIM ** -0.5, tickets)

    with decode_core.quant_config(**settings[0]), decode_core.fp_config(**settings[1]):
        return captured(step)


def captured_ar_step(context: int, device: str) -> torch.cuda.CUDAGraph:
    """Our AR's 12 attention launches: one query over a bfloat16 buffer of ``context`` tokens a layer, captured."""
    keys, values = ([torch.randn(1, KV_HEADS, context + 512, HEAD_DIM, device=device, dtype=torch.bfloat16)
                     for _ in range(LAYERS)] for _ in range(2))
    length = torch.tensor([context], dtype=torch.int32, device=device)
    tickets = torch.zeros(KV_HEADS * 16, dtype=torch.int32, device=device)
    query = torch.randn(1, QUERY_HEADS, 1, HEAD_DIM, device=device, dtype=torch.bfloat16)

    def step():
        for key, value in zip(keys, values):
            static_decode(query, key, value, length, HEAD_DIM ** -0.5, None, tickets)

    return captured(step)


def floor_bytes(context: int, quantized: int, step: str) -> int:
    """The bytes a step's 12 launches must read once: for ``ar`` the context's bfloat16 keys and values; else the
    quantized tokens' codes (upper, and lower in the INT8 view: D/2 bytes each), key scale/zero per group and value
    scale/zero per token (bfloat16), and the buffer's bfloat16 keys and values."""
    if step == "ar":
        return LAYERS * KV_HEADS * context * HEAD_DIM * 2 * 2
    views = 2 if STEPS[step][1] else 1
    codes = 2 * quantized * HEAD_DIM // 2 * views
    scales = 2 * 2 * (quantized // GROUP * HEAD_DIM + quantized)
    buffer = 2 * (context - quantized) * HEAD_DIM * 2
    return LAYERS * KV_HEADS * (codes + scales + buffer)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="16384,4096")
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--settings", default=",".join(SETTINGS), help="a comma-separated subset of SETTINGS")
    p.add_argument("--out", default="runs/quant-splits")
    args = p.parse_args()
    chosen = args.settings.split(",")
    unknown = sorted(set(chosen) - set(SETTINGS))
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; known: {sorted(SETTINGS)}")
    if not torch.cuda.is_available():
        raise SystemExit("quant_splits.py times CUDA graphs: it needs a CUDA GPU")
    rows = []
    bandwidth = copy_rate()
    print(f"copy rate {bandwidth / 1e12:.2f} TB/s (read + write)")
    print("| context | step | setting | µs (12 launches) | floor (µs) |\n| --- | --- | --- | --- | --- |")

    def timed(context, step, name, graph, quantized):
        us = time_graphs({name: graph}, args.repeats)[name] * 1000
        floor = floor_bytes(context, quantized, step) / bandwidth * 1e6
        rows.append(dict(context=context, step=step, setting=name, us_12_launches=us, floor_us=floor))
        print(f"| {context} | {step} | {name} | {us:.1f} | {floor:.1f} |", flush=True)

    for context in (int(c) for c in args.contexts.split(",")):
        timed(context, "ar", "default", captured_ar_step(context, "cuda"), 0)
        store, quantized = filled_store(context, "cuda")
        for step, (queries, int8) in STEPS.items():
            for name in chosen:
                timed(context, step, name, captured_step(store, context, quantized, queries, int8, SETTINGS[name]),
                      quantized)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), commit=commit(),
                  torch=torch.__version__, settings=vars(args), copy_rate=bandwidth, rows=rows)
    (out / "quant_splits.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
