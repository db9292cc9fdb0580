"""Input images from a careless or hostile client: a PNG that decodes to gigabytes, images sent to a
model that takes none, more images than a request may carry, an edit whose input image makes
every forward pass of the model as long as the biggest output, and one that names an adapter the
server has not loaded. Each is refused from the image's header, before anything is decoded, within
a good request's time and naming the limit; the server's peak memory stays where it was, a good
request beside it gives the same bytes as alone, and /health answers throughout. Decodes run on
threads of their own: another request's admission never waits behind them. A PNG whose data ends
before its rows do is refused."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from benchmarks.serve_probes import png_of_zeros
from rollout import RemoteRolloutEngine, SamplingParams
from rollout.http.wire import SAFETENSORS_MEDIA_TYPE, tensors_to_bytes
from rollout.serve.launch import ServerProcess
from tests.families import FAMILIES, input_image
from tests.serve.conftest import API_KEY, EXTENSION_FLAGS
from tests.serve.probing import refused_beside_a_good_request

pytestmark = pytest.mark.timeout(240)

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def image_body(request: dict, images: dict[str, bytes | torch.Tensor]) -> bytes:
    """A generate body with input images: PNG files' bytes (names ending .png) or uint8 tensors."""
    tensors = {
        name: torch.frombuffer(bytearray(image), dtype=torch.uint8) if isinstance(image, bytes) else image
        for name, image in images.items()
    }
    return tensors_to_bytes(tensors, {"request": json.dumps(request)})


def post_images(server, request: dict, images: dict) -> tuple[httpx.Response, float]:
    headers = {**AUTH, "content-type": SAFETENSORS_MEDIA_TYPE}
    body = image_body(request, images)
    start = time.monotonic()
    response = httpx.post(f"{server.url}/rollout/generate", content=body, headers=headers, timeout=60)
    return response, time.monotonic() - start


def test_a_png_bomb_sent_to_a_model_that_takes_no_images_is_never_decoded(server, remote):
    """A 17 KB PNG of a 12000 x 12000 1-bit image decodes to 2 GB (PIL only warns); SD3 takes no
    input images: the server says so from the body's names and the PNG's header."""
    bomb = png_of_zeros(12000, 12000)
    assert len(bomb) < 20_000
    params = SamplingParams(num_inference_steps=4, seed=11)
    request = {"prompts": "x", "params": {"num_inference_steps": 2, "seed": 0}}
    refused_beside_a_good_request(
        server,
        remote,
        lambda: remote.generate("fine", params),
        lambda: post_images(server, request, {"images.0.0.png": bomb}),
        400,
        "StableDiffusion3Pipeline takes no input images",
        peak_mb=100,  # decoding it took 2 GB
    )


KONTEXT = FAMILIES["flux_kontext"]


@pytest.fixture(scope="module")
def kontext_server(tiny_models):
    with ServerProcess.start(tiny_models("flux_kontext"), *EXTENSION_FLAGS, api_key=API_KEY) as running:
        yield running


@pytest.fixture
def kontext_remote(kontext_server):
    with RemoteRolloutEngine(kontext_server.url, api_key=API_KEY) as client:
        yield client


def good_edit(remote: RemoteRolloutEngine):
    params = KONTEXT.params(num_inference_steps=4, seed=12)
    return lambda: remote.generate("make it red", params, images=[[input_image(3)]])


@pytest.mark.slow  # a Kontext server of its own: 10-15 s
@pytest.mark.parametrize(
    "side, refusal",
    [
        (
            4096,
            "the output's 1024 pixels plus the 16777216 its input images are encoded at (every forward pass sees "
            "both) is above this engine's limit of 16777216 (RequestLimits.max_pixels; a server's --max-pixels)",
        ),
        (
            4088,
            "would run one unit of work (vae: encoder.mid_block.attentions.0) for about ",
        ),
    ],
)
def test_an_edit_whose_input_image_is_as_big_as_the_largest_output_is_refused(
    kontext_server, kontext_remote, side, refusal
):
    """Kontext with auto_resize off encodes its image at its own size: one of 4096 x 4096 (exactly
    --max-pixels) beside a 32 x 32 output once ran a tiny model's first step past the step timeout,
    and the engine was dead for everyone. The image counts against --max-pixels with the output.
    One of 4088 x 4088 is within it, and did the same (issue 50): its VAE's mid-block attention over
    4 million latent pixels is one unit of work longer than the step timeout, which admission now
    bounds, from what the engine measured at start, naming the limit and the size that fits."""
    image = png_of_zeros(side, side, colour=True)
    params = {"num_inference_steps": 2, "seed": 0, "auto_resize": False, "height": 32, "width": 32}
    request = {"prompts": "make it red", "params": {**params, "guidance_scale": 3.5}}
    refused_beside_a_good_request(
        kontext_server,
        kontext_remote,
        good_edit(kontext_remote),
        lambda: post_images(kontext_server, request, {"images.0.0.png": image}),
        400,
        refusal,
    )
    if side == 4088:
        answer = post_images(kontext_server, request, {"images.0.0.png": image})[0].json()["error"]["message"]
        assert "a quarter of step_timeout_s=600 (EngineConfig.step_timeout_s; a server's --step-timeout-s)" in answer
        assert "send input images of at most about" in answer


