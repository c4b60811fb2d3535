"""Acceptance: how many of a round's drafts the verifier keeps. Greedy (:func:`accepted_length`: the leading drafts
equal to the verifier's argmaxes) and speculative sampling (:func:`accept_or_resample`: Leviathan et al. 2023, each
emitted token distributed exactly as the verifier's processed distribution; see :mod:`.sampling`); for a round that
verifies a tree (:mod:`.draft_tree`), :func:`walk_tree` (greedy, and SpecInfer's recursive rejection over siblings).
All run on the device without a host sync, inside the engine's captured verify step and on the host-side path alike."""

from __future__ import annotations

import torch

from .sampling import draw


def accepted_length(drafts: torch.Tensor, verified: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance on the device, per row: the number of leading ``drafts [B, γ]`` equal to the verifier's
    argmaxes ``verified [B, γ+1]`` (``verified[:, i]`` is the verifier's token after draft i-1), ``[B]`` int64."""
    return (verified[:, : drafts.shape[1]] == drafts).long().cumprod(1).sum(1)


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One speculative-sampling round over ``T`` independent trials (``T = 1`` in generation).

    ``p [T, k+1, V]``: the verifier's probabilities after each prefix (``p[:, i]`` follows draft ``i - 1``);
    ``q [T, k, V]``: the drafter's probabilities the drafts ``drafts [T, k]`` were drawn from.
    Returns ``(accepted [T], token [T])``: the number of leading drafts accepted and the token drawn after them
    (from the residual at the first rejection, from ``p[:, k]`` when all are accepted)."""
    t, k = drafts.shape
    if k:
        p_x = p[:, :k].gather(-1, drafts[..., None])[..., 0]
        q_x = q.gather(-1, drafts[..., None])[..., 0]
        rejected = torch.rand(t, k, device=p.device, dtype=p.dtype) * q_x >= p_x  # u >= p/q, without dividing
        accepted = torch.where(rejected.any(-1), rejected.long().argmax(-1), k)  # first rejection, else all k
    else:
        accepted = torch.zeros(t, dtype=torch.long, device=p.device)
    rows = torch.arange(t, device=p.device)
    target = p[rows, accepted]
    q_pad = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1)  # no draft after the last: residual = p itself
    residual = (target - q_pad[rows, accepted]).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), target)
    return accepted, draw(residual)


def walk_tree(tokens: torch.Tensor, parents: torch.Tensor, gamma: int, targets: torch.Tensor | None = None,
              p: torch.Tensor | None = None, q: torch.Tensor | None = None) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    """Acceptance over a tree of drafts (:mod:`.draft_tree`), ``T`` rows: ``tokens [T, L]`` the nodes' tokens and
    ``parents [T, L]`` their parents (node 0 the root; nodes ``1..γ`` the drafter's chain, node i's chain child i+1;
    every parent before its child). Greedy: ``targets [T, L]`` the verifier's token after each node. Sampling: ``p
    [T, L, V]`` its processed distribution after each node and ``q [T, γ, V]`` the drafter's distributions the chain
    was drawn from (``q[:, d]`` after chain node d).

    From the root, at each node reached: greedy, the child whose token is the verifier's (the first such), else the
    round ends with that token. Sampling (SpecInfer / SpecTr's recursive rejection over the siblings): the chain
    child x, drawn from q, is accepted with probability ``min(1, p(x) / q(x))``; if not (or off the chain), a token z
    is drawn from the residual ``r = norm(max(p - q, 0))`` (p itself off the chain), and the walk moves to the child
    whose token is z, or the round ends with z. Trying the other children one by one as one-hot proposals against r
    (accept y with probability r(y), else go on with r without y) picks each child with probability r(its token) and
    otherwise draws from what is left of r: the single draw of z is that procedure. So each emitted token is
    distributed exactly as p after the tokens before it, whichever children the tree holds.

    Returns ``(node [T], accepted [T], token [T])``: the last node kept (its depth the accepted drafts), and the
    token after it."""
    t, length = tokens.shape
    device = tokens.device
    index = torch.arange(length, device=device)
    rows = torch.arange(t, device=device)
    node = torch.zeros(t, dtype=torch.long, device=device)
    accepted = torch.zeros(t, dtype=torch.long, device=device)
    token = torch.zeros(t, dtype=torch.long, device=device)
    alive = torch.ones(t, dtype=torch.bool, device=device)
    for _ in range(gamma + 1):  # a path holds at most γ drafts: the last pass always ends the walk
        children = (parents == node[:, None]) & (index != 0)
        chain_child = (node + 1).clamp_max(gamma)
        if p is None:
            z = targets.gather(1, node[:, None])[:, 0]
            take_x = torch.zeros_like(alive)
        else:
            dist = p[rows, node]  # [T, V]
            on_chain = node < gamma  # the root or a chain node with a chain child
            qd = q[rows, node.clamp_max(gamma - 1)]
            x = tokens.gather(1, chain_child[:, None])
            take_x = on_chain & (torch.rand(t, device=device, dtype=p.dtype) * qd.gather(1, x)[:, 0]
                                 < dist.gather(1, x)[:, 0])
            residual = torch.where(on_chain[:, None], (dist - qd).clamp_min(0), dist)
            mass = residual.sum(-1, keepdim=True)
            residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), dist)
            z = draw(residual)
            children &= ~(on_chain[:, None] & (index == chain_child[:, None]))  # x had its chance
        match = children & (tokens == z[:, None])
        moved = alive & (take_x | match.any(1))
        token = torch.where(alive & ~moved, z, token)
        node = torch.where(moved, torch.where(take_x, chain_child, match.long().argmax(1)), node)
        accepted += moved.long()
        alive = moved
    return node, accepted, token
