"""Identity on real weights (issue 14): Qwen2.5-Coder-1.5B-Instruct verifier, Qwen2.5-Coder-0.5B-Instruct drafter,
CPU float32, prompts of 2048 tokens of held-out Python source, 64 new tokens.

Each speculative mode must produce exactly the tokens of an independent reference: stock greedy ``generate()`` of
the verifier (for chunk-budget, window and full drafter caches), and stock greedy ``generate()`` of the verifier on
a ``HierarchicalQuantCache`` (INT8 view) for int4 self-speculation. A mismatch reports the first differing position
and the verifier's top-2 logit gap there (a gap near float32 rounding is a tie, anything else is a bug).

Marked ``real``: skipped unless HF_SPARSEKV_REAL=1 (``make test-real`` sets it after fetching the pair).
"""

from __future__ import annotations

import functools

import pytest
import torch

from hf_sparsekv import HierarchicalQuantCache

pytestmark = pytest.mark.real

PROMPT_TOKENS = 2048
NEW_TOKENS = 64
N_PROMPTS = 3
GAMMA = 5
MODES = {
    "chunk-256": dict(kv_budget=256),
    "chunk-1024": dict(kv_budget=1024),
    "window-1024": dict(draft_cache="window", kv_budget=1024),
    "full": dict(draft_cache="full"),
    "int4-self": None,  # the verifier drafts on the INT4 view of its own store
}


@functools.lru_cache(maxsize=1)
def _pair():
    from hf_sparsekv.zoo.real import load_real_pair

    return load_real_pair(device="cpu", dtype=torch.float32)


@functools.lru_cache(maxsize=1)
def _prompts() -> tuple[torch.Tensor, ...]:
    """The first N_PROMPTS held-out python-source documents of at least PROMPT_TOKENS tokens, one per package, cut
    to that length."""
    from hf_sparsekv.data import python_source_documents

    tokenizer = _pair()[2]
    out, packages = [], set()
    for doc in python_source_documents("eval"):
        if doc.package in packages:
            continue
        ids = tokenizer(doc.text, add_special_tokens=False, return_tensors="pt").input_ids
        if ids.shape[1] >= PROMPT_TOKENS:
            out.append(ids[:, :PROMPT_TOKENS])
            packages.add(doc.package)
        if len(out) == N_PROMPTS:
            return tuple(out)
    raise RuntimeError(f"fewer than {N_PROMPTS} held-out documents of {PROMPT_TOKENS} tokens in this installation")


def _greedy(**extra):
    return dict(max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True, output_logits=True, **extra)


@functools.lru_cache(maxsize=None)
def _reference(prompt_index: int, int8: bool):
    verifier = _pair()[0]
    ids = _prompts()[prompt_index]
    extra = dict(past_key_values=HierarchicalQuantCache()) if int8 else {}
    with torch.no_grad():
        return verifier.generate(ids, **_greedy(**extra))


def _first_divergence(got, ref, prompt_len):
    g, r = got.sequences[0, prompt_len:], ref.sequences[0, prompt_len:]
    n = min(len(g), len(r))
    diff = (g[:n] != r[:n]).nonzero()
    if len(diff) == 0:
        return None if len(g) == len(r) else f"lengths differ: {len(g)} vs {len(r)}"
    i = int(diff[0])
    top = torch.topk(ref.logits[i][0].double(), 2)
    gap = float(top.values[0] - top.values[1])
    return (f"first divergence at new token {i}: reference {int(r[i])}, got {int(g[i])}; reference top-2 logit gap "
            f"there {gap:.3g} (top-2 ids {top.indices.tolist()})")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("prompt_index", range(N_PROMPTS))
def test_speculative_equals_greedy_ar_on_the_real_pair(prompt_index, mode):
    verifier, drafter, _ = _pair()
    ids = _prompts()[prompt_index]
    if mode == "int4-self":
        spec = dict(assistant_model=verifier, draft_cache="int4")
    else:
        spec = dict(assistant_model=drafter, **MODES[mode])
    reference = _reference(prompt_index, int8=mode == "int4-self")
    with torch.no_grad():
        out = verifier.generate(ids, num_assistant_tokens=GAMMA, **spec, **_greedy())
    problem = _first_divergence(out, reference, ids.shape[1])
    assert problem is None, f"{mode}, prompt {prompt_index}: {problem}"
    stats = out.spec_stats
    print(f"\n{mode} prompt {prompt_index}: alpha={stats['acceptance_rate']:.3f} tau={stats['mean_accepted_length']:.2f}")
    assert stats["new_tokens"] == out.sequences.shape[1] - ids.shape[1]
