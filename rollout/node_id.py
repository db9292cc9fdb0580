"""Which sample, and which path of its tree, a request or an output is: identity as data.

A sample is one of a group's `num_samples` (the group is the id `add_request` was given or made); a
tree rollout's sample splits at each branch step, and its paths are named by the child taken at
each. `str(node_id)` is the form on the wire and in logs, "{group}-{sample}.{child}.{child}";
`NodeId.parse` reads it back where text arrives (an HTTP answer, an abort by id), and nothing else
splits it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class NodeId:
    """Sample `sample` of group `group`, at `branch_path` (the child taken at each branch step so
    far; () for the sample's root). Ordering is by group (as strings), sample, then branch path:
    the leaves of one group sort as the engine returns them."""

    group: str
    sample: int
    branch_path: tuple[int, ...] = ()

    def __post_init__(self):
        if not isinstance(self.group, str) or "." in self.group:
            raise ValueError(f"a NodeId's group is a str without '.' (it separates branches), got {self.group!r}")
        if isinstance(self.sample, bool) or not isinstance(self.sample, int) or self.sample < 0:
            raise ValueError(f"a NodeId's sample is an int >= 0, got {self.sample!r}")
        path = tuple(self.branch_path)
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in path):
            raise ValueError(f"a NodeId's branch_path holds child indices (ints >= 0), got {self.branch_path!r}")
        object.__setattr__(self, "branch_path", path)

    def __str__(self) -> str:
        return f"{self.group}-{self.sample}" + "".join(f".{c}" for c in self.branch_path)

    @classmethod
    def parse(cls, text: str) -> NodeId:
        """The NodeId whose `str` is `text` ("{group}-{sample}" then ".{child}" per branch taken);
        for ids that arrive as text only. ValueError if `text` has not that form."""
        head, *children = text.split(".")
        group, dash, sample = head.rpartition("-")
        if not dash or not _is_index(sample) or not all(_is_index(c) for c in children):
            raise ValueError(
                f"{text!r} is not a sample or branch id; those read '{{group}}-{{sample}}', then "
                "'.{child}' per branch step, e.g. 'req0-1' or 'req0-1.0.2'"
            )
        return cls(group, int(sample), tuple(int(c) for c in children))

    @property
    def depth(self) -> int:
        """Branch steps taken: 0 for a sample's root."""
        return len(self.branch_path)

    @property
    def root(self) -> NodeId:
        """The sample's root (its path before any branch step)."""
        return NodeId(self.group, self.sample)

    @property
    def parent(self) -> NodeId | None:
        """The path it branched from; None for a root."""
        return NodeId(self.group, self.sample, self.branch_path[:-1]) if self.branch_path else None

    @property
    def ancestors(self) -> tuple[NodeId, ...]:
        """The paths it branched from, root first (() for a root)."""
        return tuple(NodeId(self.group, self.sample, self.branch_path[:d]) for d in range(self.depth))

    def child(self, c: int) -> NodeId:
        """Its child `c` at the next branch step."""
        return NodeId(self.group, self.sample, (*self.branch_path, c))

    def descendant(self, suffix: tuple[int, ...]) -> NodeId:
        """The path below it reached by taking the children in `suffix`."""
        return NodeId(self.group, self.sample, self.branch_path + tuple(suffix))

    def is_ancestor_of(self, other: NodeId) -> bool:
        """Whether `other` is a path below this one (not this one itself)."""
        return (
            (other.group, other.sample) == (self.group, self.sample)
            and other.depth > self.depth
            and other.branch_path[: self.depth] == self.branch_path
        )

    def is_descendant_of(self, other: NodeId) -> bool:
        """Whether this is a path below `other` (not `other` itself)."""
        return other.is_ancestor_of(self)


class NamedByNode:
    """The id fields of what a `node_id` names (a request, an output), read from it: one owner."""

    node_id: NodeId

    @functools.cached_property
    def request_id(self) -> str:
        """Its id on the wire, in logs and as the scheduler's key: "{group_id}-{sample_index}",
        then ".{child}" per branch taken (`str(node_id)`, made once)."""
        return str(self.node_id)

    @property
    def group_id(self) -> str:
        return self.node_id.group

    @property
    def sample_index(self) -> int:
        return self.node_id.sample

    @property
    def branch_path(self) -> tuple[int, ...]:
        """The child taken at each branch step so far."""
        return self.node_id.branch_path


def _is_index(text: str) -> bool:
    """Digits as `str(int)` writes them: "01" names no child (its str would be "1")."""
    return text.isascii() and text.isdigit() and (text == "0" or not text.startswith("0"))
