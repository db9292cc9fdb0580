"""Wan 2.2's two experts as hot-swap components, on every executor (uni in the default suite, mp and
ray with `make test-slow`): weights per expert (update, checksum, a refused update), LoRA on either
expert or both, sleep and wake, and an abort that leaves nothing behind."""

from __future__ import annotations

import pytest
import torch

from rollout import EngineConfig, RolloutEngine
from rollout.weights.state import base_state, checksum
from tests.families import VIDEO_FAMILIES

pytestmark = pytest.mark.timeout(240)

WAN22 = VIDEO_FAMILIES["wan22"]
EXPERTS = ("transformer", "transformer_2")
LORA_TARGETS = ["to_q", "to_v"]
BACKENDS = {
    "uni": {"executor": "uni"},
    "mp": {"executor": "mp", "num_workers": 2},
    "ray": {"executor": "ray", "num_workers": 2},
}


@pytest.fixture(
    scope="module",
    params=[
        "uni",
        pytest.param("mp", marks=pytest.mark.slow),
        pytest.param("ray", marks=pytest.mark.slow),
    ],
)
def engine(request, tiny_models):
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    with RolloutEngine(EngineConfig(model=tiny_models("wan22"), **BACKENDS[request.param])) as engine:
        yield engine


@pytest.fixture(scope="module")
def experts(tiny_models):
    """The trainer's copy of both experts."""
    from rollout.pipelines.loading import load_adapter

    return load_adapter(tiny_models("wan22")).denoisers


def _videos(engine, **params) -> list[torch.Tensor]:
    p = WAN22.params(cfg=True, sampler="ode", num_inference_steps=4, num_samples=2, seed=5, **params)
    return [o.trajectory.latents.stack() for o in engine.generate(["a red square", "a blue circle"], p)]


def _high_noise_positions(engine) -> int:
    """Latent positions 0..k come from steps the high-noise expert ran (before the boundary)."""
    (output,) = engine.generate("x", WAN22.params(sampler="ode", num_inference_steps=4, seed=0))
    return int((output.trajectory.timesteps >= 875).sum()) + 1


def _lora(expert: torch.nn.Module, prefix: str, seed: int) -> dict[str, torch.Tensor]:
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(seed)
    expert.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False), "made")
    try:
        return {
            f"{prefix}{k}": v.detach().clone()
            for k, v in get_peft_model_state_dict(expert, adapter_name="made").items()
        }
    finally:
        expert.delete_adapters("made")


def test_each_expert_takes_its_own_weights_and_checksum(engine, experts):
    base = _videos(engine)
    before = {name: engine.weights_checksum(name) for name in EXPERTS}
    assert before == {name: checksum(base_state(module)) for name, module in experts.items()}
    state = {name: t + 0.01 for name, t in base_state(experts["transformer_2"]).items()}
    engine.update_weights(state, component="transformer_2")
    assert engine.weights_checksum("transformer_2") == checksum(state)
    assert engine.weights_checksum("transformer") == before["transformer"]
    changed = _videos(engine)
    k = _high_noise_positions(engine)
    # Only the steps after the boundary (the low-noise expert's) changed.
    assert all(torch.equal(a[:k], b[:k]) and not torch.equal(a[-1], b[-1]) for a, b in zip(base, changed, strict=True))
    bad = dict(state)
    bad[next(iter(bad))] = torch.zeros(3)
    with pytest.raises(ValueError):
        engine.update_weights(bad, component="transformer_2")
    assert engine.weights_checksum("transformer_2") == checksum(state)  # the refused update changed nothing
    engine.update_weights(base_state(experts["transformer_2"]), component="transformer_2")
    assert all(torch.equal(a, b) for a, b in zip(base, _videos(engine), strict=True))


def test_lora_on_one_expert_or_both(engine, experts):
    base = _videos(engine)
    k = _high_noise_positions(engine)
    config = {"r": 4, "lora_alpha": 8, "target_modules": LORA_TARGETS}
    low = _lora(experts["transformer_2"], "transformer_2.", seed=0)
    high = _lora(experts["transformer"], "transformer.", seed=1)
    engine.load_lora("low", low, config)
    engine.load_lora("both", high | low, config)
    try:
        assert engine.lora_modules("both") == 2 * engine.lora_modules("low") > 0
        with_low = _videos(engine, lora="low")
        with_both = _videos(engine, lora="both")
        for a, b, c in zip(base, with_low, with_both, strict=True):
            assert torch.equal(a[:k], b[:k]) and not torch.equal(a[-1], b[-1])  # the high-noise steps ran the base
            assert not torch.equal(a[1], c[1])  # the high-noise expert's adapter acted from the first step
        assert all(torch.equal(a, b) for a, b in zip(base, _videos(engine), strict=True))  # no adapter: the base
        engine.load_lora("low", _lora(experts["transformer_2"], "transformer_2.", seed=2), config)  # hot swap
        assert not torch.equal(with_low[0][-1], _videos(engine, lora="low")[0][-1])
    finally:
        engine.unload_lora("low")
        engine.unload_lora("both")
    assert all(torch.equal(a, b) for a, b in zip(base, _videos(engine), strict=True))


def test_an_adapter_for_a_missing_expert_is_refused(tiny_models, experts):
    tensors = _lora(experts["transformer_2"], "transformer_2.", seed=0)
    config = {"r": 4, "lora_alpha": 8, "target_modules": LORA_TARGETS}
    with RolloutEngine(EngineConfig(model=tiny_models("wan"))) as wan21:  # one transformer
        with pytest.raises(ValueError, match="its keys match no module of the model"):
            wan21.load_lora("low", tensors, config)
        assert wan21.list_loras() == []


def test_sleep_wake_and_abort_leave_the_experts_as_they_were(engine):
    base = _videos(engine)
    checksums = {name: engine.weights_checksum(name) for name in EXPERTS}
    engine.sleep(1)
    engine.wake_up()
    assert {name: engine.weights_checksum(name) for name in EXPERTS} == checksums
    assert all(torch.equal(a, b) for a, b in zip(base, _videos(engine), strict=True))
    ids = engine.add_request("x", WAN22.params(num_inference_steps=6, num_samples=3, seed=1), request_id="cut")
    for _ in range(3):  # past the boundary: the low-noise expert is running them
        engine.step()
    assert sorted(o.request_id for o in engine.abort("cut")) == sorted(ids)
    assert engine.collective_rpc("request_ids") == [[] for _ in range(engine.config.num_workers)]
