"""One tensor per shared prefix of a tree rollout, however its leaves reached the engine.

The leaves of one branch share the history recorded before it split (`PathHistory.seal`), but they
finish in different steps (and cross processes with `mp` and `ray`), so each would arrive with its
own copy. `SharedTreeParts` maps every arriving copy to the first one alive for the same tree, node
and series, as `SharedConditions` does for text embeddings. Entries live as long as an output
references them.
"""

from __future__ import annotations

import weakref

import torch

from rollout.outputs import Trajectory


class SharedTreeParts:
    def __init__(self):
        self._alive: weakref.WeakValueDictionary[tuple, torch.Tensor] = weakref.WeakValueDictionary()

    def share(self, tree_id: int, trajectory: Trajectory, part_nodes: dict[str, list[str]]) -> None:
        """Replace the inherited parts of `trajectory` (the node of each, per series, in
        `part_nodes`) by the shared ones."""
        for name, nodes in part_nodes.items():
            series = trajectory.latents if name == "latents" else trajectory.records[name]
            parts = list(series.parts)
            for index, node in enumerate(nodes):
                parts[index] = self._alive.setdefault((tree_id, node, name), parts[index])
            series.parts = tuple(parts)
