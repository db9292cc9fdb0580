"""Worker functions over HTTP against a real server process: a user's own weight sync
(`/update_weights_from_worker`) versioned and all-or-nothing, the marks that decide what
`/collective_rpc` may call, and a worker function's failure arriving as the engine's `WorkerError`."""

from __future__ import annotations

import httpx
import pytest
from safetensors.torch import save_file

from rollout import SamplingParams
from rollout.errors import WorkerError
from rollout.pipelines.loading import load_adapter
from rollout.weights.state import base_state, checksum
from tests.serve.conftest import API_KEY
from tests.weight_files import new_weights_file

pytestmark = pytest.mark.timeout(120)

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def transformer_state(tiny_model):
    return base_state(load_adapter(tiny_model).transformer)


@pytest.fixture
def new_weights(remote, transformer_state, tmp_path):
    """A file of new values for a few weights (on the server's machine: this one), the whole state
    they make, and the server's weights put back afterwards."""
    changed = {name: tensor * 0.5 for name, tensor in list(transformer_state.items())[:5]}
    with new_weights_file(remote, transformer_state, changed, tmp_path) as weights:
        yield weights


def test_a_staging_function_updates_the_server_with_a_version(remote, new_weights):
    path, expected = new_weights
    before = remote.weight_version
    assert remote.update_weights_from_worker("weights_from_file", args=[path]) == before + 1
    assert remote.weights_checksum() == checksum(expected)
    (output,) = remote.generate("a red square", SamplingParams(num_inference_steps=2, seed=0))
    assert output.weight_versions == (before + 1,)


def test_a_failing_staging_function_rolls_back_and_comes_back_as_the_worker_s_error(remote, new_weights):
    path, _ = new_weights
    before, version = remote.weights_checksum(), remote.weight_version
    with pytest.raises(WorkerError) as failed:
        remote.update_weights_from_worker("weights_from_file", args=[path], kwargs={"fail_after": 2})
    assert failed.value.rank == 0 and failed.value.raised(ConnectionError)
    assert "the transport broke after 2 tensors" in failed.value.message
    assert "weights_from_file" in failed.value.remote_traceback
    assert (remote.weights_checksum(), remote.weight_version) == (before, version)
    with pytest.raises(ValueError, match="'pid' is not marked @stages_weights"):
        remote.update_weights_from_worker("pid")
    assert remote.weight_version == version


def test_a_worker_function_that_raises_is_a_worker_error_as_in_process(remote):
    """Its type, rank and traceback cross HTTP; the server goes on."""
    with pytest.raises(WorkerError) as failed:
        remote.collective_rpc("raise_key_error", args=["missing"])
    error = failed.value
    assert (error.method, error.rank, error.error_type) == ("raise_key_error", 0, "builtins.KeyError")
    assert error.raised(KeyError) and "raise KeyError(key)" in error.remote_traceback
    assert remote.collective_rpc("get_rank") == [0]


@pytest.mark.parametrize(
    "method, refusal",
    [
        ("set_marker", "is not marked @read_only"),  # the extension's, unmarked and not allowed
        ("weights_from_file", "stages weights: call /update_weights_from_worker"),
    ],
)
def test_collective_rpc_calls_an_extension_s_function_only_where_its_mark_allows(server, remote, method, refusal):
    answer = httpx.post(f"{server.url}/collective_rpc", json={"method": method, "args": ["x"]}, headers=AUTH)
    assert answer.status_code == 403 and refusal in answer.json()["error"]["message"], answer.text
    assert remote.collective_rpc("pid")[0] > 0  # marked @read_only: callable by name
    assert remote.collective_rpc("hot_swap_state")[0]["sleep_level"] == 0  # the engine's own read-only ones


def test_an_unknown_rpc_allow_name_stops_the_server_before_it_loads(tiny_model):
    from rollout.serve.__main__ import main

    with pytest.raises(SystemExit, match="--rpc-allow no_such_function: not a worker function of this engine"):
        main(["--model", tiny_model, "--port", "0", "--no-auth", "--rpc-allow", "no_such_function"])


def test_a_staging_function_that_yields_nothing_is_refused_as_an_empty_push(remote, tmp_path):
    empty = tmp_path / "empty.safetensors"
    save_file({}, empty)
    version = remote.weight_version
    with pytest.raises(ValueError, match="(?s)update refused, weights unchanged.*the update holds no tensors"):
        remote.update_weights_from_worker("weights_from_file", args=[str(empty)])
    assert remote.weight_version == version
