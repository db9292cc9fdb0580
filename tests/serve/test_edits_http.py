"""Edits over HTTP: input images travel in a safetensors body (uint8 tensors, or PNG files' bytes),
and what comes back is bitwise what the engine gives in process, encoded images included."""

from __future__ import annotations

import dataclasses
import io
import json

import httpx
import pytest
import torch
from PIL import Image

from rollout import EngineConfig, RemoteRolloutEngine, RolloutEngine
from rollout.http.wire import FRAMES_MEDIA_TYPE, SAFETENSORS_MEDIA_TYPE, FrameReader, OutputDecoder, tensors_to_bytes
from rollout.serve.launch import ServerProcess
from tests.families import FAMILIES, input_image
from tests.serve.conftest import API_KEY
from tests.serve.test_generate_http import assert_same_output

pytestmark = pytest.mark.timeout(240)

KONTEXT = FAMILIES["flux_kontext"]


def test_a_text_to_image_server_refuses_images_with_the_engines_words(remote):
    params = FAMILIES["sd3"].params(num_inference_steps=2)
    with pytest.raises(ValueError, match="StableDiffusion3Pipeline takes no input images.*flux_kontext"):
        remote.generate("x", params, images=[[input_image(0)]])


@pytest.fixture(scope="module")
def kontext_server(tiny_models):
    with ServerProcess.start(tiny_models("flux_kontext"), api_key=API_KEY) as running:
        yield running


@pytest.mark.slow
def test_edits_over_http_equal_in_process_bitwise(kontext_server, tiny_models):
    prompts = ["make it red", "make it blue", "a text-only one"]
    params = KONTEXT.params(cfg=True, num_inference_steps=3, num_samples=2, seed=5)
    images = [[input_image(0)], [input_image(1, 24, 40)], None]
    with RolloutEngine(EngineConfig(model=tiny_models("flux_kontext"))) as engine:
        expected = engine.generate(prompts, params, images=images)
        one = dataclasses.replace(params, num_samples=1)
        engine.add_request("alone", one, images=[input_image(2)], request_id="alone")
        finished = []
        while engine.has_unfinished_requests():
            finished += engine.step()
        (expected_added,) = finished
    with RemoteRolloutEngine(kontext_server.url, api_key=API_KEY) as remote:
        got = remote.generate(prompts, params, images=images)
        remote.add_request("alone", one, images=[input_image(2)], request_id="alone")
        (got_added,) = remote.step()
    assert len(got) == len(expected) == 6
    for a, b in zip(got, expected, strict=True):
        assert_same_output(a, b)
    assert got[0].trajectory.condition.images is got[1].trajectory.condition.images  # sent once, shared again
    assert got_added.request_id == expected_added.request_id
    assert_same_output(got_added, expected_added)


@pytest.mark.slow
def test_png_bytes_are_the_same_image_as_its_tensor(kontext_server):
    """A client without torch tensors sends PNG files: the edit is the one of the same pixels."""
    image = input_image(4, 24, 40)
    png = io.BytesIO()
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(png, format="PNG")
    request = {
        "prompts": "make it red",
        "params": {"num_inference_steps": 2, "seed": 3, "sampler": "ode", "auto_resize": False},
    }
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": SAFETENSORS_MEDIA_TYPE}
    answers = []
    for name, tensor in (
        ("images.0.0", image),
        ("images.0.0.png", torch.frombuffer(bytearray(png.getvalue()), dtype=torch.uint8)),
    ):
        body = tensors_to_bytes({name: tensor}, {"request": json.dumps(request)})
        response = httpx.post(f"{kontext_server.url}/rollout/generate", content=body, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith(FRAMES_MEDIA_TYPE)
        decoder, reader = OutputDecoder(), FrameReader()
        frames = list(reader.feed(response.content))
        assert frames[0][0]["kind"] == "requests"
        outputs = [decoder.decode(fields, tensors) for fields, tensors in frames[1:]]
        answers.append([o for o in outputs if o is not None][0])
    assert answers[0].image.shape == (3, 24, 40)
    assert torch.equal(answers[0].image, answers[1].image)
    assert torch.equal(answers[0].trajectory.latents[-1], answers[1].trajectory.latents[-1])
