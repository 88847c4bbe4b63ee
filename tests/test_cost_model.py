"""Tree sizing from a cost curve, on hand-built curves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from runtime.cost_model import best_tree_size, choose_tree_size, expected_tokens


def test_expected_tokens_by_hand():
    assert expected_tokens(1, 0.5) == 1
    assert expected_tokens(3, 0.5) == pytest.approx(1.75)


def test_best_tree_size_by_hand():
    curve = {1: 1.0, 2: 1.25, 4: 1.3, 8: 1.9}
    # per unit cost at acceptance 0.5: 1.0, 1.2, 1.44, 1.05
    assert best_tree_size(curve, 0.5) == 4
    # at 0.1 nothing beats plain decoding: 1.0, 0.88, 0.85, 0.58
    assert best_tree_size(curve, 0.1) == 1


def test_a_measured_tree_size_wins_over_the_cost_model():
    tuned = SimpleNamespace(tree_size=4, expected_acceptance=0.3)
    assert choose_tree_size(None, tuned) == 4  # no target needed: the cost curve is not consulted
    assert choose_tree_size(None, SimpleNamespace(tree_size=None, expected_acceptance=0.0)) == 1


def test_every_proposer_states_its_tree_size_or_leaves_it_to_the_cost_model():
    from runtime.proposers import DraftModelProposer, NgramProposer, NoProposer
    from runtime.proposers.eagle import EagleProposer
    from runtime.proposers.medusa import MedusaProposer

    assert NoProposer.tree_size == 1
    assert NgramProposer.tree_size is None and DraftModelProposer.tree_size is None
    for cls in (EagleProposer, MedusaProposer):  # per instance, from the head's config
        assert "tree_size" in cls.__init__.__code__.co_varnames
