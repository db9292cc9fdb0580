"""Compiled transformer blocks (`EngineConfig.compile="blocks"`, `rollout.pipelines.compiled_blocks`):
rollouts equal eager ones, nothing recompiles once the first graphs exist (batch sizes 1..16, two
adapters swapped, a hot swap, a weight push, sleep and wake), progress still counts, and a trainer
re-scores a compiled rollout, compiled or eager, to |log-ratio| < 1e-5, and trains through the
compiled blocks to the eager loss and gradients."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from rollout import EngineConfig, RolloutEngine
from rollout.http.wire import FrameReader, OutputDecoder, OutputEncoder
from rollout.pipelines.compiled_blocks import compile_blocks, repeated_block_classes
from rollout.pipelines.loading import load_adapter
from rollout.rescoring import recompute_log_probs
from rollout.weights.state import base_state
from tests.families import ALL_FAMILIES, FAMILIES
from trainers_adapters.policy.lora_policy import LoraPolicy

pytestmark = pytest.mark.timeout(900)
logger = logging.getLogger(__name__)

CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"], "init_lora_weights": False}
TOLERANCE = 1e-5  # compiled vs eager, float32 on a CPU: latents, log-probs and re-scored log-ratios
SD3 = FAMILIES["sd3"]


def graphs() -> int:
    """Graphs dynamo has compiled in this process so far (each recompile adds one)."""
    return counters["stats"]["unique_graphs"]


def _close(got: list, expected: list) -> float:
    """The largest difference between the latents and log-probs of two lists of outputs."""
    worst = 0.0
    for a, b in zip(got, expected, strict=True):
        worst = max(worst, (a.trajectory.latents.stack() - b.trajectory.latents.stack()).abs().max().item())
        worst = max(worst, (a.trajectory.log_probs - b.trajectory.log_probs).abs().max().item())
    return worst


def test_the_setting_is_checked_and_sd3_falls_back_on_its_no_split_modules(trainer_adapter, tiny_model):
    with pytest.raises(ValueError, match="compile must be one of off, blocks"):
        EngineConfig(model=tiny_model, compile="all")
    with pytest.raises(ValueError, match="compile must be one of off, blocks"):
        load_adapter(tiny_model, compile="yes")
    # Flex attention does not compile inside the blocks: refused for the engine and the trainer alike.
    with pytest.raises(ValueError, match="compile='blocks' cannot run with attention_backend='flex'"):
        EngineConfig(model=tiny_model, compile="blocks", attention_backend="flex")
    with pytest.raises(ValueError, match="compile='blocks' cannot run with attention_backend='flex'"):
        load_adapter(tiny_model, compile="blocks", attention_backend="flex")
    assert EngineConfig(model=tiny_model, compile="blocks", attention_backend="native").compile == "blocks"
    # diffusers' SD3Transformer2DModel declares no _repeated_blocks; its _no_split_modules names its block.
    assert not getattr(type(trainer_adapter.transformer), "_repeated_blocks", None)
    assert repeated_block_classes(trainer_adapter.transformer) == ("JointTransformerBlock",)
    with pytest.raises(ValueError, match="declares neither _repeated_blocks nor _no_split_modules"):
        compile_blocks({"transformer": torch.nn.Linear(2, 2)})


@pytest.fixture(scope="module")
def sd3_engines(tiny_model):
    """(compiled, eager) engines on the tiny SD3 (float32: LoRA adapters run merged)."""
    with (
        RolloutEngine(EngineConfig(model=tiny_model, compile="blocks", max_batch_size=16)) as compiled,
        RolloutEngine(EngineConfig(model=tiny_model, max_batch_size=16)) as eager,
    ):
        yield compiled, eager


@pytest.fixture(scope="module")
def policy(tiny_model):
    return LoraPolicy(tiny_model, CONFIG)


@pytest.mark.slow
def test_compiled_rollouts_equal_eager_and_nothing_recompiles_after_the_first_graphs(sd3_engines, policy):
    compiled, eager = sd3_engines
    lora = policy.lora_state()
    for engine in sd3_engines:
        engine.load_lora("a", lora, policy.lora_config)
        engine.load_lora("b", {key: tensor + 0.01 for key, tensor in lora.items()}, policy.lora_config)

    def both(count: int, **params) -> tuple[list, list]:
        params = SD3.params(num_inference_steps=2, seed=count, **params)
        return compiled.generate(["a red square"] * count, params), eager.generate(["a red square"] * count, params)

    # The first graphs: a batch of 1 and any other batch. The adapters were loaded first, so every forward
    # runs PEFT's layers bypassed (merged, or the base with its adapters off): one module tree.
    before = graphs()
    for count in (1, 2):
        both(count)
        both(count, lora="a")
    first = graphs() - before
    progress = compiled.collective_rpc(lambda worker: worker.progress.count)[0]
    worst = 0.0
    for count in range(1, 17):  # every batch size, swapping adapters between calls
        worst = max(worst, _close(*both(count, lora=(None, "a", "b")[count % 3])))
    advanced = compiled.collective_rpc(lambda worker: worker.progress.count)[0] - progress
    assert advanced >= 16 * 2 * 2  # 16 calls of two steps through the tiny SD3's two blocks: hooks stay eager
    for engine in sd3_engines:  # a hot swap, a weight push, sleep and wake
        engine.load_lora("a", {key: tensor - 0.01 for key, tensor in lora.items()}, policy.lora_config)
    worst = max(worst, _close(*both(5, lora="a")))
    pushed = {name: tensor * 0.99 for name, tensor in base_state(policy.adapter.transformer).items()}
    for engine in sd3_engines:
        engine.update_weights(pushed)
    worst = max(worst, _close(*both(3, lora="b")), _close(*both(4)))
    for engine in sd3_engines:
        engine.sleep(1)
        engine.wake_up()
    worst = max(worst, _close(*both(6, lora="a")))
    for engine in sd3_engines:
        engine.sleep(2)
        engine.wake_up()
    worst = max(worst, _close(*both(2, lora="b", guidance_scale=4.5)))  # CFG: 4 rows in one pass
    recompiles = graphs() - before - first
    logger.info("SD3 compiled vs eager: %d first graphs, %d recompiles, worst %.2e", first, recompiles, worst)
    assert first == 4  # 2 block variants (the last is context_pre_only) x (batch 1, any batch)
    assert recompiles == 0
    assert worst < TOLERANCE
    for engine in sd3_engines:
        engine.update_weights(base_state(policy.adapter.transformer))
        engine.unload_lora("a")
        engine.unload_lora("b")


@pytest.mark.slow
def test_a_compiled_rollout_rescores_within_1e_5_by_a_compiled_and_an_eager_trainer(sd3_engines, policy, tiny_model):
    compiled_engine, _ = sd3_engines
    compiled_policy = LoraPolicy(tiny_model, CONFIG, compile="blocks")
    with torch.no_grad():
        for mine, theirs in zip(compiled_policy.parameters(), policy.parameters(), strict=True):
            mine.copy_(theirs)
    policy.push(compiled_engine)
    params = SD3.params(num_inference_steps=4, num_samples=3, seed=7, lora="policy", guidance_scale=4.5)
    outputs = compiled_engine.generate(["a red square", "a blue circle"], params)
    trajectories = [output.trajectory for output in outputs]
    assert {t.compile for t in trajectories} == {"blocks"}
    # The mode crosses the wire with the trajectory.
    data = OutputEncoder().encode(outputs[0])
    decoder = OutputDecoder()
    decoded = [decoder.decode(*frame) for frame in FrameReader().feed(data)][-1]
    assert decoded.trajectory.compile == "blocks"

    ratios = {}
    for name, trainer in (("compiled", compiled_policy), ("eager", policy)):
        with torch.no_grad():
            ratios[name] = max(
                (recompute_log_probs(trainer.adapter, t) - t.log_probs).abs().max().item() for t in trajectories
            )
    logger.info("|log-ratio| of a compiled rollout: compiled trainer %.2e, eager trainer %.2e", *ratios.values())
    assert ratios["compiled"] < TOLERANCE and ratios["eager"] < TOLERANCE

    # One training step through the compiled blocks: the eager loss and LoRA gradients.
    losses, grads = {}, {}
    for name, trainer in (("compiled", compiled_policy), ("eager", policy)):
        for parameter in trainer.parameters():
            parameter.grad = None
        scored = trainer.score(trajectories, 1)
        old = torch.stack([t.log_probs[1] for t in trajectories])
        advantages = torch.linspace(-1, 1, len(trajectories))
        loss = -(advantages * torch.exp(scored.log_prob - old)).mean()
        loss.backward()
        losses[name] = loss.item()
        grads[name] = torch.cat([p.grad.flatten() for p in trainer.parameters()])
    scale = grads["eager"].abs().max().item()
    logger.info(
        "training step, compiled vs eager: loss %.2e apart, gradients %.2e apart (largest %.2e)",
        abs(losses["compiled"] - losses["eager"]),
        (grads["compiled"] - grads["eager"]).abs().max().item(),
        scale,
    )
    assert scale > 0
    assert abs(losses["compiled"] - losses["eager"]) < TOLERANCE
    torch.testing.assert_close(grads["compiled"], grads["eager"], rtol=1e-4, atol=1e-5 * scale)
    compiled_engine.unload_lora("policy")


@pytest.mark.slow
def test_compiled_flux_equals_eager_across_batch_sizes_and_adapters_without_recompiles(tiny_models):
    family = FAMILIES["flux"]
    path = tiny_models("flux")
    policy = LoraPolicy(path, CONFIG)
    lora = policy.lora_state()
    with (
        RolloutEngine(EngineConfig(model=path, compile="blocks", max_batch_size=16)) as compiled,
        RolloutEngine(EngineConfig(model=path, max_batch_size=16)) as eager,
    ):
        for engine in (compiled, eager):
            engine.load_lora("a", lora, policy.lora_config)
            engine.load_lora("b", {key: tensor + 0.01 for key, tensor in lora.items()}, policy.lora_config)

        def both(count: int, **params) -> float:
            params = family.params(num_inference_steps=2, seed=count, **params)
            prompts = ["a red square"] * count
            return _close(compiled.generate(prompts, params), eager.generate(prompts, params))

        before = graphs()
        for count in (1, 2):
            both(count)
            both(count, lora="a")
        first = graphs() - before
        worst = max(both(count, lora=(None, "a", "b")[count % 3]) for count in (1, 3, 7, 16))
        pushed = {name: tensor * 0.99 for name, tensor in base_state(policy.adapter.transformer).items()}
        for engine in (compiled, eager):
            engine.update_weights(pushed)
        worst = max(worst, both(5, lora="b"))
        recompiles = graphs() - before - first
    logger.info("FLUX.1 compiled vs eager: %d first graphs, %d recompiles, worst %.2e", first, recompiles, worst)
    assert first == 4  # 2 block classes (double- and single-stream) x (batch 1, any batch)
    assert recompiles == 0
    assert worst < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("family_name", [name for name in ALL_FAMILIES if name not in ("sd3", "flux")])
def test_every_family_compiles_its_blocks_whole_and_samples_what_eager_does(tiny_models, family_name):
    """Every other family's blocks compile without a graph break (the whole block is one graph), a
    call of a shape seen before compiles nothing, its compiled rollouts equal eager ones, guidance
    and input images included, and a compiled trainer re-scores them within the contract (SD3 and
    FLUX.1 are checked across batch sizes and adapters above, SD3's gradients too)."""
    family = ALL_FAMILIES[family_name]
    path = tiny_models(family_name)
    images = family.inputs(num_prompts=1).get("images", [None])[0]
    inputs = {} if images is None else {"images": images}
    breaks, before = sum(counters["graph_break"].values()), graphs()
    worst, trajectories = 0.0, []
    with (
        RolloutEngine(EngineConfig(model=path, compile="blocks")) as compiled,
        RolloutEngine(EngineConfig(model=path)) as eager,
    ):
        for count, cfg in ((2, True), (3, False)):
            params = family.params(
                cfg=cfg, num_inference_steps=2, seed=count, num_samples=count, return_trajectory=True
            )
            got = compiled.generate(["a red square"], params, **inputs)
            trajectories += [output.trajectory for output in got]
            worst = max(worst, _close(got, eager.generate(["a red square"], params, **inputs)))
            assert {output.trajectory.compile for output in got} == {"blocks"}
        compiled_so_far = graphs()
        for count, cfg in ((2, True), (3, False)):  # the same shapes again
            params = family.params(cfg=cfg, num_inference_steps=2, seed=count + 10, num_samples=count)
            compiled.generate(["a red square"], params, **inputs)
        recompiles = graphs() - compiled_so_far
    assert recompiles == 0, f"{recompiles} graphs compiled again for shapes seen before"
    logger.info("%s compiled vs eager: %d graphs, worst %.2e", family_name, graphs() - before, worst)
    assert sum(counters["graph_break"].values()) == breaks
    assert worst < TOLERANCE
    trainer = LoraPolicy(path, {"r": 4, "lora_alpha": 8}, compile="blocks")  # its default targets, B = 0
    with torch.no_grad():
        ratio = max((recompute_log_probs(trainer.adapter, t) - t.log_probs).abs().max().item() for t in trajectories)
    logger.info("%s: a compiled trainer re-scores the compiled rollouts to |log-ratio| %.2e", family_name, ratio)
    assert ratio < TOLERANCE
