"""Acceptance rules: which root-to-node path of a verified tree is kept, and which token the target adds.

Every rule returns ``(path, bonus)``: path is the list of accepted node indices starting with the root (0),
bonus is the token the target emits after the last accepted node. Emitted tokens = tokens[path[1:]] + [bonus].

- ``greedy_accept``: exact for temperature 0 (equals plain greedy decoding token for token).
- ``rejection_accept``: lossless tree rejection sampling; output is distributed exactly as the target's.
- ``typical_accept``: Medusa's typical acceptance; lossy, opt-in only.
"""

from __future__ import annotations

import math

import torch

from runtime.engine.sampling import sample


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, ancestor_mask: torch.Tensor,
                  target_argmax: torch.Tensor) -> tuple[list[int], int]:
    """tokens, parents, target_argmax: [N]; ancestor_mask [N, N]. A node is accepted iff every node on its root
    path (itself included) carries the target's argmax at its parent. The deepest accepted node wins; with a
    deterministic target at most one child per node matches, so the accepted nodes form one path.
    """
    if tokens.numel() == 1:  # a lone root (plain decoding): nothing to match, the root's argmax is the bonus
        return [0], int(target_argmax[0])
    matches = tokens == target_argmax[parents.clamp_min(0)]
    matches[0] = True
    accepted = ~(ancestor_mask & ~matches[None, :]).any(dim=1)  # [N]
    depth = ancestor_mask.sum(dim=1)
    deepest = int(torch.where(accepted, depth, -1).argmax())
    path = ancestor_mask[deepest].nonzero().flatten().tolist()
    return path, int(target_argmax[deepest])


def rejection_accept(tokens: torch.Tensor, children: list[list[int]], target_probs: torch.Tensor,
                     proposal_probs: torch.Tensor | None, generator: torch.Generator | None) -> tuple[list[int], int]:
    """Lossless tree rejection sampling (SpecInfer-style multi-draft speculative sampling).

    target_probs [N, V]: processed target distributions at each node. proposal_probs [N, V] or None: the draft
    distribution node i's children were sampled from (None: children are deterministic picks).
    At node n with children tried in order: a sampled child x is accepted with min(1, p(x)/q(x)), and on
    rejection p <- normalize(max(0, p - q)); a deterministic child is accepted with p(x), and on rejection
    p(x) <- 0 and p is renormalized. If every child is rejected the bonus is drawn from the current p.
    """
    path = [0]
    node = 0
    token_list = tokens.tolist()
    while True:
        p = target_probs[node]
        q = None if proposal_probs is None else proposal_probs[node]
        next_node = None
        for child in children[node]:
            x = token_list[child]
            u = float(torch.rand((), generator=generator))
            if q is not None:
                ratio = float(p[x]) / max(float(q[x]), 1e-30)
                if u < ratio:
                    next_node = child
                    break
                residual = (p - q).clamp_min(0)
                mass = float(residual.sum())
                p = residual / mass if mass > 0 else p
            else:
                px = float(p[x])
                if u < px:
                    next_node = child
                    break
                p = p.clone()
                p[x] = 0.0
                mass = float(p.sum())
                if mass <= 0:  # every token with mass was proposed and rejected: impossible unless px == 1
                    break
                p = p / mass
        if next_node is None:
            return path, sample(p, generator)
        path.append(next_node)
        node = next_node


def typical_accept(tokens: torch.Tensor, children: list[list[int]], target_probs: torch.Tensor,
                   generator: torch.Generator | None, epsilon: float = 0.09,
                   delta: float = 0.3) -> tuple[list[int], int]:
    """Medusa typical acceptance (lossy): accept child x when p(x) > min(epsilon, delta * exp(-H(p))).

    target_probs [N, V]. The first qualifying child (in proposal order) is followed; the bonus is sampled from p
    at the last accepted node.
    """
    path = [0]
    node = 0
    token_list = tokens.tolist()
    while True:
        p = target_probs[node]
        entropy = float(-(p * torch.log(p.clamp_min(1e-30))).sum())
        threshold = min(epsilon, delta * math.exp(-entropy))
        next_node = next((c for c in children[node] if float(p[token_list[c]]) > threshold), None)
        if next_node is None:
            return path, sample(p, generator)
        path.append(next_node)
        node = next_node
