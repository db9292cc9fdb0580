"""A request as the engine and scheduler see it, and the small record sent to a worker for it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from rollout.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, no worker holds its state yet
    RUNNING = "running"  # admitted to a rank; that worker holds its state once first scheduled
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(frozen=True)
class NewRequestData:
    """Wire format: everything a worker needs to start a request, sent once; later steps send only
    the id. `params` are resolved against the model (`ModelSpec.resolve`): no default left open."""

    request_id: str
    prompt: str
    params: SamplingParams
    init_noise_seed: int
    step_noise_seed: int


@dataclass
class Request:
    """One sample of one prompt (a GRPO group of n samples is n requests)."""

    request_id: str
    group_id: str  # the id add_request was given (or made): "{group_id}-{sample_index}" is request_id
    prompt: str
    prompt_index: int
    sample_index: int
    params: SamplingParams  # resolved against the model
    seed: int  # this sample's step-noise seed, reported in its output
    init_noise_seed: int
    status: RequestStatus = RequestStatus.WAITING
    rank: int | None = None
    sent_to_worker: bool = False
    steps_done: int = 0
    weight_versions: list[int] = field(default_factory=list)  # distinct versions its steps used
    encoder_generation: int = 0  # the engine's weights generation when its text was encoded
    last_scheduled_tick: int = -1
    arrival_time: float = field(default_factory=time.monotonic)
    first_step_time: float | None = None

    def note_weight_version(self, version: int) -> None:
        if not self.weight_versions or self.weight_versions[-1] != version:
            self.weight_versions.append(version)

    @property
    def batch_key(self) -> tuple:
        """Requests with equal keys can share one forward pass (same latent and text shapes, same
        adapter)."""
        p = self.params
        return (p.height, p.width, p.num_frames, p.max_sequence_length, p.lora, p.lora_scale)

    def new_request_data(self) -> NewRequestData:
        return NewRequestData(
            request_id=self.request_id,
            prompt=self.prompt,
            params=self.params,
            init_noise_seed=self.init_noise_seed,
            step_noise_seed=self.seed,
        )
