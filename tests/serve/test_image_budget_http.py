"""The server's budget for decoded input images (issue 50): bounded per body only, eight bodies of 16
PNGs of 4096 x 4096 (276 KB sent in all) took the server's RSS up 5.9 GB. Every request's images
take their decoded size from one budget for the whole server (--input-image-budget-mb) before they
are decoded, and give it back when the request's answer ends: requests whose images do not fit wait
their turn, and one over the whole budget is a 413 at once. On a FLUX.1 Kontext server of its own
whose budget holds two 64 x 64 images."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from benchmarks.serve_probes import png_of_zeros
from rollout import RemoteRolloutEngine
from rollout.serve.launch import ServerProcess
from tests.families import FAMILIES
from tests.serve.conftest import API_KEY, EXTENSION_FLAGS
from tests.serve.probing import PeakMemory
from tests.serve.test_input_images_http import post_images

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # a Kontext server of its own: 10-15 s

KONTEXT = FAMILIES["flux_kontext"]
IMAGE = torch.arange(3 * 64 * 64, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(3, 64, 64)
BUDGET_BYTES = int(2.5 * IMAGE.numel())  # two such images, not three


@pytest.fixture(scope="module")
def server(tiny_models):
    budget_mb = str(BUDGET_BYTES / 2**20)
    # A step timeout that admits a 4096 x 4096 image's work: what refuses it here is the budget.
    flags = (*EXTENSION_FLAGS, "--input-image-budget-mb", budget_mb, "--step-timeout-s", "100000")
    with ServerProcess.start(tiny_models("flux_kontext"), *flags, api_key=API_KEY) as running:
        yield running


def test_images_over_the_whole_budget_are_refused_before_they_are_decoded(server):
    params = {"num_inference_steps": 1, "auto_resize": True}  # encoded at 1 MP: within --max-pixels
    request = {"prompts": ["make it red"] * 16, "params": params}
    bomb = png_of_zeros(4096, 4096)  # 2 KB, 48 MiB decoded
    with PeakMemory(server.process.pid) as memory:
        response, seconds = post_images(server, request, {f"images.{p}.0.png": bomb for p in range(16)})
    assert response.status_code == 413, response.text
    message = response.json()["error"]["message"]
    assert "the request's input images take 768 MiB decoded, over this server's budget of 0.0293 MiB" in message
    assert "(--input-image-budget-mb)" in message
    assert memory.growth_mb < 100 and seconds < 5, (memory.growth_mb, seconds)


def test_the_images_requests_hold_are_bounded_for_the_whole_server(server):
    """Three edits at once whose images fit the budget two at a time: two run, the third waits for
    the budget (not in the engine), and all three come back as each would alone."""
    params = KONTEXT.params(num_inference_steps=4, seed=3)
    clients = [RemoteRolloutEngine(server.url, api_key=API_KEY) for _ in range(3)]
    try:
        (alone,) = clients[0].generate("make it red", params, images=[[IMAGE]])
        clients[0].collective_rpc("set_step_delay", args=(0.3,))
        with ThreadPoolExecutor(3) as pool:
            running = [pool.submit(c.generate, "make it red", params, images=[[IMAGE]]) for c in clients]
            seen, deadline = [], time.monotonic() + 60
            while not all(future.done() for future in running) and time.monotonic() < deadline:
                seen.append(clients[0].server_info()["unfinished_requests"])
                time.sleep(0.05)
            outputs = [future.result(timeout=60) for future in running]
    finally:
        clients[0].collective_rpc("set_step_delay", args=(0.0,))
        for client in clients:
            client.shutdown()
    assert max(seen) == 2 and 1 in seen, seen  # before: 3 at once
    for (output,) in outputs:
        assert torch.equal(output.image, alone.image)
