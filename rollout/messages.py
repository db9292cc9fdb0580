"""The messages of an engine step, which the scheduler, the executors and the workers all import.

The engine sends each worker a `WorkerInput` per step (new requests in full once, then only their
ids; forks of tree rollouts; ids to free); the worker answers with a `RunnerOutput` (finished
requests, each failure, text embeddings sent the first time). Both ends import this module (the
layout of vLLM v1's `SchedulerOutput`/`NewRequestData`). The worker side imports nothing of the
engine; the engine names the worker functions it calls (`Worker.stage_lora`, their marks) and
measures a worker's work at start-up (`rollout.worker.work_profile`), and what of this exchange
runs in the engine's process lives under `rollout/engine/` (`received_conditions`, `weight_sync`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollout.condition import PromptEmbeds
from rollout.input_images import InputImages
from rollout.outputs import Trajectory
from rollout.sampling_params import SamplingParams


@dataclass
class WorkerInput:
    """Wire format of one engine step for one worker."""

    new_requests: list[NewRequestData] = field(default_factory=list)  # first step: full data
    forks: list[Fork] = field(default_factory=list)  # tree rollouts: split these (after new ones start)
    step_ids: list[str] = field(default_factory=list)  # denoise these one step (new ones included)
    free_ids: list[str] = field(default_factory=list)  # aborted: drop their state
    encoder_generation: int = 0  # the text encoders' weights now (the engine counts their changes)

    @property
    def is_empty(self) -> bool:
        return not (self.new_requests or self.forks or self.step_ids or self.free_ids)


@dataclass
class SchedulerOutput:
    """What the scheduler decided for one engine step: one `WorkerInput` per rank."""

    worker_inputs: dict[int, WorkerInput]

    @property
    def is_empty(self) -> bool:
        return all(w.is_empty for w in self.worker_inputs.values())


@dataclass(frozen=True)
class NewRequestData:
    """Wire format: everything a worker needs to start a request, sent once; later steps send only
    the id. `params` are resolved against the model (`ModelSpec.resolve`): no default left open."""

    request_id: str
    prompt: str
    params: SamplingParams
    init_noise_seed: int
    step_noise_seed: int
    images: InputImages | None = None  # an edit's input images, encoded by the worker (once per digest)


@dataclass(frozen=True)
class Fork:
    """Wire format: split request `parent_id` into children that continue from its latents, each
    with its own step-noise seed. The parent's state becomes the children's."""

    parent_id: str
    children: tuple[tuple[str, int], ...]  # (child id, step-noise seed), in child order


@dataclass(frozen=True)
class ConditionKeys:
    """A finished sample's condition as the numbers its worker gave its embeddings (an edit's
    encoded input images too)."""

    prompt: int
    negative: int | None = None
    images: int | None = None


@dataclass
class FinishedRequest:
    request_id: str
    image: torch.Tensor | None  # [3, H, W] uint8, CPU
    video: torch.Tensor | None  # [F, 3, H, W] uint8, CPU (video models)
    latents: torch.Tensor | None  # final latents, CPU float32, for output_type "latent"
    # Its `condition` is None until the engine attaches the embeddings that `condition` numbers.
    trajectory: Trajectory | None
    condition: ConditionKeys | None = None
    # Per series of the trajectory, the tree node each inherited part came from, so the engine can
    # share the parts of one node between leaves that arrive in different steps.
    part_nodes: dict[str, list[str]] = field(default_factory=dict)
    audio: torch.Tensor | None = None  # [channels, samples] float32, CPU (a video model with sound)


@dataclass
class RunnerOutput:
    """What one worker returns for one engine step."""

    finished: list[FinishedRequest] = field(default_factory=list)
    # Requests that failed alone in this step: request id -> "ErrorType: message". The worker holds
    # no state for them any more; their batch-mates went on.
    failed: dict[str, str] = field(default_factory=dict)
    # Text embeddings sent for the first time (number -> CPU float32 copy), and the numbers no
    # request on the worker uses any more (see `rollout.worker.sent_conditions`).
    embeds: dict[int, PromptEmbeds] = field(default_factory=dict)
    released_embeds: tuple[int, ...] = ()
    compute_s: float = 0.0  # time spent in this worker's step, for overhead accounting
    transformer_rows: int = 0  # rows through the transformer in this step (CFG and experts count)
    transformer_s: float = 0.0  # seconds in the transformer's forwards (see ForwardTally)
