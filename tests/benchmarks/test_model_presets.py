"""The real benchmark preset's transformer configs are the published models' (checked on the meta
device: no memory, no download), and the small preset builds pipelines the engine loads."""

from __future__ import annotations

import pytest
import torch

from benchmarks.model_presets import (
    FLUX1_DEV,
    FLUX2_KLEIN_4B,
    FLUX2_KLEIN_9B,
    QWEN_IMAGE,
    SD35_MEDIUM,
    WAN21_T2V_1_3B,
    WAN21_T2V_14B,
    WAN22_T2V_A14B_EXPERT,
    Z_IMAGE_TURBO,
    build,
)
from rollout.pipelines.families import FAMILIES
from rollout.pipelines.families.qwen_image_edit.tiny import QWEN_IMAGE_EDIT_2511
from tests.families import slow_family

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "class_name, config, billions",
    [
        ("SD3Transformer2DModel", SD35_MEDIUM, 2.24),
        ("FluxTransformer2DModel", FLUX1_DEV, 11.9),
        ("QwenImageTransformer2DModel", QWEN_IMAGE, 20.4),
        ("Flux2Transformer2DModel", FLUX2_KLEIN_4B, 3.88),  # FLUX.2 [klein] 4B
        ("Flux2Transformer2DModel", FLUX2_KLEIN_9B, 9.08),  # FLUX.2 [klein] 9B
        ("WanTransformer3DModel", WAN21_T2V_1_3B, 1.42),  # Wan 2.1 T2V 1.3B
        ("WanTransformer3DModel", WAN21_T2V_14B, 14.3),  # Wan 2.1 T2V 14B
        ("WanTransformer3DModel", WAN22_T2V_A14B_EXPERT, 14.3),  # each of Wan 2.2 T2V A14B's two experts
        ("ZImageTransformer2DModel", Z_IMAGE_TURBO, 6.15),  # Z-Image-Turbo (and Z-Image): "6B"
        # Qwen-Image-Edit's and -2509's configs are Qwen-Image's (above); -2511's adds zero_cond_t, no parameters.
        ("QwenImageTransformer2DModel", QWEN_IMAGE_EDIT_2511, 20.4),
    ],
)
def test_real_transformers_have_the_published_size(class_name, config, billions):
    import diffusers

    with torch.device("meta"):
        transformer = getattr(diffusers, class_name)(**config)
    parameters = sum(p.numel() for p in transformer.parameters()) / 1e9
    assert parameters == pytest.approx(billions, rel=0.02)


@pytest.mark.parametrize("family", [pytest.param(f.name, marks=slow_family(f)) for f in FAMILIES])
def test_small_preset_builds_a_loadable_pipeline(tmp_path, family):
    from rollout.pipelines.loading import load_adapter

    build(family, "small", tmp_path / family, "cpu", torch.float32)
    adapter = load_adapter(tmp_path / family)
    assert adapter.spec.size_multiple <= 64 and sum(p.numel() for p in adapter.transformer.parameters()) > 1e6
    assert len(adapter.denoisers) == (2 if family in ("wan22", "wan22_i2v") else 1)  # Wan 2.2: two experts


def test_the_edit_presets_are_qwen_images_transformer():
    from benchmarks.model_presets import QWEN_IMAGE
    from rollout.pipelines.families.qwen_image_edit.tiny import QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_2509

    assert QWEN_IMAGE_EDIT == QWEN_IMAGE_EDIT_2509 == QWEN_IMAGE
    assert QWEN_IMAGE_EDIT_2511 == {**QWEN_IMAGE, "zero_cond_t": True}
