"""Rebuilding the trees of a branched rollout from its leaves, and BranchGRPO's advantages."""

from __future__ import annotations

import itertools

import pytest
import torch

from rollout import NodeId, RolloutOutput
from trainers_adapters.advantages import group_advantages
from trainers_adapters.grpo.tree import build_tree, tree_advantages

pytestmark = pytest.mark.timeout(30)


def leaves(prompts: int, roots: int, factor: int, depth: int) -> list[RolloutOutput]:
    return [
        RolloutOutput(node_id=NodeId(f"g{p}", k, path), prompt="x", prompt_index=p, seed=0)
        for p in range(prompts)
        for k in range(roots)
        for path in itertools.product(range(factor), repeat=depth)
    ]


def test_nodes_parents_steps_and_values():
    outputs = leaves(prompts=1, roots=2, factor=2, depth=2)
    rewards = torch.arange(8, dtype=torch.float32)  # leaf rewards 0..7
    tree = build_tree(outputs, rewards, branch_steps=(1, 3), num_steps=5)
    by_id = {node.node_id: node for node in tree.nodes}
    assert len(tree.nodes) == 2 + 4 + 8
    root, branch, leaf = by_id["g0-1"], by_id["g0-1.0"], by_id["g0-1.0.1"]
    assert (root.depth, root.parent, root.steps) == (0, None, range(0, 1))
    assert (branch.depth, tree.nodes[branch.parent] is root, branch.steps) == (1, True, range(1, 3))
    assert (leaf.depth, tree.nodes[leaf.parent] is branch, leaf.steps, leaf.leaves) == (2, True, range(3, 5), [5])
    assert root.value == pytest.approx(5.5) and branch.value == pytest.approx(4.5) and leaf.value == 5
    assert [tree.nodes[tree.node_of_step(5, s)].node_id for s in range(5)] == [
        "g0-1",
        "g0-1.0",
        "g0-1.0",
        "g0-1.0.1",
        "g0-1.0.1",
    ]


def test_advantages_are_normalised_per_prompt_and_depth():
    outputs = leaves(prompts=2, roots=2, factor=2, depth=1)
    rewards = torch.tensor([1.0, 3.0, 5.0, 7.0, 0.0, 0.0, 2.0, 2.0])
    tree = build_tree(outputs, rewards, branch_steps=(2,), num_steps=4)
    advantages = tree_advantages(tree)
    by_id = {node.node_id: a for node, a in zip(tree.nodes, advantages.tolist(), strict=True)}
    # Depth 0: the roots of prompt 0 have values 2 and 6 -> -1, +1; prompt 1's: 0 and 2 -> -1, +1.
    assert [round(by_id[i], 3) for i in ("g0-0", "g0-1", "g1-0", "g1-1")] == [-1.0, 1.0, -1.0, 1.0]
    # Depth 1: the four leaves of prompt 0 against each other (mean 4, std sqrt(5)).
    assert by_id["g0-0.0"] == pytest.approx(-3 / 5**0.5, abs=1e-3)
    assert by_id["g1-0.0"] == pytest.approx(-1.0, abs=1e-3)


def test_without_branching_it_is_the_group_advantage():
    outputs = leaves(prompts=3, roots=4, factor=1, depth=0)
    rewards = torch.randn(12, generator=torch.Generator().manual_seed(0))
    tree = build_tree(outputs, rewards, branch_steps=(), num_steps=4)
    groups = torch.tensor([o.prompt_index for o in outputs])
    assert torch.allclose(tree_advantages(tree), group_advantages(rewards, groups))


def test_a_root_alone_at_its_depth_gets_no_credit():
    tree = build_tree(leaves(prompts=1, roots=1, factor=4, depth=1), torch.arange(4.0), branch_steps=(2,), num_steps=4)
    advantages = tree_advantages(tree)
    assert advantages[0] == 0 and advantages[1:].abs().sum() > 0


def test_paths_of_the_wrong_length_are_refused():
    with pytest.raises(
        ValueError, match=r"output .g0-0.0.0. has branch path \(0, 0\), but branch_steps \(2,\) make paths of length 1"
    ):
        build_tree(leaves(1, 1, 2, 2), torch.zeros(4), branch_steps=(2,), num_steps=4)