@pytest.mark.slow  # the Kontext server of the test above
def test_an_edit_s_image_bomb_and_too_many_images_are_refused_before_decoding(kontext_server, kontext_remote):
    """An edit family takes images, so the PNG's header is what refuses the bomb: above
    --max-input-pixels. And a request may carry at most --max-input-images images in all."""
    request = {"prompts": "make it red", "params": {"num_inference_steps": 2, "seed": 0}}
    refused_beside_a_good_request(
        kontext_server,
        kontext_remote,
        good_edit(kontext_remote),
        lambda: post_images(kontext_server, request, {"images.0.0.png": png_of_zeros(12000, 12000)}),
        400,
        "input image 0 of prompt 0 (12000x12000 = 144000000 pixels) is above this engine's limit of 16777216 "
        "(RequestLimits.max_input_pixels; a server's --max-input-pixels)",
        peak_mb=100,
    )
    many = {"prompts": ["make it red"] * 17, "params": {"num_inference_steps": 2, "seed": 0}}
    small = png_of_zeros(32, 32, colour=True)
    response, _ = post_images(kontext_server, many, {f"images.{p}.0.png": small for p in range(17)})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "17 input images is above this engine's limit of 16 (RequestLimits.max_input_images; a server's " in message


@pytest.mark.slow  # the Kontext server of the tests above
def test_an_adapter_that_is_not_loaded_is_refused_before_any_image_is_decoded(kontext_server, kontext_remote):
    """Eight bodies of 16 PNGs of 4096 x 4096 naming an adapter the server does not have took its RSS up
    5.9 GB: every image was decoded before the adapter was looked up. It is checked with the sizes."""
    bomb = png_of_zeros(4096, 4096)  # 2 KB, 48 MiB decoded
    request = {"prompts": ["make it red"] * 16, "params": {"num_inference_steps": 1, "lora": "absent"}}
    refused_beside_a_good_request(
        kontext_server,
        kontext_remote,
        good_edit(kontext_remote),
        lambda: post_images(kontext_server, request, {f"images.{p}.0.png": bomb for p in range(16)}),
        400,
        "lora 'absent' is not loaded; loaded: []",
        peak_mb=100,  # 16 decoded: 805 MB and more
    )


@pytest.fixture
def patient_kontext_server(tiny_models):
    """A Kontext server whose step timeout admits a 2048 x 2048 input image: at the default one,
    admission refuses it from its header (its VAE attention would outlast a quarter of it)."""
    flags = (*EXTENSION_FLAGS, "--step-timeout-s", "100000")
    with ServerProcess.start(tiny_models("flux_kontext"), *flags, api_key=API_KEY) as running:
        yield running


@pytest.mark.slow  # a Kontext server of its own; 64 decodes
def test_admission_never_waits_behind_other_requests_decodes(patient_kontext_server):
    """Decodes and every request's checks shared asyncio's default pool: with it full of decodes, a
    text-only generate's params check waited for them (57 s in the issue's probe). Here 64 bodies of
    one 2048 x 2048 PNG each are decoded (then refused: their request_id is taken), and a request the
    admission's checks refuse is answered meanwhile as at once (0.13 s, where it waited 1.3-3.1 s)."""
    holder = RemoteRolloutEngine(patient_kontext_server.url, api_key=API_KEY)
    holder.add_request("holder", KONTEXT.params(num_inference_steps=1000, seed=0), request_id="held")
    png = png_of_zeros(2048, 2048)
    request = {"prompts": "make it red", "request_id": "held", "params": {"num_inference_steps": 1}}
    bad = {"prompts": ["x"], "params": {"output_type": "nonsense"}}
    try:
        with ThreadPoolExecutor(64) as pool:
            decoding = [
                pool.submit(post_images, patient_kontext_server, request, {"images.0.0.png": png}) for _ in range(64)
            ]
            time.sleep(1.0)  # the bodies are in, their decodes queued
            start = time.monotonic()
            refused = httpx.post(f"{patient_kontext_server.url}/rollout/generate", json=bad, headers=AUTH, timeout=60)
            refused_s = time.monotonic() - start
            still_decoding = sum(not future.done() for future in decoding)
            answers = [future.result()[0] for future in decoding]
    finally:
        holder.abort("held")
        holder.shutdown()
    assert refused.status_code == 400 and "output_type must be one of" in refused.text, refused.text
    assert still_decoding > 0  # it was answered while the decodes went on
    assert refused_s < 0.75, refused_s  # before: 1.3-3.1 s
    assert {answer.status_code for answer in answers} == {400}
    assert all("request_id 'held' is refused" in answer.text for answer in answers)


@pytest.mark.slow  # the Kontext server of the tests above
def test_a_png_whose_data_ends_before_its_rows_is_refused(kontext_server, kontext_remote):
    """A PNG whose IHDR says 64 x 64 with a whole zlib stream of 8 rows was taken, its 56 missing
    rows read as black; a cut-off file is refused, and so is this one now."""
    request = {"prompts": "make it red", "params": {"num_inference_steps": 1, "seed": 0, "auto_resize": False}}
    short = png_of_zeros(64, 64, colour=True, rows=8)
    response, _ = post_images(kontext_server, request, {"images.0.0.png": short})
    assert response.status_code == 400, response.text
    assert "'images.0.0.png' is not a whole PNG file: its image data inflates to 1544 bytes" in response.text
    assert "needs 12352: rows are missing" in response.text
    whole, _ = post_images(kontext_server, request, {"images.0.0.png": png_of_zeros(64, 64, colour=True)})
    assert whole.status_code == 200, whole.text
    assert kontext_remote.server_info()["unfinished_requests"] == 0
