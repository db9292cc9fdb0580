"""Replica groups: which worker ranks run one replica's batches together.

`num_workers` ranks form `num_replicas` groups of `ranks_per_replica` consecutive ranks (group g
holds ranks g*R .. g*R+R-1). The scheduler balances batches over replicas; every rank of a group
gets the same `WorkerInput` (same requests, same per-sample generators), so a sample's noise and
result do not depend on the layout, and the group's first rank hands back the outputs.

Each group is its own `torch.distributed` world, met at a `FileStore` in a folder the executor makes
(`GroupRendezvous`); on Ray a group's ranks share one placement-group bundle, hence one node and
one file system.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass

from rollout.config import EngineConfig
from rollout.parallel.sequence import GroupMember


@dataclass(frozen=True)
class ReplicaLayout:
    num_replicas: int
    ranks_per_replica: int

    @classmethod
    def of(cls, config: EngineConfig) -> ReplicaLayout:
        return cls(config.num_replicas, config.ranks_per_replica)

    def ranks_of(self, replica: int) -> range:
        """The ranks of group `replica`, leader (the rank that replies) first."""
        return range(replica * self.ranks_per_replica, (replica + 1) * self.ranks_per_replica)

    def leader_of(self, replica: int) -> int:
        return replica * self.ranks_per_replica

    def replica_of(self, rank: int) -> int:
        return rank // self.ranks_per_replica


@dataclass(frozen=True)
class GroupRendezvous:
    """Where the ranks of each group meet: a fresh folder with one store file per group, removed
    with the executor. None of it exists for replicas of one rank."""

    folder: str
    layout: ReplicaLayout
    timeout_s: float

    @classmethod
    def make(cls, config: EngineConfig) -> GroupRendezvous | None:
        if config.ranks_per_replica == 1:
            return None
        folder = tempfile.mkdtemp(prefix="rollout-replica-groups-")
        # Joining waits for the slowest rank's model load; collectives wait at most a step.
        return cls(folder, ReplicaLayout.of(config), max(config.startup_timeout_s, config.step_timeout_s))

    def member(self, rank: int) -> GroupMember:
        replica = self.layout.replica_of(rank)
        return GroupMember(
            store_path=f"{self.folder}/group-{replica}",
            group=replica,
            local_rank=rank - self.layout.leader_of(replica),
            size=self.layout.ranks_per_replica,
            timeout_s=self.timeout_s,
        )

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
