"""Proposers that exist only to stress the verifier: a bad one and a random one."""

from __future__ import annotations

import torch

from runtime.proposers.base import Proposer, ProposeInput
from runtime.engine.tree import Tree


class BadProposer(Proposer):
    """Always proposes the same wrong-looking chain."""

    name = "bad"
    expected_acceptance = 0.5

    def propose(self, state, step: ProposeInput) -> Tree:
        return Tree.chain(int(step.history[-1]), [3] * (step.tree_size - 1), device=step.history.device)


class RandomProposer(Proposer):
    """A random tree shape with random tokens (siblings may repeat tokens), from its own seeded generator."""

    name = "random"
    expected_acceptance = 0.5

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, state, step: ProposeInput) -> Tree:
        size = int(torch.randint(1, step.tree_size + 1, (), generator=self.generator))
        parents = [-1] + [int(torch.randint(0, i, (), generator=self.generator)) for i in range(1, size)]
        tokens = torch.randint(0, self.vocab_size, (size,), generator=self.generator)
        tokens[0] = step.history[-1]
        return Tree(tokens, torch.tensor(parents))
