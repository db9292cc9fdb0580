"""A worker's progress count (`rollout.worker.progress`): what tells a slow step from a hung one."""

from __future__ import annotations

import multiprocessing

import pytest
from torch import nn

from rollout import SamplingParams
from rollout.worker.progress import Progress, outermost_blocks

pytestmark = pytest.mark.timeout(120)


def test_the_blocks_watched_are_each_models_outermost_repeated_blocks(trainer_adapter):
    transformer = trainer_adapter.transformer
    assert outermost_blocks(transformer) == list(transformer.transformer_blocks)
    vae = trainer_adapter.pipeline.vae
    blocks = outermost_blocks(vae)
    assert set(vae.decoder.up_blocks) <= set(blocks) and set(vae.encoder.down_blocks) <= set(blocks)
    assert not any(block in set(blocks) for up in vae.decoder.up_blocks for block in up.resnets)  # not nested
    flat = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert outermost_blocks(flat) == list(flat.children())  # no ModuleList: its children


def test_every_block_started_advances_the_count_in_this_process_or_a_shared_cell():
    model = nn.Sequential(nn.ModuleList([nn.Identity(), nn.Identity(), nn.Identity()]))
    progress = Progress()
    assert progress.watch([model]) == 3
    for block in model[0]:
        block(None)
    assert progress.count == 3
    shared = multiprocessing.get_context("spawn").RawValue("Q", 0)
    progress.count_in(shared)
    assert shared.value == 3  # the count so far moved with it
    model[0][1](None)
    assert progress.count == shared.value == 4


def test_a_step_advances_the_workers_count_by_its_blocks(engine):
    counts = engine.collective_rpc(lambda worker: worker.progress.count)
    engine.generate("a red square", SamplingParams(num_inference_steps=3, seed=0))
    advanced = engine.collective_rpc(lambda worker: worker.progress.count)[0] - counts[0]
    assert advanced >= 3 * 2  # at least three forwards of the tiny SD3's two transformer blocks
