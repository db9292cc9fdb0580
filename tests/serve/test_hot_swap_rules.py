"""One rule per hot-swap question, the same on every front (issue 37): in process on `uni` and
`mp` (and `ray` in the slow suite), and over HTTP against the shared test server. A LoRA config
without `target_modules` takes the family's default targets; an unknown component is a ValueError
before anything is sent; one dtype rule for weight updates and LoRA loads (a dtype widened exactly
is taken, one that would round is refused); LoRA tensors that share memory load."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.pipelines.loading import load_adapter
from rollout.weights.state import base_state, checksum

pytestmark = pytest.mark.timeout(240)

FRONTS = {
    "uni": {"executor": "uni"},
    "mp": {"executor": "mp", "num_workers": 2},
    "ray": {"executor": "ray", "num_workers": 2},
    "http": None,
}
PARAMS = SamplingParams(num_inference_steps=2, num_samples=1, seed=3)


@pytest.fixture(
    scope="module", params=[pytest.param(name, marks=pytest.mark.slow) if name == "ray" else name for name in FRONTS]
)
def front(request, tiny_model):
    """An engine on the tiny SD3: in process on a backend, or the test server's client."""
    if request.param == "http":
        client = request.getfixturevalue("remote_client")
        yield client
        return
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    with RolloutEngine(EngineConfig(model=tiny_model, **FRONTS[request.param])) as engine:
        yield engine


@pytest.fixture(scope="module")
def remote_client(server):
    from rollout import RemoteRolloutEngine
    from tests.serve.conftest import API_KEY

    with RemoteRolloutEngine(server.url, api_key=API_KEY) as client:
        yield client


@pytest.fixture(scope="module")
def model(tiny_model):
    """A trainer's copy of the model, its transformer's weights, and a random rank-4 adapter on
    the family's default targets (what `LoraPolicy` builds from a config without them)."""
    adapter = load_adapter(tiny_model)
    weights = {name: tensor.detach().clone() for name, tensor in base_state(adapter.transformer).items()}
    torch.manual_seed(0)
    targets = set(adapter.default_lora_targets)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    adapter.transformer.add_adapter(config, adapter_name="made")
    state = get_peft_model_state_dict(adapter.transformer, adapter_name="made")
    lora = {key: value.detach().clone() for key, value in state.items()}
    return weights, lora, sorted(targets)


def _image(front, lora: str | None) -> torch.Tensor:
    return front.generate("a red square", dataclasses.replace(PARAMS, lora=lora))[0].image


def test_a_lora_config_without_target_modules_takes_the_family_defaults(front, model):
    """LoraPolicy accepts {"r": 4, "lora_alpha": 8}; so does load_lora (today: TypeError 'argument
    of type NoneType is not iterable' from PEFT's target matching)."""
    _, lora, targets = model
    front.load_lora("named", lora, {"r": 4, "lora_alpha": 8, "target_modules": targets})
    front.load_lora("defaults", lora, {"r": 4, "lora_alpha": 8})
    try:
        assert front.lora_modules("defaults") == front.lora_modules("named") > 0
        assert torch.equal(_image(front, "defaults"), _image(front, "named"))
        assert not torch.equal(_image(front, "defaults"), _image(front, None))
    finally:
        front.unload_lora("defaults")
        front.unload_lora("named")


def test_an_unknown_component_is_a_value_error_before_anything_is_sent(front, model, tmp_path):
    weights, _, _ = model
    read = []

    def tensors():
        read.append("read")  # the push would have started sending
        yield from weights.items()

    unknown = r"unknown component 'unet'; this model has \[.*'transformer'.*\]"
    version = front.weight_version
    with pytest.raises(ValueError, match=unknown):
        front.update_weights(tensors(), component="unet")
    with pytest.raises(ValueError, match=unknown):
        front.update_weights_from_disk(tmp_path / "absent.safetensors", component="unet")
    with pytest.raises(ValueError, match=unknown):
        front.weights_checksum("unet")
    assert read == [] and front.weight_version == version


