"""Quality of a model pair on held-out documents: loss/top-1 by position bucket (acceptance is measured by
:func:`hf_sparsekv.training.measure_acceptance`).

These numbers prove the pair is fit for the benchmarks: the verifier must beat the drafter, and must be better at
long positions when it sees the whole context than when it sees only the last ``window`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

BUCKETS = ((0, 2048), (2048, 4096), (4096, 8192), (8192, 16384))


def _bucket_name(lo: int, hi: int) -> str:
    return f"{lo // 1024}-{hi // 1024}K"


def window_mask(length: int, window: int, device) -> torch.Tensor:
    """``[1, 1, L, L]`` boolean mask: query ``i`` sees keys ``i - window < j <= i`` (True = attend)."""
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    return ((j <= i) & (j > i - window))[None, None]


@torch.no_grad()
def position_metrics(model, documents: Sequence[torch.Tensor], window: int | None = None,
                     buckets=BUCKETS, desc: str = "positions") -> dict[str, dict[str, float]]:
    """Next-token loss and top-1 accuracy per position bucket over ``documents`` (1-D LongTensors).

    Position ``p`` is the predicted token's index (predicted from tokens ``< p``). With ``window`` the model sees
    only the last ``window`` tokens at every position (real positions kept), via a custom 4-D mask.
    """
    device = next(model.parameters()).device
    sums = {b: [0.0, 0.0, 0] for b in buckets}
    for doc in tqdm(documents, desc=desc, leave=False):
        ids = doc[None].to(device)
        kwargs = {}
        if window is not None:
            kwargs["attention_mask"] = window_mask(ids.shape[1], window, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(ids, **kwargs).logits[0, :-1].float()
        targets = ids[0, 1:]
        loss = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
        hit = (logits.argmax(-1) == targets).float()
        positions = torch.arange(1, ids.shape[1], device=device)
        for b in buckets:
            sel = (positions >= b[0]) & (positions < b[1])
            if sel.any():
                sums[b][0] += loss[sel].sum().item()
                sums[b][1] += hit[sel].sum().item()
                sums[b][2] += int(sel.sum())
    return {_bucket_name(*b): {"loss": s[0] / s[2], "top1": s[1] / s[2], "tokens": s[2]} for b, s in sums.items() if s[2]}
