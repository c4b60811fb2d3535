"""Quality of a model pair on held-out documents: loss/top-1 by position bucket, and greedy acceptance.

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


def acceptance(verifier, drafter, documents: Sequence[torch.Tensor], contexts: Sequence[int], gamma: int = 5,
               max_new_tokens: int = 64, draft_cache: str = "full", kv_budget: int | None = None) -> dict[int, dict]:
    """Greedy acceptance of ``drafter`` against ``verifier`` with prompts of each context length cut from documents.

    Returns ``{context: {"acceptance": accepted/drafted, "tau": tokens per verifier forward, "prompts": n}}``,
    pooled over prompts (documents shorter than the context are skipped).
    """
    from ..generation import speculative_generate

    device = next(verifier.parameters()).device
    result = {}
    for context in contexts:
        drafted = accepted = rounds = new = used = 0
        for doc in tqdm(documents, desc=f"acceptance {context}", leave=False):
            if len(doc) < context:
                continue
            out = speculative_generate(verifier, doc[None, :context].to(device), assistant_model=drafter,
                                       draft_cache=draft_cache, kv_budget=kv_budget, num_assistant_tokens=gamma,
                                       max_new_tokens=max_new_tokens, return_dict_in_generate=True)
            s = out.spec_stats
            drafted, accepted, rounds, new, used = (drafted + s["drafted"], accepted + s["accepted"],
                                                    rounds + s["rounds"], new + s["new_tokens"], used + 1)
        if used:
            result[context] = {"acceptance": accepted / max(drafted, 1), "tau": (new - used) / max(rounds, 1),
                               "prompts": used}
    return result