def test_one_dtype_rule_for_weight_updates_and_lora_loads(front, model):
    """A tensor is taken in its target's dtype or widened exactly (bfloat16 into the float32 model
    and into the float32 LoRA layers); one that would round (float64) is refused by both. Today
    update_weights refuses bfloat16 while load_lora takes float64 and rounds it."""
    weights, lora, targets = model
    config = {"r": 4, "lora_alpha": 8, "target_modules": targets}
    version = front.weight_version
    name = next(iter(weights))
    with pytest.raises(ValueError, match=rf"{name}: expected .* float32, got .* float64 \(a tensor is taken in"):
        front.update_weights({name: weights[name].double()})
    assert front.weight_version == version
    as_bfloat16 = {key: tensor.bfloat16() for key, tensor in weights.items()}
    front.update_weights(as_bfloat16)
    try:
        assert front.weights_checksum() == checksum({key: t.float() for key, t in as_bfloat16.items()})
    finally:
        front.update_weights(weights, version=version)
    assert front.weights_checksum() == checksum(weights)

    key = sorted(lora)[0]
    with pytest.raises(ValueError, match=rf"LoRA 'policy' refused: .*not exactly float32 values: \['{key} "):
        front.load_lora("policy", {**lora, key: lora[key].double()}, config)
    assert "policy" not in front.list_loras()
    front.load_lora("policy", {k: t.bfloat16() for k, t in lora.items()}, config)
    widened = _image(front, "policy")
    front.load_lora("policy", {k: t.bfloat16().float() for k, t in lora.items()}, config)  # the same values
    try:
        assert torch.equal(_image(front, "policy"), widened)
    finally:
        front.unload_lora("policy")


def test_lora_tensors_that_share_memory_load_on_every_front(front, model):
    """One tensor under two names (a trainer that ties two modules' factors): in process it always
    loaded; over HTTP safetensors refused to write it."""
    _, lora, targets = model
    config = {"r": 4, "lora_alpha": 8, "target_modules": targets}
    a_keys = sorted(key for key in lora if ".lora_A." in key)
    shared = dict(lora)
    first_shape = [key for key in a_keys if lora[key].shape == lora[a_keys[0]].shape]
    for key in first_shape[1:]:
        shared[key] = shared[first_shape[0]]  # the very same tensor
    assert len(first_shape) > 1
    copies = {key: tensor.clone() for key, tensor in shared.items()}
    front.load_lora("shared", shared, config)
    expected = _image(front, "shared")
    front.load_lora("shared", copies, config)
    try:
        assert torch.equal(_image(front, "shared"), expected)
    finally:
        front.unload_lora("shared")


def test_trajectories_carry_the_lora_scale_they_were_sampled_at(front, model):
    _, lora, targets = model
    front.load_lora("scaled", lora, {"r": 4, "lora_alpha": 8, "target_modules": targets})
    try:
        params = dataclasses.replace(PARAMS, lora="scaled", lora_scale=0.5)
        scaled, base = front.generate(["a", "b"], [params, PARAMS])
    finally:
        front.unload_lora("scaled")
    assert scaled.trajectory.lora_scale == 0.5 and scaled.lora == "scaled"
    assert base.trajectory.lora_scale is None and base.lora is None


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> str:
    """Another tiny SD3 folder: the same architecture, other random weights."""
    from tests.families import ALL_FAMILIES

    return str(ALL_FAMILIES["sd3"].build_tiny(tmp_path_factory.mktemp("other_sd3") / "pipeline", seed=1))


def test_a_policy_on_another_model_folder_is_refused_when_the_run_starts(front, tiny_model, other_model):
    from trainers_adapters.policy.lora_policy import LoraPolicy

    LoraPolicy(tiny_model, {"r": 4, "lora_alpha": 8}).check_same_base(front)
    stranger = LoraPolicy(other_model, {"r": 4, "lora_alpha": 8})
    with pytest.raises(ValueError, match=rf"not this policy's \(transformer: .*loaded '{other_model}' in float32"):
        stranger.check_same_base(front)


