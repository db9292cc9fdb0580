"""The trees of a tree rollout, rebuilt from its leaves, and their advantages (BranchGRPO).

Every output of a branched rollout is one leaf; its `branch_path` says which child it took at each
branch step. `build_tree` rebuilds the nodes: the roots (one per sample of a prompt), the paths
between branch steps, and the leaves, with each node's parent, depth, the steps it ran and the
leaves below it. A node's steps are shared by all those leaves (the engine stored them once), so
a trainer credits them once, to the node, not once per leaf.

`tree_advantages` follows BranchGRPO (Li et al., arXiv 2509.06040): leaf rewards are propagated to
the internal nodes (a node's value is the mean reward of the leaves below it), then normalised
among the nodes of the same prompt and depth. Without branching this is exactly GRPO's group
advantage of each sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rollout import NodeId, RolloutOutput
from trainers_adapters.advantages import group_advantages


@dataclass
class TreeNode:
    """One path segment of a tree: `node` is the engine's id of that path (a root's is its
    sample's, a leaf's its output's `node_id`)."""

    node: NodeId
    prompt_index: int
    parent: int | None  # index of the parent node, None for a root
    steps: range  # the denoising steps this node ran (a leaf's run to the end)
    leaves: list[int] = field(default_factory=list)  # indices of the outputs below it
    value: float = 0.0  # mean reward of those leaves

    @property
    def node_id(self) -> str:
        """Its id's text form, as in logs: "{group}-{sample}", then ".{child}" per branch."""
        return str(self.node)

    @property
    def depth(self) -> int:
        """0 for a root, len(branch_steps) for a leaf."""
        return self.node.depth


@dataclass
class RolloutTree:
    """The nodes of every tree of a rollout (roots first, then by depth), and for each output the
    index of its leaf node."""

    nodes: list[TreeNode]
    leaf_of_output: list[int]
    branch_steps: tuple[int, ...]

    def node_of_step(self, output_index: int, step: int) -> int:
        """The node that ran `step` of output `output_index`'s path."""
        depth = sum(1 for b in self.branch_steps if b <= step)
        node = self.leaf_of_output[output_index]
        while self.nodes[node].depth > depth:
            node = self.nodes[node].parent
        return node


def build_tree(
    outputs: Sequence[RolloutOutput], rewards: torch.Tensor, branch_steps: Sequence[int], num_steps: int
) -> RolloutTree:
    """Rebuild the trees of `outputs` (the leaves of one rollout, any order) with their `rewards`
    [N]; `branch_steps` and `num_steps` are the sampling params'. Aborted leaves are left out by
    the caller; a node's value averages the leaves present."""
    branch_steps = tuple(branch_steps)
    depth_count = len(branch_steps)
    bounds = (0, *branch_steps, num_steps)
    nodes: list[TreeNode] = []
    index_of: dict[NodeId, int] = {}
    leaf_of_output = []
    for output_index, output in enumerate(outputs):
        if len(output.branch_path) != depth_count:
            raise ValueError(
                f"output {output.request_id!r} has branch path {output.branch_path}, but branch_steps "
                f"{branch_steps} make paths of length {depth_count}"
            )
        parent = None
        for depth, node in enumerate((*output.node_id.ancestors, output.node_id)):  # root first
            if node not in index_of:
                index_of[node] = len(nodes)
                steps = range(bounds[depth], bounds[depth + 1])
                nodes.append(TreeNode(node, output.prompt_index, parent, steps))
            parent = index_of[node]
            nodes[parent].leaves.append(output_index)
        leaf_of_output.append(parent)
    rewards = rewards.to(torch.float32).reshape(-1)
    for node in nodes:
        node.value = float(rewards[node.leaves].mean())
    return RolloutTree(nodes, leaf_of_output, branch_steps)


def tree_advantages(
    tree: RolloutTree, *, global_std: bool = False, eps: float = 1e-4, clip_max: float = 5.0
) -> torch.Tensor:
    """Advantages [num_nodes] float32: each node's value normalised among the nodes of its prompt
    and depth (`group_advantages` per depth: the roots of a prompt form its depth-0 group, its
    leaves the deepest). A depth with one node per prompt gets 0: nothing to compare it with."""
    advantages = torch.zeros(len(tree.nodes))
    for depth in range(len(tree.branch_steps) + 1):
        members = [i for i, node in enumerate(tree.nodes) if node.depth == depth]
        values = torch.tensor([tree.nodes[i].value for i in members])
        groups = torch.tensor([tree.nodes[i].prompt_index for i in members])
        advantages[members] = group_advantages(values, groups, global_std=global_std, eps=eps, clip_max=clip_max)
    return advantages
