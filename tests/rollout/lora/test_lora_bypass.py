"""LoRA layers that are off run as their base layers: the base and a merged adapter compute bitwise
what PEFT's forwards compute (and the base what the model without adapters computes), while the
module tree, the state dict and the adapters stay PEFT's; `restore` puts PEFT's forwards back."""

from __future__ import annotations

import pytest
import torch
from diffusers import SD3Transformer2DModel
from peft.tuners.lora import LoraLayer

from rollout.lora.bypass import BypassedLoraLayers
from rollout.lora.manager import LoraManager
from rollout.pipelines.loading import load_adapter
from rollout.weights.state import base_state, checksum
from trainers_adapters.policy.lora_policy import LoraPolicy

pytestmark = pytest.mark.timeout(120)

CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"], "init_lora_weights": False}


@pytest.fixture(scope="module")
def adapter(tiny_model) -> tuple[dict[str, torch.Tensor], dict]:
    torch.manual_seed(0)
    policy = LoraPolicy(tiny_model, CONFIG)
    return policy.lora_state(), policy.lora_config


@pytest.fixture
def transformer(tiny_model) -> SD3Transformer2DModel:
    """The transformer as the engine loads it (weights frozen: see PipelineAdapter.load)."""
    return load_adapter(tiny_model).transformer.eval()


@pytest.fixture(autouse=True)
def two_threads():
    """Two threads, as on the machines where a frozen and a grad-requiring weight took torch's matmul
    through kernels 6e-8 apart (one thread ran both alike and hid it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _forward(transformer: SD3Transformer2DModel) -> torch.Tensor:
    config = transformer.config
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        (output,) = transformer(
            hidden_states=torch.randn(2, config.in_channels, 8, 8, generator=generator),
            encoder_hidden_states=torch.randn(2, 5, config.joint_attention_dim, generator=generator),
            pooled_projections=torch.randn(2, config.pooled_projection_dim, generator=generator),
            timestep=torch.tensor([500.0, 250.0]),
            return_dict=False,
        )
    return output


def _lora_layers(transformer) -> list[LoraLayer]:
    return [module for module in transformer.modules() if isinstance(module, LoraLayer)]


def _bypassed(layer: LoraLayer) -> bool:
    return "forward" in vars(layer)


def test_the_base_and_a_merged_adapter_run_bypassed_and_compute_what_peft_does(transformer, adapter):
    without_adapters = _forward(transformer)
    names = list(base_state(transformer))
    loras = LoraManager({"transformer": transformer}, merge=True)
    loras.stage("a", *adapter)
    loras.commit("a")
    layers = _lora_layers(transformer)
    assert layers and not any(map(_bypassed, layers))

    loras.activate(None, 1.0)
    assert all(map(_bypassed, layers))
    assert torch.equal(_forward(transformer), without_adapters)
    assert list(base_state(transformer)) == names and loras.bound_modules("a") == len(layers)  # PEFT's tree

    loras.activate("a", 0.5)
    assert loras.merged == ("a", 0.5) and all(map(_bypassed, layers))
    merged = _forward(transformer)
    loras.set_merge(False)
    loras.activate("a", 0.5)
    assert not any(map(_bypassed, layers))
    torch.testing.assert_close(merged, _forward(transformer), rtol=0, atol=1e-5)  # PEFT's two matmuls
    assert not torch.equal(merged, without_adapters)  # the adapter ran, merged


def test_a_bypassed_layer_computes_bitwise_what_peft_off_computes(transformer, adapter):
    loras = LoraManager({"transformer": transformer})
    loras.stage("a", *adapter)
    loras.commit("a")
    transformer.disable_lora()
    peft_off = _forward(transformer)
    bypassed = BypassedLoraLayers(transformer)
    assert all(map(_bypassed, _lora_layers(transformer)))
    assert torch.equal(_forward(transformer), peft_off)
    bypassed.put_back()
    bypassed.put_back()  # twice: nothing more
    assert not any(map(_bypassed, _lora_layers(transformer)))
    assert torch.equal(_forward(transformer), peft_off)


def test_an_unmerged_adapter_runs_peft_forwards_and_restore_puts_them_back(transformer, adapter):
    loras = LoraManager({"transformer": transformer}, merge=False)
    loras.stage("a", *adapter)
    loras.commit("a")
    layers = _lora_layers(transformer)
    loras.activate(None, 1.0)
    base = _forward(transformer)
    loras.activate("a", 1.0)
    assert not any(map(_bypassed, layers))
    assert not torch.equal(_forward(transformer), base)
    loras.activate(None, 1.0)
    assert all(map(_bypassed, layers)) and torch.equal(_forward(transformer), base)
    loras.restore()
    assert not any(map(_bypassed, layers)) and torch.equal(_forward(transformer), base)


def test_a_load_and_an_unload_while_bypassed_leave_peft_whole(transformer, adapter):
    """A new adapter's layers build into PEFT's wrappers (bypassed or not, the tree is the same)
    and run once picked; an unload frees them; the base stays bitwise throughout."""
    tensors, config = adapter
    loras = LoraManager({"transformer": transformer}, merge=True)
    loras.stage("a", tensors, config)
    loras.commit("a")
    digest = checksum(base_state(transformer))
    loras.activate(None, 1.0)
    base = _forward(transformer)
    loras.stage("b", {key: tensor * 2 for key, tensor in tensors.items()}, config)
    loras.commit("b")
    loras.activate("b", 1.0)
    assert loras.merged == ("b", 1.0) and not torch.equal(_forward(transformer), base)
    loras.activate(None, 1.0)
    loras.unload("b")
    loras.unload("a")
    assert not any(map(_bypassed, _lora_layers(transformer)))
    assert torch.equal(_forward(transformer), base) and checksum(base_state(transformer)) == digest
