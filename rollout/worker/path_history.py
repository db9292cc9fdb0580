"""What one path of a rollout keeps of its steps, on the worker: the latents x_i and the records
(`SamplingParams.record`) at the positions `record_steps` keeps.

A path that branches seals what it recorded into CPU parts, one per series, that every child
references: a tree's shared prefix is stored once however many leaves it has.

The entries stay on the device while the path runs (a step never waits for a copy); sealing and
`series` queue their copies to pinned host memory without waiting, and the model runner's `finish`
waits once for all of them before any CPU part is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollout.device_copy import to_host
from rollout.sampling_params import SamplingParams
from rollout.step_series import StepSeries


@dataclass
class PathHistory:
    kept_positions: frozenset[int]  # latent chain positions kept (x_i)
    kept_steps: frozenset[int]  # step indices whose records are kept
    records: tuple[str, ...]  # the record series asked for
    # Per series: parts inherited from ancestors as (node id, positions, CPU tensor), then what this
    # path recorded since its last branch as (position, tensor on the device).
    inherited: dict[str, list[tuple[str, list[int], torch.Tensor]]] = field(default_factory=dict)
    pending: dict[str, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)

    @classmethod
    def for_params(cls, params: SamplingParams) -> PathHistory:
        steps = params.num_inference_steps
        kept_steps = range(steps) if params.record_steps is None else params.record_steps
        positions = {steps} | {p for i in kept_steps for p in (i, i + 1)}
        return cls(frozenset(positions), frozenset(kept_steps), params.record)

    def wants(self, name: str) -> bool:
        return name == "latents" or name in self.records

    def add(self, name: str, position: int, entry: torch.Tensor) -> None:
        """Record `entry` of series `name` at `position` if this path keeps it."""
        kept = self.kept_positions if name == "latents" else self.kept_steps
        if self.wants(name) and position in kept:
            self.pending.setdefault(name, []).append((position, entry))

    def seal(self, node_id: str) -> PathHistory:
        """This history with what it recorded since its last branch turned into CPU parts of node
        `node_id` (shared by the children made with `child`)."""
        inherited = {name: list(parts) for name, parts in self.inherited.items()}
        for name, entries in self.pending.items():
            positions = [position for position, _ in entries]
            part = to_host(torch.stack([entry for _, entry in entries]))
            inherited.setdefault(name, []).append((node_id, positions, part))
        return PathHistory(self.kept_positions, self.kept_steps, self.records, inherited)

    def child(self) -> PathHistory:
        """A history for one child of a sealed path: the parts shared, nothing pending."""
        return PathHistory(self.kept_positions, self.kept_steps, self.records, self.inherited)

    def part_nodes(self) -> dict[str, list[str]]:
        """Per series, the node each inherited part belongs to."""
        return {name: [node for node, _, _ in parts] for name, parts in self.inherited.items()}

    def series(self, num_steps: int) -> dict[str, StepSeries]:
        """Every series kept, on CPU in float32: "latents" (num_steps + 1 positions) and the records
        (the copies queued: read them after `device_copy.synchronize`)."""
        series = {}
        for name in ("latents", *self.records):
            positions, parts = [], []
            for _, part_positions, part in self.inherited.get(name, []):
                positions += part_positions
                parts.append(part)
            entries = self.pending.get(name, [])
            if entries:
                positions += [position for position, _ in entries]
                parts.append(to_host(torch.stack([entry for _, entry in entries])))
            length = num_steps + 1 if name == "latents" else num_steps
            series[name] = StepSeries(positions, parts, length)
        return series
