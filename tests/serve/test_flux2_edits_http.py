"""FLUX.2 [klein] edits over HTTP: reference images go up once per prompt, and what comes back is
bitwise what the engine gives in process; the encoded references come back once per answer,
however many samples the group has."""

from __future__ import annotations

import json

import httpx
import pytest

from rollout import EngineConfig, RemoteRolloutEngine, RolloutEngine
from rollout.http.wire import SAFETENSORS_MEDIA_TYPE, FrameReader, images_to_tensors, tensors_to_bytes
from rollout.input_images import InputImages
from rollout.serve.launch import ServerProcess
from tests.families import FAMILIES, input_image
from tests.serve.conftest import API_KEY
from tests.serve.test_generate_http import assert_same_output

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FLUX2 = FAMILIES["flux2_klein"]
TWO_IMAGES = [input_image(0, 64, 64), input_image(1, 72, 96)]


@pytest.fixture(scope="module")
def flux2_server(tiny_models):
    with ServerProcess.start(tiny_models("flux2_klein"), api_key=API_KEY) as running:
        yield running


def test_flux2_edits_over_http_equal_in_process_bitwise(flux2_server, tiny_models):
    prompts = ["make it red", "make it blue", "a text-only one"]
    params = FLUX2.params(cfg=True, num_inference_steps=2, num_samples=2, seed=5)
    images = [TWO_IMAGES, [input_image(2, 64, 96)], None]
    with RolloutEngine(EngineConfig(model=tiny_models("flux2_klein"))) as engine:
        expected = engine.generate(prompts, params, images=images)
    with RemoteRolloutEngine(flux2_server.url, api_key=API_KEY) as remote:
        got = remote.generate(prompts, params, images=images)
    assert len(got) == len(expected) == 6
    for a, b in zip(got, expected, strict=True):
        assert_same_output(a, b)
    assert got[0].trajectory.condition.images is got[1].trajectory.condition.images  # sent once, shared again
    assert got[4].trajectory.condition.images is None


def conditioning_bytes(url: str, num_samples: int) -> dict[str, int]:
    """Bytes of the conditioning tensors in the answer to one two-reference edit of `num_samples`
    samples, by kind ("images": the encoded references; "text": prompt and negative embeddings)."""
    request = {
        "prompts": "make it red",
        "params": {"num_inference_steps": 2, "num_samples": num_samples, "seed": 3, "height": 32, "width": 32},
    }
    body = tensors_to_bytes(images_to_tensors([InputImages.of(TWO_IMAGES)]), {"request": json.dumps(request)})
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": SAFETENSORS_MEDIA_TYPE}
    response = httpx.post(f"{url}/rollout/generate", content=body, headers=headers, timeout=240)
    assert response.status_code == 200, response.text
    sent = {"images": 0, "text": 0}
    for fields, tensors in FrameReader().feed(response.content):
        if fields["kind"] == "embeds":
            kind = "images" if fields["class"].endswith("Flux2KleinImages") else "text"
            sent[kind] += sum(t.numel() * t.element_size() for t in tensors.values())
    return sent


def test_a_group_gets_its_references_once(flux2_server):
    """A group of 4 edits is sent the same conditioning bytes as one edit: one copy per answer
    (per sample: a quarter), not one per sample."""
    one, group = conditioning_bytes(flux2_server.url, 1), conditioning_bytes(flux2_server.url, 4)
    # 688 reference tokens of 16 float32 channels, and their [688, 4] int64 position ids.
    assert one["images"] == 688 * 16 * 4 + 688 * 4 * 8
    assert group == one and one["text"] > 0
