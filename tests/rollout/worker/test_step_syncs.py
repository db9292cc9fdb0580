"""An engine step never makes the host wait for the device (issue 39 item 3): every aten op that a
CUDA device answers only after draining its queue (a scalar read, a count of rows, a copy between
the host and the device that is not queued) is recorded while `ModelRunner.step` runs, from the
runner through the adapter's guidance passes and the transformer to the sampler and the history,
for every model family (a mixed batch each: CFG on and off, two stochastic samplers beside ODE, a
fork, recorded steps, prompts of different lengths). A failure names the line that waits.

On a CPU device those ops are the same aten calls, so the check runs here: a scalar read of any
tensor, `nonzero`, a boolean mask index. A copy across devices only exists on a GPU, where the
same recorder flags one the host waits for."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rollout import EngineConfig, RolloutEngine
from tests.families import ALL_FAMILIES

pytestmark = pytest.mark.timeout(180)

aten = torch.ops.aten

# Ops after which the host holds a value computed by the device: it waits for the queue to drain.
WAITING_OPS = {
    aten._local_scalar_dense.default,  # .item(), bool(), float(), int() of a tensor
    aten.is_nonzero.default,
    aten.nonzero.default,
    aten.nonzero_static.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
}


def _waits(func, args, kwargs) -> str | None:
    """Why `func(*args, **kwargs)` would make the host wait for a CUDA device, or None."""
    if func in WAITING_OPS:
        return func.name()
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size"
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        indices = args[1]
        if any(i is not None and i.dtype == torch.bool for i in indices):
            return f"{func.name()} with a boolean mask"
    if func is aten._to_copy.default:  # .to(device): a copy between host and device
        source, target = args[0].device, kwargs.get("device", args[0].device)
        if source.type != target.type and not (kwargs.get("non_blocking") and source.type == "cpu"):
            return f"a copy {source} -> {target} the host waits for"
    if func is aten.copy_.default:
        target, source = args[0].device, args[1].device
        if target.type != source.type and not (len(args) > 2 and args[2]):
            return f"a copy {source} -> {target} the host waits for"
    return None


def _caller() -> str:
    """The innermost frame outside torch (file:line), so a failure names the line that waits."""
    for frame in reversed(traceback.extract_stack()):
        if f"{os.sep}torch{os.sep}" not in frame.filename and frame.filename != __file__:
            return f"{Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.lineno}"
    return "?"


class WaitRecorder(TorchDispatchMode):
    """Records every op that would make the host wait (see `_waits`), with the reason."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _waits(func, args, kwargs)
        if reason is not None:
            self.found.append(f"{reason} at {_caller()}")
        return func(*args, **kwargs)


def _record_steps(worker) -> None:
    """Run every later `runner.step` of this worker under a `WaitRecorder`; keep what each found."""
    step = worker.runner.step
    worker.step_waits = []

    def recorded(states):
        batch = {
            "rows": len(states),
            "cfg": sorted({s.condition.negative is not None for s in states}),
            "rules": sorted({(s.data.params.sampler, s.sde_mask[s.step_index]) for s in states}),
            "forked": any(s.history.inherited for s in states),
            "records": any(s.data.params.record for s in states),
        }
        with WaitRecorder() as recorder:
            step(states)
        worker.step_waits.append((batch, recorder.found))

    worker.runner.step = recorded


# The families the check runs on: SD3, Qwen-Image's text mask, Z-Image's unpadded captions and
# Wan 2.2's two experts in the default suite (a few seconds each); every other family in the slow one.
QUICK_FAMILIES = ("sd3", "qwen_image", "zimage", "wan22")


# Families whose step still waits, inside diffusers' own transformer, where the engine cannot
# remove it without computing something other than the pipeline does.
HUNYUAN_WAITS = (
    "HunyuanVideo15Transformer3DModel branches on torch.all(image_embeds == 0) and selects tokens by boolean "
    "masks (the adapter's text unpadding, which reads its fixed-length masks, waits too)"
)
WAITS_IN_DIFFUSERS = {
    "qwen_image21": "QwenImage21Transformer2DModel reads its masks on the host (nonzero, int(mask.sum()), "
    "boolean-mask index_put_ of the rotary positions, repeat_interleave without output_size)",
    "hunyuan_video15": HUNYUAN_WAITS,
    "hunyuan_video15_i2v": HUNYUAN_WAITS,
}


