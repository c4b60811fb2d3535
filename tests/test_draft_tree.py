"""Two branches from one root (retrieval beside a drafter, :mod:`hf_sparsekv.generation.draft_tree`): the tree's
constants, greedy acceptance on hand-made cases, and sampled acceptance against the exactly enumerated distribution
of the first two emitted tokens (200,000 vectorized rounds; a rule that skips the residual for the retrieved draft
fails the same test)."""

from __future__ import annotations

import math

import torch

from hf_sparsekv.generation.acceptance import accept_or_resample_two_chains, accept_two_chains
from hf_sparsekv.generation.draft_tree import TwoChains
from hf_sparsekv.generation.sampling import draw
from hf_sparsekv.kernels.reference import ancestor_mask

from .test_sampling import _consistent


def test_two_chains_tree_constants():
    tree = TwoChains.build(3, "cpu")
    assert tree.depths.tolist() == [0, 1, 2, 3, 1, 2, 3]
    assert tree.branches.tolist() == [[0, 1, 2, 3], [0, 4, 5, 6]]
    mask = ancestor_mask(tree.bits)
    assert mask[6].tolist() == [True, False, False, False, True, True, True]  # root and its own branch only
    assert mask[2].tolist() == [True, True, True, False, False, False, False]
    assert torch.equal(mask.sum(1), tree.depths + 1)


def test_greedy_keeps_the_longer_branch_and_the_drafters_on_a_tie():
    drafts = torch.tensor([
        [[5, 6, 7], [5, 9, 9]],  # the drafter's branch accepts 3
        [[5, 1, 1], [5, 6, 7]],  # the retrieved one accepts 3
        [[5, 6, 1], [5, 6, 2]],  # both accept 2: the drafter's
        [[1, 1, 1], [2, 2, 2]],  # neither
    ])
    verified = torch.tensor([
        [[5, 6, 7, 8], [5, 6, 7, 8]],
        [[5, 6, 0, 0], [5, 6, 7, 4]],
        [[5, 6, 3, 0], [5, 6, 4, 0]],
        [[5, 0, 0, 0], [5, 0, 0, 0]],
    ])
    accepted, tokens, second = accept_two_chains(verified, drafts)
    assert accepted.tolist() == [3, 3, 2, 0]
    assert second.tolist() == [False, True, False, False]
    assert tokens.tolist() == [[5, 6, 7, 8], [5, 6, 7, 4], [5, 6, 3, 0], [5, 0, 0, 0]]


def _setting(t: int, vocab: int, seed: int):
    """A verifier whose next-token distribution depends on the last token only (``table [V+1, V]``, row V: the
    root's), a drafter ``q`` that often disagrees, and a retrieved branch that is a fixed function of the trial."""
    g = torch.Generator().manual_seed(seed)
    table = torch.softmax(torch.randn(vocab + 1, vocab, generator=g, dtype=torch.float64) * 1.5, -1)
    table[:, -1] = 0.0  # a token the verifier never takes
    table /= table.sum(-1, keepdim=True)
    drafter = torch.softmax(torch.randn(vocab + 1, vocab, generator=g, dtype=torch.float64) * 2.5, -1)
    k = 2
    root = torch.full((t,), vocab)
    drafts_a = torch.empty(t, k, dtype=torch.long)
    q = torch.empty(t, k, vocab, dtype=torch.float64)
    last = root
    for i in range(k):
        q[:, i] = drafter[last]
        drafts_a[:, i] = draw(q[:, i])
        last = drafts_a[:, i]
    drafts_b = torch.stack([torch.arange(t) % vocab, (torch.arange(t) // vocab) % vocab], 1)  # every pair, the
    drafts = torch.stack([drafts_a, drafts_b], 1)  # unlikely token included, equal to the drafter's at times
    p = torch.empty(t, 2, k + 1, vocab, dtype=torch.float64)
    for branch in range(2):
        p[:, branch, 0] = table[root]
        for i in range(k):
            p[:, branch, i + 1] = table[drafts[:, branch, i]]
    return table, p, q, drafts


def _first_two(accepted, token, second, drafts, table):
    """The first two tokens emitted (a round that ended at its root: the second drawn by the next round)."""
    path = torch.where(second[:, None], drafts[:, 1], drafts[:, 0])
    first = torch.where(accepted > 0, path[:, 0], token)
    after = torch.where(accepted > 1, path[:, 1], token)
    return first, torch.where(accepted > 0, after, draw(table[first]))


def test_sampling_over_two_branches_emits_the_verifier_distribution():
    torch.manual_seed(0)
    t, vocab = 200_000, 5
    table, p, q, drafts = _setting(t, vocab, seed=1)
    accepted, token, second = accept_or_resample_two_chains(p, q, drafts)
    assert 0 < float(second.double().mean()) < 0.5 and 0 < float((accepted == 0).double().mean()) < 1
    assert bool((second & (accepted == 0)).logical_not().all())  # a path on the second branch holds a draft
    first, after = _first_two(accepted, token, second, drafts, table)
    joint = (table[vocab][:, None] * table[:vocab]).flatten()
    assert _consistent(first * vocab + after, joint)
    assert float(0.5 * (torch.bincount(first * vocab + after, minlength=vocab * vocab) / t - joint).abs().sum()) < 0.01
    # A plausible bug, the retrieved draft accepted with its probability under p instead of under the residual
    # left by the drafter's rejected draft, emits the wrong first token: the same test rejects it.
    x, y, root = drafts[:, 0, 0], drafts[:, 1, 0], p[:, 0, 0]
    take_x = torch.rand(t, dtype=torch.float64) * q[:, 0].gather(1, x[:, None])[:, 0] < root.gather(1, x[:, None])[:, 0]
    take_y = ~take_x & (y != x) & (torch.rand(t, dtype=torch.float64) < root.gather(1, y[:, None])[:, 0])
    rest = (root - q[:, 0]).clamp_min(0).scatter(1, y[:, None], 0.0)
    wrong_first = torch.where(take_x, x, torch.where(take_y, y, draw(rest)))
    assert not _consistent(wrong_first, table[vocab])
    assert math.isclose(float(table[vocab].sum()), 1.0)
