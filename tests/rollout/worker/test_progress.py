"""A worker's progress count (`rollout.worker.progress`): what tells a slow step from a hung one."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
from torch import nn

from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.worker.progress import Progress, WorkerStopped, progress_units

pytestmark = pytest.mark.timeout(120)


def test_the_units_watched_are_blocks_layers_and_a_vaes_resnets_attentions_and_samplers(trainer_adapter):
    transformer = trainer_adapter.transformer
    assert progress_units(transformer) == list(transformer.transformer_blocks)  # whole: compiled blocks hold no hook
    vae = trainer_adapter.pipeline.vae
    units = set(progress_units(vae))
    for blocks, samplers in ((vae.decoder.up_blocks, "upsamplers"), (vae.encoder.down_blocks, "downsamplers")):
        for block in blocks:
            # Each resnet and up- or downsampler of a block at its resolution, not the block (several of them).
            parts = list(block.resnets) + list(getattr(block, samplers) or ())
            assert block not in units and set(parts) <= units
    for mid in (vae.decoder.mid_block, vae.encoder.mid_block):  # the attention over every latent pixel alone
        assert set(mid.attentions) | set(mid.resnets) <= units
    t5 = trainer_adapter.pipeline.text_encoder_3
    assert progress_units(t5) == [layer for block in t5.encoder.block for layer in block.layer]
    flat = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert progress_units(flat) == list(flat.children())  # no ModuleList: its children


def test_a_stopped_progress_raises_where_the_next_unit_starts():
    model = nn.Sequential(nn.ModuleList([nn.Identity(), nn.Identity()]))
    progress = Progress()
    progress.watch([model])
    model[0][0](None)
    progress.stop("the engine is dead")
    with pytest.raises(WorkerStopped, match="the engine is dead"):
        model[0][1](None)
    assert progress.count == 1
    assert not issubclass(WorkerStopped, Exception)  # no request isolation catches it and runs the work again


def test_a_decode_slower_than_the_step_timeout_lives_while_its_resnets_progress(tiny_model):
    # Issue 50: a VAE's up block (two resnets and an upsampler of the tiny SD3's) was one unit, so
    # a decode whose up block ran longer than step_timeout_s stopped the engine for every client,
    # however steadily it computed. Here each resnet takes 1 s (an up block 2 s) against 1.5 s.
    params = SamplingParams(num_inference_steps=1, seed=0)
    with RolloutEngine(EngineConfig(model=tiny_model, step_timeout_s=1.5)) as engine:
        (expected,) = engine.generate("x", params)
        engine.collective_rpc(slow_down_vae_resnets, args=(1.0,))
        start = time.monotonic()
        (output,) = engine.generate("x", params)
        assert time.monotonic() - start > 6 * 1.0  # the decoder's six resnets
        assert engine.dead is None and engine.collective_rpc("get_rank") == [0]
    assert torch.equal(output.image, expected.image)


def slow_down_vae_resnets(worker, seconds: float) -> None:
    """From now on each resnet of the worker's VAE sleeps `seconds` as it starts (after the progress count)."""
    for module in worker.adapter.pipeline.vae.modules():
        if type(module).__name__ == "ResnetBlock2D":
            module.register_forward_pre_hook(lambda module, args: time.sleep(seconds))


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
