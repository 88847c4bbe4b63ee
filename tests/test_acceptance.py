import torch

from runtime.engine.acceptance import greedy_accept, rejection_accept, typical_accept
from runtime.engine.sampling import chunked_argmax, greedy_tokens
from runtime.engine.tree import Tree


def tree():
    # 0 -> 1 (a) -> 3 (c)
    #   -> 2 (b) -> 4 (d) -> 5 (e)
    return Tree(torch.tensor([9, 1, 2, 3, 4, 5]), torch.tensor([-1, 0, 0, 1, 2, 4]))


def test_greedy_tokens_are_the_first_largest_logit_in_every_dtype():
    # ties at the top are common in bf16 logits: the first index wins, as torch.argmax (and HF over fp32) picks it
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 3.0, 3.0], [-2.0, -2.0, -2.0, -2.0]])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert greedy_tokens(logits.to(dtype)).tolist() == [1, 0, 0]
        assert greedy_tokens(logits.to(dtype)[0]).item() == 1
    generator = torch.Generator().manual_seed(0)
    wide = (torch.randn(4, 3, 49152, generator=generator) * 3).bfloat16()
    wide[..., 1000] = wide.max(-1, keepdim=True).values[..., 0]  # a tie with the largest, after it or before it
    assert torch.equal(greedy_tokens(wide), wide.argmax(-1))
    assert greedy_tokens(wide).dtype == torch.long and greedy_tokens(wide).shape == (4, 3)


def test_chunked_argmax_is_torch_argmax_with_ties_nans_and_ragged_widths():
    # by hand, chunks of 2: the maximum 5 first appears in chunk 1 (column 3), again in chunk 2
    assert chunked_argmax(torch.tensor([[1.0, 2.0, 0.0, 5.0, 5.0, 4.0, 5.0]]), chunk=2).tolist() == [3]
    assert chunked_argmax(torch.tensor([1.0, float("nan"), 9.0, float("nan")]), chunk=2).item() == 1  # NaN wins
    assert chunked_argmax(torch.full((2, 5), float("-inf")), chunk=2).tolist() == [0, 0]
    generator = torch.Generator().manual_seed(0)
    for shape, chunk in [((6, 49152), 128), ((3, 2, 300), 128), ((4, 129), 128), ((5, 7), 128), ((8, 100), 3)]:
        values = torch.randn(*shape, generator=generator)
        assert torch.equal(chunked_argmax(values, chunk), values.argmax(-1))
        ties = (values * 2).round()  # many equal maxima in a row
        assert torch.equal(chunked_argmax(ties, chunk), ties.argmax(-1))
        assert chunked_argmax(values, chunk).dtype == torch.long


def test_greedy_walks_the_matching_branch_and_adds_the_bonus():
    t = tree()
    argmax = torch.tensor([2, 3, 4, 7, 8, 6])  # root wants 2 (node 2), node 2 wants 4 (node 4), node 4 wants 8
    path, bonus = greedy_accept(t.tokens, t.parents, t.ancestor_mask(), argmax)
    assert path == [0, 2, 4] and bonus == 8


def test_greedy_rejects_everything():
    t = tree()
    path, bonus = greedy_accept(t.tokens, t.parents, t.ancestor_mask(), torch.tensor([6, 0, 0, 0, 0, 0]))
    assert path == [0] and bonus == 6


def test_greedy_full_path_takes_bonus_from_the_leaf():
    t = tree()
    path, bonus = greedy_accept(t.tokens, t.parents, t.ancestor_mask(), torch.tensor([2, 0, 4, 0, 5, 11]))
    assert path == [0, 2, 4, 5] and bonus == 11


def exact_first_token_distribution(p, children_tokens, q=None, samples=20000, seed=0):
    """Empirical distribution of the first emitted token for a root with the given children."""
    vocab = p.numel()
    tokens = torch.tensor([0] + children_tokens)
    kids = [list(range(1, len(tokens)))] + [[] for _ in children_tokens]
    target = torch.stack([p] + [p] * len(children_tokens))
    proposal = None if q is None else torch.stack([q] + [torch.zeros_like(q)] * len(children_tokens))
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(vocab)
    for _ in range(samples):
        path, bonus = rejection_accept(tokens, kids, target, proposal, generator)
        counts[tokens[path[1]] if len(path) > 1 else bonus] += 1
    return counts / samples


def test_rejection_with_deterministic_children_preserves_p():
    p = torch.tensor([0.1, 0.4, 0.3, 0.2])
    empirical = exact_first_token_distribution(p, [1, 2])
    assert torch.allclose(empirical, p, atol=0.015)


def test_rejection_with_sampled_children_preserves_p():
    p = torch.tensor([0.1, 0.4, 0.3, 0.2])
    q = torch.tensor([0.5, 0.1, 0.2, 0.2])
    # children drawn i.i.d. from q: average over every possible pair of draws, weighted by its probability
    total = torch.zeros(4)
    for first in range(4):
        for second in range(4):
            weight = q[first] * q[second]
            total += weight * exact_first_token_distribution(p, [first, second], q, samples=3000,
                                                             seed=first * 4 + second)
    assert torch.allclose(total, p, atol=0.015)


def test_typical_acceptance_accepts_likely_children_only():
    p = torch.tensor([0.7, 0.2, 0.05, 0.05])
    tokens = torch.tensor([0, 2, 1])
    kids = [[1, 2], [], []]
    target = torch.stack([p, p, p])
    path, _ = typical_accept(tokens, kids, target, torch.Generator().manual_seed(0))
    assert path == [0, 2]  # token 2 (p = 0.05) is below the threshold, token 1 (0.2) passes