def test_the_training_recipe_checks_the_servers_model_first(server, other_model, tmp_path, monkeypatch):
    """A recipe whose model.path is not the server's model: refused at the start (today: it trained
    on until the ratio drifted), before any rollout or metrics line."""
    from pathlib import Path

    import recipes.config
    from recipes.grpo import run
    from recipes.loading import load_config
    from tests.serve.conftest import API_KEY

    config = Path(recipes.config.__file__).parent / "configs" / "grpo_tiny.yaml"
    settings = [f"model.path={other_model}", f"output_dir={tmp_path}", f"engine.url={server.url}", "steps=1"]
    monkeypatch.setenv("ROLLOUT_API_KEY", API_KEY)
    with pytest.raises(ValueError, match="the engine's base weights are not this policy's"):
        run(load_config(config, settings))
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text()


def test_a_lora_that_binds_no_module_is_refused(front):
    """A LoRA with no tensors and target_modules ["to_q"] was taken: it bound 0 modules, bumped the
    version, and every request that picked it sampled the base policy (a base push of no tensors
    was refused already). Refused now, naming its targets and what the model has for them."""
    version, loras = front.weight_version, front.list_loras()
    message = (
        r"LoRA 'empty' refused: it holds no tensors, so it would bind no module \(target_modules \['to_q'\]\); "
        r"the model has \d+ modules it targets \(e\.g\. \['transformer_blocks\.0\.attn\.to_q'"
    )
    with pytest.raises(ValueError, match=message):
        front.load_lora("empty", {}, {"r": 4, "lora_alpha": 8, "target_modules": ["to_q"]})
    with pytest.raises(ValueError, match=r"it holds no tensors.*the model has no module it targets; LoRA targets"):
        front.load_lora("empty", {}, {"r": 4, "lora_alpha": 8, "target_modules": ["no_such_module"]})
    assert front.weight_version == version and front.list_loras() == loras


def test_a_push_may_name_the_current_version_only_to_repeat_its_weights(front, model):
    """A push could take the current version for other weights (two trainers of one server counting
    alike): samples before and after carried one version for two policies. Now only a push that
    repeats what the engine holds exactly (a LoRA load of the live adapter, a weight update of the
    weights) may name it (a resumed trainer re-pushing its checkpoint to the server that held it),
    and that changes nothing. A version past 64 bits is refused: a
    4300-digit one was taken, and the server then answered every route, /health too, with a 500."""
    weights, lora, targets = model
    config = {"r": 4, "lora_alpha": 8, "target_modules": targets}
    version = front.load_lora("policy", lora, config)
    try:
        image = _image(front, "policy")
        repeated = {key: tensor.clone() for key, tensor in lora.items()}
        assert front.load_lora("policy", repeated, config, version=version) == version
        other = {key: tensor * 2 for key, tensor in lora.items()}
        current = rf"version {version} is this engine's current weight version: .*pass {version + 1} or none"
        with pytest.raises(ValueError, match=current):
            front.load_lora("policy", other, config, version=version)
        with pytest.raises(ValueError, match=current):
            front.load_lora("policy", lora, {**config, "lora_alpha": 4}, version=version)
        with pytest.raises(ValueError, match=current):
            front.update_weights({name: tensor * 2 for name, tensor in weights.items()}, version=version)
        assert front.update_weights(weights, version=version) == version  # the weights it holds: unchanged
        too_big = "version.*(64-bit signed integer|less than or equal to 9223372036854775807)"  # the engine's, or 422
        for huge in (1 << 63, 10**4299):
            with pytest.raises(ValueError, match=too_big):
                front.load_lora("policy", other, config, version=huge)
        assert front.weight_version == version
        assert torch.equal(_image(front, "policy"), image)
    finally:
        front.unload_lora("policy")
