"""Acceptance: how many of a round's drafts the verifier keeps. Greedy (:func:`accepted_length`: the leading drafts
equal to the verifier's argmaxes) and speculative sampling (:func:`accept_or_resample`: Leviathan et al. 2023, each
emitted token distributed exactly as the verifier's processed distribution; see :mod:`.sampling`); for a round that
verifies two branches from one root (:mod:`.draft_tree`), :func:`accept_two_chains` and
:func:`accept_or_resample_two_chains` (SpecInfer's recursive rejection over siblings). All run on the device without
a host sync, inside the engine's captured verify step and on the host-side path alike."""

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


def accept_two_chains(verified: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance over two branches from one root: ``verified [B, 2, γ+1]`` the verifier's argmaxes along each
    branch (after the root and after each of its drafts), ``drafts [B, 2, γ]`` the branches' drafts (0: the
    drafter's, 1: the retrieved). Returns ``(accepted [B], tokens [B, γ+1], second [B] bool)``: the longer accepted
    branch (the first on a tie), its argmaxes, and whether it is the second. Each branch's argmaxes are greedy
    decoding's tokens after its own prefix, so whichever is kept, the tokens are greedy's."""
    lengths = torch.stack([accepted_length(drafts[:, k], verified[:, k]) for k in range(2)], 1)  # [B, 2]
    second = lengths[:, 1] > lengths[:, 0]
    return lengths.amax(1), torch.where(second[:, None], verified[:, 1], verified[:, 0]), second


def accept_or_resample_two_chains(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    """Speculative sampling over two branches from one root (SpecInfer / SpecTr's recursive rejection), ``T`` trials.

    ``p [T, 2, k+1, V]``: the verifier's probabilities along each branch (``p[:, b, i]`` after the root and branch
    b's first i drafts; ``p[:, 0, 0] == p[:, 1, 0]``, and equal prefixes give equal rows); ``q [T, k, V]``: the
    drafter's probabilities of branch 0's drafts; branch 1's drafts are a function of the sequence (retrieval: a
    one-hot proposal). ``drafts [T, 2, k]``.

    At each depth the candidates are the children of the node reached: branch 0's draft (while the path is on branch
    0) is accepted with probability ``min(1, p(x) / q(x))``; if not, the distribution becomes the residual
    ``r = norm(max(p - q, 0))`` and branch 1's draft (while the path is on branch 1 and its draft differs) is
    accepted with probability ``r(y)``; if neither is, the token is drawn from ``r`` without ``y`` and the round ends.
    Each emitted token is then distributed exactly as ``p`` after the tokens before it. Returns ``(accepted [T],
    token [T], second [T] bool)``: the accepted drafts, the token drawn after them, and whether the path kept is
    branch 1's alone (the drafts emitted are then ``drafts[:, 1, :accepted]``)."""
    t, _, k = drafts.shape
    on = torch.ones(t, 2, dtype=torch.bool, device=p.device)  # the branches the path so far lies on
    alive = torch.ones(t, dtype=torch.bool, device=p.device)
    accepted = torch.zeros(t, dtype=torch.long, device=p.device)
    token = torch.zeros(t, dtype=torch.long, device=p.device)
    for i in range(k + 1):
        target = torch.where(on[:, :1], p[:, 0, i], p[:, 1, i])  # the node's distribution (equal on both branches)
        if i == k:  # every draft on the path accepted: the bonus token
            token = torch.where(alive, draw(target), token)
            break
        x, y = drafts[:, 0, i], drafts[:, 1, i]
        take_x = on[:, 0] & (torch.rand(t, device=p.device, dtype=p.dtype) * q[:, i].gather(1, x[:, None])[:, 0]
                             < target.gather(1, x[:, None])[:, 0])
        residual = torch.where(on[:, :1], (target - q[:, i]).clamp_min(0), target)
        residual = residual / residual.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
        try_y = on[:, 1] & ~(on[:, 0] & (y == x))  # a sibling equal to x was x's chance already
        take_y = ~take_x & try_y & (torch.rand(t, device=p.device, dtype=p.dtype)
                                    < residual.gather(1, y[:, None])[:, 0])
        rest = torch.where(try_y[:, None], residual.scatter(1, y[:, None], 0.0), residual)
        ends = alive & ~take_x & ~take_y
        token = torch.where(ends, draw(rest), token)
        moved = alive & (take_x | take_y)
        accepted += moved.long()
        on = torch.where(moved[:, None], torch.stack([take_x, (take_x & on[:, 1] & (y == x)) | take_y], 1), on)
        alive = moved
    return accepted, token, on[:, 1] & ~on[:, 0]