def _families() -> list:
    params = []
    for name in ALL_FAMILIES:
        marks = [] if name in QUICK_FAMILIES else [pytest.mark.slow]
        if name in WAITS_IN_DIFFUSERS:
            marks.append(pytest.mark.xfail(strict=True, reason=WAITS_IN_DIFFUSERS[name]))
        params.append(pytest.param(name, marks=marks))
    return params


@pytest.mark.parametrize("family_name", _families())
def test_a_mixed_step_has_no_op_that_makes_the_host_wait(tiny_models, family_name):
    family = ALL_FAMILIES[family_name]
    common = {"num_inference_steps": 4, "seed": 3, "return_trajectory": True}
    requests = [
        family.params(cfg=True, sampler="flow_sde", record=("x0", "mean", "std"), record_steps=(1, 2), **common),
        family.params(cfg=False, sampler="cps", noise_level=0.5, output_type="latent", **common),
        family.params(cfg=True, sampler="dance_sde", branch_steps=(2,), record=("mean",), sde_window=(1, 4), **common),
        family.params(cfg=False, sampler="ode", **common),
    ]
    images = family.inputs(num_prompts=1).get("images", [None])[0]
    with RolloutEngine(EngineConfig(model=tiny_models(family_name), max_batch_size=8)) as engine:
        engine.collective_rpc(_record_steps)
        for index, params in enumerate(requests):
            # Prompts of different lengths: a family that pads its batch's text (Qwen-Image, Z-Image) pads here.
            prompt = "a prompt" + " with a few more words" * index
            engine.add_request(prompt, params, images=images, prompt_index=index)
            engine.step()  # the requests join at different steps, so batches mix steps and rules
        while engine.has_unfinished_requests():
            engine.step()
        (steps,) = engine.collective_rpc(lambda worker: worker.step_waits)
        (cfg_field,) = engine.collective_rpc(lambda worker: worker.adapter.spec.cfg_field)
    batches = [batch for batch, _ in steps]
    # The check saw what it is about: guided and unguided rows (where the family has a CFG pass:
    # FLUX.2 [dev]'s guidance is a transformer input), two stochastic rules with ODE rows beside
    # them, recorded steps, and the children of a fork in one batch.
    guided = [False, True] if cfg_field is not None else [False]
    assert any(batch["cfg"] == guided and len(batch["rules"]) >= 3 for batch in batches), batches
    assert any(batch["forked"] and batch["records"] for batch in batches), batches
    waits = {reason for _, found in steps for reason in found}
    assert not waits, f"ops in a step that make the host wait for the device: {sorted(waits)}"


def test_the_batch_step_noise_is_each_requests_own_draw_bitwise(trainer_adapter):
    """The step noise of a batch, drawn into one buffer, is what a separate draw from each request's
    generator gives (the numbers before the batch draw), scaled at a branch step."""
    from rollout.messages import NewRequestData
    from rollout.seeding import make_generator
    from rollout.worker.model_runner import ModelRunner, _step_noise

    sd3 = ALL_FAMILIES["sd3"]
    requests = []
    for k, (seed, scale) in enumerate(((11, 1.0), (12, 1.5), (11, 1.0))):
        params, problems = trainer_adapter.spec.resolve(
            sd3.params(num_inference_steps=3, branch_steps=(1,), branch_noise_scale=scale, sampler="flow_sde")
        )
        assert not problems
        requests.append(NewRequestData(f"r{k}", "a prompt", params, init_noise_seed=0, step_noise_seed=seed))
    states, failed = ModelRunner(trainer_adapter, loras=None).prepare(requests, [], 0)
    assert not failed
    for state in states:
        state.step_index = 1  # a branch step
    noise = _step_noise(states, torch.device("cpu"))
    shape = states[0].latents.shape
    assert noise.shape == (3, *shape) and noise.dtype == torch.float32
    for row, (seed, scale) in zip(noise, ((11, 1.0), (12, 1.5), (11, 1.0)), strict=True):
        assert torch.equal(row, torch.randn(shape, generator=make_generator(seed)) * scale)
    again = _step_noise(states, torch.device("cpu"))  # each generator moved on by its own draw
    assert not torch.equal(again[0], noise[0]) and torch.equal(again[0], again[2])
