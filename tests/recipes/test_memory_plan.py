"""The memory plan's activation estimate (meta modules, fake tensors) against the same micro-batch
measured on the real model, and the plan's fit check naming the knobs."""

from __future__ import annotations

import pytest
import torch

from benchmarks.allocation_peak import AllocationPeak
from recipes.loading import load_config
from recipes.memory_plan import memory_plan, meta_adapter
from rollout import SamplingParams
from rollout.pipelines.loading import load_adapter
from trainers_adapters.policy.train_step_peak import attach_lora, train_step_peak

pytestmark = pytest.mark.timeout(120)

LORA = {"r": 8, "lora_alpha": 16}
PARAMS = SamplingParams(sampler="flow_sde", noise_level=0.7, guidance_scale=4.5)  # CFG: twice the rows


def estimate(folder: str, rows: int, checkpointing: bool) -> int:
    adapter = meta_adapter(folder, torch.float32)
    attach_lora(adapter, LORA)
    if checkpointing:
        adapter.transformer.enable_gradient_checkpointing()
    return train_step_peak(adapter, PARAMS, rows, guided=True, fake=True)


def measured(folder: str, rows: int, checkpointing: bool) -> tuple[int, int]:
    """(live tensor bytes, the CPU allocator's high-water mark) of the same step on the real model."""
    adapter = load_adapter(folder)
    attach_lora(adapter, LORA)
    if checkpointing:
        adapter.transformer.enable_gradient_checkpointing()
    with AllocationPeak() as allocator:
        live = train_step_peak(adapter, PARAMS, rows, guided=True, fake=False)
    return live, allocator.peak_bytes


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fake_estimate_is_within_20_percent_of_the_real_peak(tiny_model, checkpointing):
    live, allocator = measured(tiny_model, 4, checkpointing)
    guess = estimate(tiny_model, 4, checkpointing)
    assert abs(guess - live) <= 0.01 * live, (guess, live)  # the same count: fake tensors keep every shape
    assert abs(guess - allocator) <= 0.2 * allocator, (guess, allocator)  # torch's own allocator


def test_gradient_checkpointing_and_rows_change_the_estimate(tiny_model):
    plain = estimate(tiny_model, 4, False)
    assert estimate(tiny_model, 4, True) < plain
    assert estimate(tiny_model, 8, False) > 1.5 * plain


def test_a_config_that_does_not_fit_is_refused_with_the_knobs(tmp_path):
    overrides = [f"model.tiny_cache_dir={tmp_path / 'tiny'}", f"output_dir={tmp_path / 'out'}"]
    config = load_config("recipes/configs/grpo_tiny.yaml", overrides)
    plan = memory_plan(config)
    assert plan.capacity is None and plan.problems() == []  # a CPU has no known total: no check
    tight = plan.devices[0].total / 2 / 1024**3
    with pytest.raises(ValueError, match="grpo.micro_batch_size.*gradient_checkpointing.*placement: separate"):
        load_config("recipes/configs/grpo_tiny.yaml", [*overrides, f"trainer.device_memory_gib={tight}"])


def test_a_colocated_trainer_that_does_not_share_the_base_counts_its_own_copy(tmp_path):
    overrides = [f"model.tiny_cache_dir={tmp_path / 'tiny'}", f"output_dir={tmp_path / 'out'}"]
    shared, own = (
        memory_plan(load_config("recipes/configs/grpo_tiny.yaml", [*overrides, f"trainer.share_base={value}"]))
        for value in ("true", "false")
    )
    lines = {line.what: line.bytes for line in own.devices[0].lines}
    pipeline = lines["engine's denoisers"] + sum(b for what, b in lines.items() if what.startswith("engine-only"))
    assert lines["trainer's copy of the pipeline"] == pipeline
    assert own.devices[0].total == shared.devices[0].total + pipeline


@pytest.mark.parametrize("config_name, reference", [("grpo_full_tiny.yaml", False), ("dpo_full_tiny.yaml", True)])
def test_a_full_policy_is_planned_sharded_over_the_ranks(tmp_path, config_name, reference):
    overrides = [f"model.tiny_cache_dir={tmp_path / 'tiny'}", f"output_dir={tmp_path / 'out'}"]
    config = load_config(f"recipes/configs/{config_name}", overrides)
    one, four = (memory_plan(config, ranks) for ranks in (1, 4))
    lines = [{line.what: line.bytes for line in plan.devices[0].lines} for plan in (one, four)]
    sharded = ["float32 master weights (1/N)", "gradients (1/N)", "AdamW states (1/N)"]
    sharded += ["reference weights (1/N)"] if reference else []
    assert ("reference weights (1/N)" in lines[0]) == reference
    parameters = lines[0]["engine's denoisers"] // 4  # the tiny engine runs in float32
    assert lines[0]["float32 master weights (1/N)"] == 4 * parameters
    for what in sharded:
        assert lines[1][what] == lines[0][what] // 4
    assert one.devices[0].total - four.devices[0].total == sum(lines[0][w] - lines[1][w] for w in sharded)
    tight = (four.devices[0].total + one.devices[0].total) / 2 / 1024**3  # fits on 4 ranks, not on 1
    tight_overrides = [*overrides, f"trainer.device_memory_gib={tight}"]
    roomy = load_config(f"recipes/configs/{config_name}", tight_overrides, check_fit=False)
    assert memory_plan(roomy, 4).problems() == []
    with pytest.raises(ValueError, match="more trainer ranks"):  # the config check plans 1 rank outside torchrun
        load_config(f"recipes/configs/{config_name}", tight_overrides)


def test_a_sleeping_engine_leaves_the_device_while_the_trainer_updates(tmp_path):
    """With trainer.engine_sleep the engine's weights count only while it samples, the trainer's
    gradients, gathered units and activations only while it trains: the larger phase counts."""
    overrides = [f"model.tiny_cache_dir={tmp_path / 'tiny'}", f"output_dir={tmp_path / 'out'}"]
    awake, asleep = (
        memory_plan(load_config("recipes/configs/grpo_full_tiny.yaml", [*overrides, f"trainer.engine_sleep={level}"]))
        for level in (0, 1)
    )
    assert "set trainer.engine_sleep: 1" in awake.knobs and "set trainer.engine_sleep: 1" not in asleep.knobs
    lines = asleep.devices[0].lines
    phase = {name: sum(line.bytes for line in lines if line.phase == name) for name in ("", "sampling", "training")}
    assert phase["sampling"] and phase["training"]
    assert asleep.devices[0].total == phase[""] + max(phase["sampling"], phase["training"])
    assert awake.devices[0].total == sum(phase.values())
    assert "(while sampling)" in asleep.render() and "(while" not in awake.render()
