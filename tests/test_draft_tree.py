"""Draft trees (:mod:`hf_sparsekv.generation.draft_tree`) and their acceptance (:func:`~hf_sparsekv.generation.
acceptance.walk_tree`): each row's tree against a plain-Python reference of the layout, greedy acceptance against a
brute-force walk, and sampled acceptance against the exactly enumerated distribution of the first two emitted tokens
(200,000 vectorized rounds over a tree with the drafter's chain, its alternatives and a retrieved chain; a rule that
tries an alternative with its probability under p instead of under the residual fails the same test)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hf_sparsekv.generation.acceptance import walk_tree
from hf_sparsekv.generation.drafting import top_k
from hf_sparsekv.generation.draft_tree import CHAIN, RETRIEVED, SIBLING, DraftTree, ancestor_bits_of, path_nodes
from hf_sparsekv.generation.sampling import draw
from hf_sparsekv.kernels.reference import ancestor_mask

from .test_sampling import _consistent


def _drafted(layout: DraftTree, rows: int, g: torch.Generator):
    """Random drafter output with the structure :func:`~hf_sparsekv.generation.drafting.draft_tree` leaves: the
    chain and its cumulative log-probabilities, the pool (tokens, scores; the parents' frontier slots are the layout's ``pool_from``) and the frontiers
    (each depth's chain node and W - 1 best pool nodes), every child's score below its parent's."""
    gamma, w, first = layout.gamma, layout.width, layout.first
    chain = torch.randint(0, 50, (rows, gamma), generator=g)
    tokens = torch.randint(0, 50, (rows, layout.pool), generator=g)
    scores = torch.zeros(rows, layout.pool)
    frontier = torch.full((rows, max(gamma - 1, 1), w), -1, dtype=torch.long)
    chain_score = -torch.rand(rows, generator=g)
    scores[:, :first] = -torch.rand(rows, first, generator=g) * 4
    for d in range(1, gamma):
        lo, hi = (0, first) if d == 1 else (first + (d - 2) * w * w, first + (d - 1) * w * w)
        frontier[:, d - 1, 1:] = lo + scores[:, lo:hi].topk(w - 1, dim=1).indices
        parent = torch.cat([chain_score[:, None], scores.gather(1, frontier[:, d - 1, 1:])], 1)  # [B, W]
        at = first + (d - 1) * w * w
        scores[:, at : at + w * w] = (parent[:, :, None] - torch.rand(rows, w, w, generator=g) * 3).flatten(1)
        chain_score = chain_score - torch.rand(rows, generator=g)
    return chain, (tokens, scores), frontier


def _reference_tree(layout: DraftTree, chain, pool, frontier, retrieved, matched):
    """One row's nodes as lists ``(tokens, parents, depths, kinds)``, built literally from the layout's rules."""
    gamma, w, first = layout.gamma, layout.width, layout.first
    tokens, parents, depths, kinds = [0] + chain, [0] + list(range(gamma)), list(range(gamma + 1)), [CHAIN] * (gamma + 1)
    extra = layout.size - gamma
    graft = layout.retrieved if (matched or not w) else 0
    for j in range(graft):
        tokens.append(retrieved[j])
        parents.append(0 if j == 0 else gamma + j)
        depths.append(j + 1)
        kinds.append(RETRIEVED)
    if not w:
        return tokens, parents, depths, kinds
    pool_tokens, pool_scores = pool
    depth_of = [1] * first + [2 + i // (w * w) for i in range(layout.pool - first)]
    via = [0] * first + [(i // w) % w for i in range(layout.pool - first)]
    ranked = sorted(range(layout.pool), key=lambda i: -(pool_scores[i] - 1e-3 * depth_of[i]))[: extra - graft]
    index = {p: len(tokens) + k for k, p in enumerate(ranked)}
    for p in ranked:
        d = depth_of[p]
        up = -1 if d == 1 else frontier[d - 2][via[p]]
        tokens.append(pool_tokens[p])
        parents.append(d - 1 if up < 0 else index[up])
        depths.append(d)
        kinds.append(SIBLING)
    return tokens, parents, depths, kinds


@pytest.mark.parametrize("gamma,size,retrieval", [(3, 12, True), (3, 12, False), (5, 32, True), (1, 6, True),
                                                  (4, 8, False), (4, 6, True), (2, None, True), (8, 62, False)])
def test_each_rows_tree_is_the_layouts(gamma, size, retrieval):
    """The chain, then the retrieved chain of a row with a match, then the most probable pool nodes by path
    probability, each under its own parent (a chain node or a frontier node kept before it); the ancestor bits those
    of the parents; the path to any node."""
    layout = DraftTree.plan(gamma, size, retrieval)
    g = torch.Generator().manual_seed(gamma * 100 + (size or 0))
    rows = 6
    if layout.width:
        chain, pool, frontier = _drafted(layout, rows, g)
    else:
        chain, pool, frontier = torch.randint(0, 50, (rows, gamma), generator=g), None, None
    retrieved = torch.randint(0, 50, (rows, layout.retrieved), generator=g)
    matched = torch.tensor([True, False, True, False, True, True])
    tokens, parents, depths, bits, kinds = layout.build(layout.constants("cpu"), chain, pool, frontier,
                                                        retrieved if retrieval else None, matched if retrieval else None)
    assert tokens.shape == (rows, layout.size + 1)
    grown = False
    for b in range(rows):
        row_pool = None if pool is None else tuple(t[b].tolist() for t in pool)
        ref = _reference_tree(layout, chain[b].tolist(), row_pool, None if frontier is None else frontier[b].tolist(),
                              retrieved[b].tolist(), bool(matched[b]) and retrieval)
        assert tokens[b, 1:].tolist() == ref[0][1:], b
        assert (parents[b].tolist(), depths[b].tolist(), kinds[b].tolist()) == ref[1:], b
        grown |= any(ref[3][p] == SIBLING for p in ref[1])
        mask = ancestor_mask(bits[b])
        for i in range(layout.size + 1):  # bit j of node i: j on the path from the root to i
            path, j = [i], i
            while j != 0:
                assert ref[1][j] < j  # every parent before its child
                j = ref[1][j]
                path.append(j)
            assert mask[i].nonzero().flatten().tolist() == sorted(path)
            on_path = path_nodes(bits[b : b + 1], depths[b : b + 1], torch.tensor([i]), gamma)[0].tolist()
            assert on_path[: ref[2][i]] == sorted(path)[1:]
    assert grown or gamma == 1 or layout.size - gamma < 8 or not layout.width  # paths off the chain are kept


@pytest.mark.parametrize("shape, k", [((2, 4, 128256), 4), ((1, 50000), 57), ((3, 4097), 7), ((2, 100), 3)])
def test_top_k_over_a_vocabulary_equals_torch_topk(shape, k):
    """The drafter's two-stage top-k over a vocabulary: the values of one ``torch.topk`` (largest first, or in any
    order unordered), at distinct indices that hold them, also with many ties (integer scores) and a -inf (the
    chain's own token)."""
    g = torch.Generator().manual_seed(sum(shape) + k)
    for x in (torch.randn(shape, generator=g), torch.randint(-3, 4, shape, generator=g).float()):
        x[..., 5] = float("-inf")
        want = x.topk(k, dim=-1)
        for ordered in (True, False):
            got = top_k(x, k, ordered)
            assert torch.equal(got.values if ordered else got.values.sort(-1, descending=True).values, want.values)
            assert torch.equal(x.gather(-1, got.indices), got.values)
            assert (got.indices.sort(-1).values.diff(dim=-1) > 0).all()


def test_chain_only_layouts_are_none_and_retrieval_alone_is_two_chains():
    assert DraftTree.plan(4, None, False) is None and DraftTree.plan(4, 4, True) is None
    assert DraftTree.plan(4, None, True) == DraftTree(4, 8, 4, 0)
    assert DraftTree.plan(4, 6, True) == DraftTree(4, 6, 2, 2)
    for gamma in range(1, 9):  # the drafter's block fits the kernel's ancestor bits
        for size in range(gamma + 1, 63):
            tree = DraftTree.plan(gamma, size, False)
            assert tree.width >= 2 and tree.block <= 62 and tree.first >= size - gamma


def _brute_force_walk(tokens, parents, targets):
    node, accepted = 0, 0
    while True:
        children = [i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == targets[node]]
        if not children:
            return node, accepted, targets[node]
        node, accepted = children[0], accepted + 1


def test_greedy_walk_follows_the_verifiers_tokens():
    """Random trees whose nodes often carry the verifier's token: the kept node, its depth and the token after it as
    a walk that at each node takes the first child carrying the verifier's token."""
    rnd = random.Random(0)
    gamma, rows, length = 4, 300, 14
    tokens, parents, targets = [], [], []
    for _ in range(rows):
        par = [0] + list(range(gamma)) + [rnd.randrange(0, i) if i > gamma + 2 else 0 for i in range(gamma + 1, length)]
        par = [min(p, i - 1) if i else 0 for i, p in enumerate(par)]
        depth = [0] * length
        for i in range(1, length):
            depth[i] = depth[par[i]] + 1
        par = [p if depth[i] <= gamma else 0 for i, p in enumerate(par)]  # no node deeper than γ
        targets.append([rnd.randrange(4) for _ in range(length)])
        tokens.append([0] + [targets[-1][par[i]] if rnd.random() < 0.6 else rnd.randrange(4) for i in range(1, length)])
        parents.append(par)
    node, accepted, token = walk_tree(torch.tensor(tokens), torch.tensor(parents), gamma, targets=torch.tensor(targets))
    expected = [_brute_force_walk(t, p, v) for t, p, v in zip(tokens, parents, targets)]
    assert list(zip(node.tolist(), accepted.tolist(), token.tolist())) == expected
    assert len({e[1] for e in expected}) >= 3  # paths of several lengths, on and off the chain
    assert any(e[0] > gamma for e in expected) and any(0 < e[0] <= gamma for e in expected)


def _tree_setting(t: int, vocab: int, seed: int):
    """γ = 2: a verifier whose next-token distribution depends on the last token only (``table [V+1, V]``, row V: the
    root's), a drafter ``q`` that often disagrees. Nodes: 0 root, 1-2 the drafter's chain (drawn from q), 3-4 a
    retrieved chain (a fixed function of the trial, the unlikely token included), 5 the drafter's most probable
    other token after the root, 6 after node 1."""
    g = torch.Generator().manual_seed(seed)
    table = torch.softmax(torch.randn(vocab + 1, vocab, generator=g, dtype=torch.float64) * 1.5, -1)
    table[:, -1] = 0.0  # a token the verifier never takes
    table /= table.sum(-1, keepdim=True)
    drafter = torch.softmax(torch.randn(vocab + 1, vocab, generator=g, dtype=torch.float64) * 2.5, -1)
    root = torch.full((t,), vocab)
    q = torch.empty(t, 2, vocab, dtype=torch.float64)
    q[:, 0] = drafter[root]
    x1 = draw(q[:, 0])
    q[:, 1] = drafter[x1]
    x2 = draw(q[:, 1])
    other = lambda dist, x: dist.scatter(1, x[:, None], -1.0).argmax(1)  # noqa: E731
    s1, s2 = other(q[:, 0], x1), other(q[:, 1], x2)
    r1, r2 = torch.arange(t) % vocab, (torch.arange(t) // vocab) % vocab
    tokens = torch.stack([root, x1, x2, r1, r2, s1, s2], 1)
    parents = torch.tensor([0, 0, 1, 0, 3, 0, 1]).expand(t, -1)
    last = tokens.clone()
    p = table[last]  # [T, 7, V]: after each node, the verifier's distribution given its last token
    return table, p, q, tokens, parents


def test_sampling_over_a_tree_emits_the_verifier_distribution():
    torch.manual_seed(0)
    t, vocab = 200_000, 5
    table, p, q, tokens, parents = _tree_setting(t, vocab, seed=1)
    node, accepted, token = walk_tree(tokens, parents, 2, p=p, q=q)
    kinds = torch.tensor([CHAIN, CHAIN, CHAIN, RETRIEVED, RETRIEVED, SIBLING, SIBLING])[node]
    for kind in (CHAIN, RETRIEVED, SIBLING):  # every kind of path is taken
        assert 0.01 < float(((kinds == kind) & (accepted > 0)).double().mean()) < 0.9
    depths = torch.tensor([0, 1, 2, 1, 2, 1, 2]).expand(t, -1)
    path = tokens.gather(1, path_nodes(ancestor_bits_of(parents, 2), depths, node, 2))
    first = torch.where(accepted > 0, path[:, 0], token)
    after = torch.where(accepted > 1, path[:, 1], torch.where(accepted == 1, token, draw(table[first])))
    joint = (table[vocab][:, None] * table[:vocab]).flatten()
    assert _consistent(first * vocab + after, joint)
    assert float(0.5 * (torch.bincount(first * vocab + after, minlength=vocab * vocab) / t - joint).abs().sum()) < 0.01
    # A plausible bug: after the drafter's draft is rejected, the other children tried one by one with their
    # probability under p instead of under the residual. The same test rejects its first token.
    x, root, y3, y5 = tokens[:, 1], p[:, 0], tokens[:, 3], tokens[:, 5]
    under_p = lambda y: torch.rand(t, dtype=torch.float64) < root.gather(1, y[:, None])[:, 0]  # noqa: E731
    take_x = torch.rand(t, dtype=torch.float64) * q[:, 0].gather(1, x[:, None])[:, 0] < root.gather(1, x[:, None])[:, 0]
    take3 = under_p(y3)
    take5 = ~take3 & under_p(y5)
    rest = (root - q[:, 0]).clamp_min(0).scatter(1, y3[:, None], 0.0).scatter(1, y5[:, None], 0.0) + 1e-12
    wrong = torch.where(take_x, x, torch.where(take3, y3, torch.where(take5, y5, draw(rest))))
    assert not _consistent(wrong, table[vocab])
    assert math.isclose(float(table[vocab].sum()), 1.0)
