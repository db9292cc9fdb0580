"""A request as the engine and scheduler see it, and the small record sent to a worker for it."""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import time
from dataclasses import dataclass, field

from rollout.input_images import InputImages
from rollout.messages import NewRequestData
from rollout.node_id import NamedByNode, NodeId
from rollout.sampling_params import SamplingParams
from rollout.seeding import derive_seed


def step_stream(branch_path: tuple[int, ...]) -> str:
    """The seed stream of a path's step noise: "step" for a root, one more name per branch taken."""
    return "step" + "".join(f"/{c}" for c in branch_path)


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, no worker holds its state yet
    RUNNING = "running"  # admitted to a rank; that worker holds its state once first scheduled
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class Request(NamedByNode):
    """One sample of one prompt (a GRPO group of n samples is n requests), or one path of a tree
    rollout: a request that reaches a branch step is replaced by its children (`node_id.child(c)`)."""

    node_id: NodeId  # its group (the id add_request was given or made), sample index and branch path
    prompt: str
    prompt_index: int
    params: SamplingParams  # resolved against the model
    seed: int  # this path's step-noise seed, reported in its output
    init_noise_seed: int
    base_seed: int  # what the seeds derive from (children's too)
    tree_id: int  # unique per root in the engine's life, shared by its children
    images: InputImages | None = None  # an edit's input images (the pipeline's `image=`)
    # The (height, width) its images are encoded at (`ModelSpec.encoded_image_sizes`; empty for a
    # text-only request): what it batches by, since encodings of equal sizes stack.
    encoded_image_sizes: tuple[tuple[int, int], ...] = ()
    # The most samples of its size a batch may hold for each unit of work to fit within the step
    # timeout (`rollout.engine.work_budget`); the scheduler keeps every batch to it.
    max_batch: int = 1 << 30
    pruned: set[NodeId] = field(default_factory=set)  # its descendants aborted before they existed
    status: RequestStatus = RequestStatus.WAITING
    rank: int | None = None
    sent_to_worker: bool = False
    steps_done: int = 0
    step_versions: list[int] = field(default_factory=list)  # the weight version of each step it ran
    encoder_generation: int = 0  # the engine's weights generation when its text was encoded
    last_scheduled_tick: int = -1
    arrival_time: float = field(default_factory=time.monotonic)
    first_step_time: float | None = None

    @functools.cached_property
    def ancestors(self) -> tuple[str, ...]:
        """Ids of the paths it branched from, root first (the scheduler indexes requests by them)."""
        return tuple(str(ancestor) for ancestor in self.node_id.ancestors) if self.node_id.branch_path else ()

    def note_step_version(self, version: int) -> None:
        """Called once per denoising step it is scheduled for, with the weights that step runs on."""
        self.step_versions.append(version)

    @property
    def weight_versions(self) -> tuple[int, ...]:
        """The distinct versions its steps used, in order."""
        return tuple(v for i, v in enumerate(self.step_versions) if i == 0 or self.step_versions[i - 1] != v)

    @property
    def branches_now(self) -> bool:
        """Whether its next step is a branch step: it splits before that step runs."""
        steps = self.params.branch_steps
        depth = len(self.branch_path)
        return depth < len(steps) and steps[depth] == self.steps_done

    @property
    def slots(self) -> int:
        """Paths it will have at its widest (its leaves): what admission reserves for it."""
        return self.params.branch_factor ** (len(self.params.branch_steps) - len(self.branch_path))

    @property
    def num_leaves(self) -> int:
        """Leaves it will yield (without the pruned ones)."""
        return len(self.leaves()) if self.pruned else self.slots

    def leaf_seed(self, branch_path: tuple[int, ...]) -> int:
        """The step-noise seed of its descendant (or itself) at `branch_path`."""
        if branch_path == self.branch_path:
            return self.seed
        return derive_seed(self.base_seed, self.prompt_index, self.sample_index, step_stream(branch_path))

    def leaves(self) -> list[NodeId]:
        """The leaves it will yield, in path order, without the pruned ones."""
        remaining = len(self.params.branch_steps) - len(self.branch_path)
        if not remaining:  # a leaf already (most requests: no tree)
            return [self.node_id]
        found = []
        for suffix in itertools.product(range(self.params.branch_factor), repeat=remaining):
            leaf = self.node_id.descendant(suffix)
            if not any(leaf == p or p.is_ancestor_of(leaf) for p in self.pruned):
                found.append(leaf)
        return found

    def has_descendant(self, node_id: NodeId) -> bool:
        """Whether `node_id` is one of its (future) branches or leaves."""
        return (
            self.node_id.is_ancestor_of(node_id)
            and node_id.depth <= len(self.params.branch_steps)
            and all(c < self.params.branch_factor for c in node_id.branch_path)
        )

    def children(self) -> list[Request]:
        """Its children at this branch step, each with its own step-noise seed (the pruned left out)."""
        made = []
        for c in range(self.params.branch_factor):
            child = self.node_id.child(c)
            if child in self.pruned:
                continue
            made.append(
                dataclasses.replace(
                    self,
                    node_id=child,
                    seed=self.leaf_seed(child.branch_path),
                    pruned={p for p in self.pruned if child.is_ancestor_of(p)},
                    step_versions=list(self.step_versions),
                )
            )
        return made

    @property
    def batch_key(self) -> tuple:
        """Requests with equal keys can share one forward pass (same latent and text shapes, same
        adapter, input images encoded at the same sizes, whatever their own: their tokens stack)."""
        p = self.params
        return (p.height, p.width, p.num_frames, p.max_sequence_length, p.lora, p.lora_scale, self.encoded_image_sizes)

    def new_request_data(self) -> NewRequestData:
        return NewRequestData(
            request_id=self.request_id,
            prompt=self.prompt,
            params=self.params,
            init_noise_seed=self.init_noise_seed,
            step_noise_seed=self.seed,
            images=self.images,
        )
