import torch

from runtime.engine.tree import Tree, keep_best_nodes, select_frontier, verification_mask


def hand_tree():
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    #   |
    #   6
    return Tree(torch.tensor([10, 11, 12, 13, 14, 15, 16]), torch.tensor([-1, 0, 0, 1, 1, 2, 3]))


def test_mask_positions_paths_on_hand_built_tree():
    tree = hand_tree()
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask(), expected)
    assert tree.position_ids(5).tolist() == [5, 6, 6, 7, 7, 7, 8]
    assert sorted(tree.paths()) == sorted([[0, 1, 3, 6], [0, 1, 4], [0, 2, 5]])
    assert tree.children() == [[1, 2], [3, 4], [5], [6], [], [], []]
    assert tree.max_depth == 3


def test_verification_mask_sees_whole_prefix():
    tree = hand_tree()
    mask = verification_mask(tree.ancestor_mask(), 3)
    assert mask.shape == (1, 1, 7, 10)
    assert mask[0, 0, :, :3].all()
    assert torch.equal(mask[0, 0, :, 3:], tree.ancestor_mask())


def test_bad_order_is_refused():
    try:
        Tree(torch.tensor([1, 2, 3]), torch.tensor([-1, 2, 0]))
    except ValueError as error:
        assert "parent-before-child" in str(error)
    else:
        raise AssertionError("a child before its parent must be refused")


def test_trie_from_sequences_merges_prefixes_and_respects_the_tree_size():
    tree = Tree.from_sequences(7, [[1, 2, 3], [1, 2, 4], [5]], max_nodes=10)
    assert tree.tokens.tolist() == [7, 1, 2, 3, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 2, 0]
    small = Tree.from_sequences(7, [[1, 2, 3], [5, 6]], max_nodes=4)
    assert small.tokens.tolist() == [7, 1, 2, 3]


def test_static_tree_from_choices():
    candidates = torch.tensor([[100, 101, 102], [200, 201, 202]])
    tree = Tree.from_choices(9, [[0], [1], [0, 0], [0, 1], [2, 0]], candidates)
    # the missing prefix [2] is added; order is by depth then rank
    assert tree.tokens.tolist() == [9, 100, 101, 102, 200, 201, 200]
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 1, 3]


def test_chain():
    tree = Tree.chain(4, [5, 6])
    assert tree.parents.tolist() == [-1, 0, 1]
    assert tree.paths() == [[0, 1, 2]]


def test_select_frontier_takes_global_top_k_by_cumulative_score():
    parent_scores = torch.tensor([-0.1, -2.0])
    child = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.9, 0.05, 0.05]]))
    parents, tokens, scores = select_frontier(parent_scores, child, top_k=3)
    assert parents.tolist() == [0, 0, 0]
    assert tokens.tolist() == [0, 1, 2]
    expected = -0.1 + torch.log(torch.tensor([0.5, 0.3, 0.2]))
    assert torch.allclose(scores, expected, atol=1e-6)
    # with a stronger second parent, its best child displaces the weaker children of the first
    parents, tokens, _ = select_frontier(torch.tensor([-0.1, -0.2]), child, top_k=2)
    assert parents.tolist() == [1, 0] and tokens.tolist() == [0, 0]


def test_keep_best_nodes_is_ancestor_closed():
    scores = torch.tensor([-1.0, -0.5, -3.0, -0.6, -0.7])
    parents = torch.tensor([-1, -1, 0, 1, 3])
    assert keep_best_nodes(scores, parents, 3).tolist() == [1, 3, 4]
    # a tie-break that would orphan node 2 pulls in its parent
    scores = torch.tensor([-1.0, -0.5, -0.4])
    parents = torch.tensor([-1, -1, 0])
    kept = keep_best_nodes(scores, parents, 2).tolist()
    assert kept == [0, 1, 2]
