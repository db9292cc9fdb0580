"""A colocated trainer's policy over an in-process engine's base weights (`LoraPolicy.sharing_base`):
one copy of the base, re-scoring at ratio one, merges and updates of the engine handled."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from rollout import AsyncRolloutEngine, EngineConfig, RolloutEngine, SamplingParams
from rollout.rescoring import RATIO_TOLERANCE
from rollout.weights.state import base_state
from tests.families import ALL_FAMILIES
from trainers_adapters.policy.lora_policy import LoraPolicy

pytestmark = pytest.mark.timeout(180)

CONFIG = {"r": 4, "lora_alpha": 8, "init_lora_weights": False}
SIZES = {"sd3": {}, "wan22": {"height": 32, "width": 32, "num_frames": 5}, "qwen_image21": {}}


def _engine_denoisers(engine: RolloutEngine) -> dict[str, torch.nn.Module]:
    return engine.executor.worker.adapter.denoisers


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter, buffer and tensor attribute of `module`'s tree."""
    found = []
    for sub in module.modules():
        found += [*sub._parameters.values(), *sub._buffers.values()]
        found += [value for value in vars(sub).values() if isinstance(value, torch.Tensor)]
    return [tensor for tensor in found if tensor is not None]


def resident_bytes(*modules: torch.nn.Module) -> int:
    """Bytes of the distinct storages the modules' tensors live in: what the process holds for them."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for m in modules for t in _tensors(m)}
    return sum(storages.values())


def _peft_name(worker) -> str:
    return worker.loras.peft_name("policy")


def _max_log_ratio(policy: LoraPolicy, outputs) -> float:
    trajectories = [o.trajectory for o in outputs]
    worst = 0.0
    for step in trajectories[0].scorable_steps.tolist():
        with torch.no_grad():
            scored = policy.score(trajectories, step)
        old = torch.stack([t.log_probs[step] for t in trajectories])
        worst = max(worst, (scored.log_prob - old).abs().max().item())
    return worst


# wan22: two experts, each shared; qwen_image21: its rope tables are a list of tensors, not buffers
@pytest.mark.parametrize("family", ["sd3", "wan22", "qwen_image21"])
def test_shared_policy_is_the_engines_storage_rescores_trains_and_pushes(tiny_models, family):
    torch.manual_seed(0)
    with RolloutEngine(EngineConfig(model=tiny_models(family))) as engine:
        policy = LoraPolicy.sharing_base(engine, CONFIG)
        engine_denoisers = _engine_denoisers(engine)
        assert policy.denoisers.keys() == engine_denoisers.keys() and len(policy.denoisers) == (family == "wan22") + 1
        for component, denoiser in policy.denoisers.items():
            mine, theirs = base_state(denoiser), base_state(engine_denoisers[component])
            assert mine.keys() == theirs.keys()
            assert all(mine[name].data_ptr() == theirs[name].data_ptr() for name in mine)
            parameters = {
                n.replace(".base_layer.", "."): p for n, p in denoiser.named_parameters() if ".lora_" not in n
            }
            assert parameters and all(p is not theirs[name] for name, p in parameters.items())
            engine_ptrs = {t.data_ptr() for t in _tensors(engine_denoisers[component])}
            lora = {p.data_ptr() for p in policy.parameters()}
            assert {t.data_ptr() for t in _tensors(denoiser)} - lora <= engine_ptrs
        # The engine's adapters stay in its own trees, the policy's in the policy's.
        version = policy.push(engine)
        layers = {f".lora_A.{engine.collective_rpc(_peft_name)[0]}.", ".lora_A.policy."}
        names = {
            which: [n for d in trees.values() for n, _ in d.named_parameters()]
            for which, trees in [("policy", policy.denoisers), ("engine", engine_denoisers)]
        }
        assert {layer for layer in layers if any(layer in n for n in names["policy"])} == {".lora_A.policy."}
        assert {layer for layer in layers if any(layer in n for n in names["engine"])} == layers - {".lora_A.policy."}
        params = SamplingParams(num_inference_steps=4, num_samples=2, seed=2, lora="policy", **SIZES[family])
        outputs = engine.generate(["a red square", "a blue circle"], params)
        assert all(o.weight_version == version for o in outputs)
        assert _max_log_ratio(policy, outputs) < RATIO_TOLERANCE

        # A train step changes the policy's LoRA only: the shared base stays bitwise.
        checksums = {c: engine.weights_checksum(c) for c in policy.denoisers}
        lora_before = policy.lora_state()
        optimizer = torch.optim.SGD(policy.parameters(), lr=1e-2)
        trajectories = [o.trajectory for o in outputs]
        step = int(trajectories[0].scorable_steps[0])
        policy.score(trajectories, step).log_prob.sum().backward()
        optimizer.step()
        assert {c: engine.weights_checksum(c) for c in policy.denoisers} == checksums
        assert all(p.grad is None for d in policy.denoisers.values() for p in d.parameters() if not p.requires_grad)
        lora_after = policy.lora_state()
        assert any(not torch.equal(lora_before[key], lora_after[key]) for key in lora_before)

        # The trained LoRA reaches the engine, which samples with it; the policy re-scores that at ratio one.
        version = policy.push(engine)
        outputs = engine.generate(["a green triangle"], params)
        assert all(o.weight_version == version for o in outputs)
        assert _max_log_ratio(policy, outputs) < RATIO_TOLERANCE


def test_a_seeded_lora_starts_the_same_over_a_shared_or_a_loaded_base(tiny_models):
    """Loading Wan 2.1's pipeline draws from torch's generator (its text encoder) and sharing the
    engine's base draws nothing: under a seed, the LoRA's initial values are the same either way, so a
    run trains the same with `trainer.share_base` on or off."""
    model = tiny_models("wan")
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_v"]}
    with RolloutEngine(EngineConfig(model=model)) as engine:
        states = []
        makers = (lambda: LoraPolicy(model, config, seed=3), lambda: LoraPolicy.sharing_base(engine, config, seed=3))
        for make in makers:
            torch.manual_seed(0)
            before = torch.random.get_rng_state()
            states.append(make().lora_state())
            if len(states) == 2:  # sharing draws nothing, and the seeded draws leave the generator as it was
                assert torch.equal(torch.random.get_rng_state(), before)
    loaded, shared = states
    assert loaded.keys() == shared.keys() and all(torch.equal(loaded[key], shared[key]) for key in loaded)
    assert any(key for key in loaded if "lora_A" in key and loaded[key].abs().sum() > 0)


def test_a_merged_adapter_never_reaches_the_shared_base(tiny_model):
    """The engine merges out of place (`rollout.lora.merge`: the merged weight is a new tensor its
    own Parameter points at), and the policy's Parameters are its own: the base it re-scores with is
    the pristine one even while the engine runs merged."""
    torch.manual_seed(0)
    with RolloutEngine(EngineConfig(model=tiny_model, merge_lora="always")) as engine:
        engine_denoiser = _engine_denoisers(engine)["transformer"]
        loaded = {name: t.detach().clone() for name, t in base_state(engine_denoiser).items()}
        policy = LoraPolicy.sharing_base(engine, CONFIG)
        policy.push(engine)
        params = SamplingParams(num_inference_steps=4, num_samples=2, seed=2, lora="policy")
        outputs = engine.generate(["a red square", "a blue circle"], params)
        (state,) = engine.collective_rpc("hot_swap_state")
        assert state["merged_lora"] == ("policy", 1.0)  # merged now, as the next rollout would find it
        merged = base_state(engine_denoiser)
        shared = base_state(policy.denoisers["transformer"])
        assert any(not torch.equal(merged[name], loaded[name]) for name in loaded)  # the engine's view
        assert all(torch.equal(shared[name], loaded[name]) for name in loaded)  # bitwise the base
        assert _max_log_ratio(policy, outputs) < RATIO_TOLERANCE
        # Restored (any worker function but a step restores): the engine's base is bitwise as loaded.
        assert engine.weights_checksum() == policy.weights_checksum()
        restored = base_state(engine_denoiser)
        assert all(torch.equal(restored[name], loaded[name]) for name in loaded)
        assert all(restored[name].data_ptr() == shared[name].data_ptr() for name in loaded)


def test_update_weights_reaches_the_shared_policy(tiny_model):
    """The engine swaps updated weights in (new storage) and swaps them into the sharing trees too."""
    torch.manual_seed(0)
    with RolloutEngine(EngineConfig(model=tiny_model)) as engine:
        policy = LoraPolicy.sharing_base(engine, CONFIG)
        engine_denoiser = _engine_denoisers(engine)["transformer"]
        names = [name for name in base_state(engine_denoiser) if name.endswith("to_q.weight")]
        new = {name: torch.randn_like(base_state(engine_denoiser)[name]) for name in names}
        engine.update_weights(new)
        mine, theirs = base_state(policy.denoisers["transformer"]), base_state(engine_denoiser)
        assert all(torch.equal(mine[name], new[name]) for name in names)
        assert all(mine[name].data_ptr() == theirs[name].data_ptr() for name in theirs)
        policy.check_same_base(engine)
        with pytest.raises(ValueError, match="engine.update_weights"):
            policy.load_base_weights(new)
        # A refused update changes neither.
        with pytest.raises(ValueError, match="refused"):
            engine.update_weights({names[0]: torch.randn(3)})
        assert torch.equal(base_state(policy.denoisers["transformer"])[names[0]], new[names[0]])
        policy.push(engine)
        params = SamplingParams(num_inference_steps=3, num_samples=2, seed=1, lora="policy")
        assert _max_log_ratio(policy, engine.generate(["a red square"], params)) < RATIO_TOLERANCE
        with pytest.raises(Exception, match="sleep refused"):
            engine.sleep(1)
        assert engine.generate(["a red square"], params)  # still awake


def test_an_engine_the_policy_cannot_reach_in_process_is_refused(tiny_model):
    """The async engine steps its engine on a thread of its own, between the trainer's forwards: refused
    (as a server's client and the mp and ray executors are)."""
    async_engine = AsyncRolloutEngine(RolloutEngine(EngineConfig(model=tiny_model)))
    try:
        with pytest.raises(ValueError, match="AsyncRolloutEngine.*executor='uni'"):
            LoraPolicy.sharing_base(async_engine, CONFIG)
    finally:
        async_engine.shutdown()


@pytest.mark.slow
def test_an_mp_engine_is_refused(tiny_model):
    with RolloutEngine(EngineConfig(model=tiny_model, executor="mp")) as engine:
        with pytest.raises(ValueError, match="executor 'mp'.*executor='uni'"):
            LoraPolicy.sharing_base(engine, CONFIG)


def test_engine_and_shared_policy_hold_one_copy_of_the_weights(tiny_model):
    """Resident weights of engine + trainer, counted as distinct storages over every tensor of the
    engine's pipeline and the policy's modules: one pipeline's and the LoRA (today's own copy: 2x).
    The profiler (profile_memory, the trainer's thread) agrees: building the shared policy allocates
    the LoRA's bytes only, an own copy a whole pipeline."""
    torch.manual_seed(0)
    with RolloutEngine(EngineConfig(model=tiny_model)) as engine:
        pipeline = list(engine.executor.worker.adapter.components.values())
        one = resident_bytes(*pipeline)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as shared_profile:
            shared = LoraPolicy.sharing_base(engine, CONFIG)
        with_shared = resident_bytes(*pipeline, *shared.denoisers.values())
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as own_profile:
            own = LoraPolicy(tiny_model, CONFIG)
        with_own = resident_bytes(*pipeline, *own.adapter.components.values())
    assert with_shared <= 1.05 * one, (with_shared, one)
    assert with_own >= 1.95 * one, (with_own, one)
    allocated = {
        name: sum(e.self_cpu_memory_usage for e in p.events())
        for name, p in [("shared", shared_profile), ("own", own_profile)]
    }
    assert allocated["shared"] <= 0.05 * one, allocated
    assert allocated["own"] >= 0.95 * one, allocated


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(ALL_FAMILIES))
def test_every_family_rescores_its_samples_over_the_shared_base(tiny_models, family):
    """Each family's denoisers rebuilt over the engine's storage (rope tables in buffers, plain
    tensor attributes or lists of them) re-score the engine's samples with a trained LoRA at ratio one."""
    descriptor = ALL_FAMILIES[family]
    with RolloutEngine(EngineConfig(model=tiny_models(family))) as engine:
        policy = LoraPolicy.sharing_base(engine, CONFIG, seed=0)
        policy.push(engine)
        params = descriptor.params(num_inference_steps=3, num_samples=2, seed=2, lora="policy")
        outputs = engine.generate(["a red square"], params, **descriptor.inputs())
        assert _max_log_ratio(policy, outputs) < RATIO_TOLERANCE
