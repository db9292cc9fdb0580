"""What the per-family pipeline tests (test_wan.py, test_ltx2.py, their image-to-video twins,
test_hunyuan_video15.py, test_parity.py) share: an engine beside the family's own diffusers
pipeline on one tiny folder, the schedule the pipeline runs, re-scoring's ratio-one check, and
outputs sent through the wire and read back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import pytest
import torch

from rollout import EngineConfig, RolloutEngine
from rollout.pipelines.loading import load_adapter
from rollout.rescoring import RATIO_TOLERANCE, recompute_log_probs


@contextlib.contextmanager
def engine_and_pipeline(family, path: str, **config) -> Iterator[tuple]:
    """(engine, the family's diffusers pipeline, a trainer's adapter) on the tiny folder at `path`;
    `config`: EngineConfig's other fields."""
    pipeline = family.diffusers_pipeline(path)
    with RolloutEngine(EngineConfig(model=path, **config)) as engine:
        yield engine, pipeline, load_adapter(path)


def family_engines(families: dict):
    """A module's fixture over `families` (one param a family): (family, engine, the family's
    diffusers pipeline, a trainer's adapter) on the family's tiny folder."""

    @pytest.fixture(scope="module", params=list(families))
    def family_engine(request, tiny_models):
        family = families[request.param]
        with engine_and_pipeline(family, tiny_models(family.name)) as (engine, pipeline, trainer_adapter):
            yield family, engine, pipeline, trainer_adapter

    return family_engine


def pipeline_schedule(pipeline, **call) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `pipeline(**call)` and return its scheduler's sigmas and timesteps as its loop used them
    (read in the loop: where a caller's `sigmas=` is shifted, this is the shifted schedule)."""
    captured = {}

    def capture(pipe, step, timestep, callback_kwargs):
        captured["sigmas"] = pipe.scheduler.sigmas.clone()
        captured["timesteps"] = pipe.scheduler.timesteps.clone()
        return callback_kwargs

    pipeline(callback_on_step_end=capture, **call)
    return captured["sigmas"], captured["timesteps"]


def assert_ratio_one(trainer_adapter, outputs: Iterable) -> None:
    """Each output's trajectory, re-scored by a trainer's adapter, gives the log-probs it was
    sampled with (the policy ratio is 1)."""
    for output in outputs:
        log_ratio = recompute_log_probs(trainer_adapter, output.trajectory) - output.trajectory.log_probs
        assert log_ratio.abs().max() < RATIO_TOLERANCE


def assert_same_sample(alone, among_others) -> None:
    """A sample made alone and the same sample made in a batch with others have the same latents
    and log-probs (within float noise): a sample does not depend on its batch-mates."""
    a, b = alone.trajectory, among_others.trajectory
    assert (a.latents.stack() - b.latents.stack()).abs().max() < 1e-5
    assert (a.log_probs - b.log_probs).abs().max() < 1e-5


def over_the_wire(outputs: Iterable) -> list:
    """`outputs` encoded as one answer's stream and decoded as a client decodes it, in order (the
    frames that only set up later ones, such as a group's shared embeddings, are read on the way)."""
    from rollout.http.wire import FrameReader, OutputDecoder, OutputEncoder

    encoder, decoder = OutputEncoder(), OutputDecoder()
    data = b"".join(encoder.encode(output) for output in outputs)
    decoded = [decoder.decode(fields, tensors) for fields, tensors in FrameReader().feed(data)]
    return [output for output in decoded if output is not None]
