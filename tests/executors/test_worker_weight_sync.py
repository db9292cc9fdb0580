"""A user's own weight sync (`@stages_weights` + `update_weights_from_worker`) on every backend:
versioned, all-or-nothing across ranks, with a failure or a refusal injected on one rank."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import safetensors
import torch

from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.errors import WorkerError
from rollout.weights.state import base_state, checksum
from rollout.worker.marks import read_only, stages_weights
from tests.weight_files import new_weights_file

# Ray workers cannot import the test modules: ship this one's classes by value (which is why they
# reach safetensors through its module: its Rust classes do not pickle by value).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(240)

BACKENDS = {
    "uni": {"executor": "uni"},
    "mp": {"executor": "mp", "num_workers": 2},
    "ray": {"executor": "ray", "num_workers": 2},
}


class FileWeights:
    """The user's transport: a safetensors file every rank reads, tensor by tensor. The keyword
    arguments make one rank misbehave, as a broken transport or a wrong source would."""

    @stages_weights
    def weights_from_file(self, path: str, fail_on_rank: int | None = None, short_on_rank: int | None = None):
        with safetensors.safe_open(path, "pt") as weights:
            names = list(weights.keys())
            for index, name in enumerate(names):
                if self.rank == fail_on_rank and index == len(names) // 2:
                    raise ConnectionError(f"rank {self.rank} lost its source after {index} tensors")
                tensor = weights.get_tensor(name)
                if self.rank == short_on_rank and index == 0:
                    tensor = tensor[..., :1]
                yield name, tensor

    @stages_weights
    def first_tensor_only_on_rank_0(self, path: str) -> dict[str, torch.Tensor]:
        """Ranks that disagree: rank 0 stages one tensor, the others all of them."""
        with safetensors.safe_open(path, "pt") as weights:
            names = list(weights.keys())[:1] if self.rank == 0 else list(weights.keys())
            return {name: weights.get_tensor(name) for name in names}

    @read_only
    def transformer_checksum(self) -> str:
        return checksum(base_state(self.adapter.transformer))

    def not_marked(self) -> int:
        return self.rank


@pytest.fixture(
    scope="module", params=[pytest.param(name, marks=[pytest.mark.slow] if name == "ray" else []) for name in BACKENDS]
)
def engine(request, tiny_model):
    config = BACKENDS[request.param]
    if config["executor"] == "ray":
        request.getfixturevalue("ray_cluster")
    with RolloutEngine(EngineConfig(model=tiny_model, worker_extension_cls=FileWeights, **config)) as engine:
        yield engine


@pytest.fixture
def new_weights(engine, tmp_path):
    """A file of new values for a few transformer weights, and the whole state they make; the
    engine goes back to its weights afterwards."""
    state = engine.collective_rpc(lambda worker: base_state(worker.adapter.transformer), ranks=[0])[0]
    changed = {name: tensor + 0.125 for name, tensor in list(state.items())[:6]}
    with new_weights_file(engine, state, changed, tmp_path) as weights:
        yield weights


def test_a_staging_function_updates_every_rank_with_a_version(engine, new_weights):
    path, expected = new_weights
    before = engine.weight_version
    assert engine.update_weights_from_worker("weights_from_file", args=(path,)) == before + 1
    assert engine.weights_checksum() == checksum(expected)  # every rank (it raises if they differ)
    assert engine.collective_rpc("transformer_checksum") == [checksum(expected)] * engine.config.num_workers
    (output,) = engine.generate("a red square", SamplingParams(num_inference_steps=2, seed=0))
    assert output.weight_versions == (before + 1,)


def test_a_failure_on_one_rank_rolls_every_rank_back(engine, new_weights):
    path, _ = new_weights
    last = engine.config.num_workers - 1
    before, version = engine.weights_checksum(), engine.weight_version
    with pytest.raises(WorkerError) as failed:
        engine.update_weights_from_worker("weights_from_file", args=(path,), kwargs={"fail_on_rank": last})
    assert failed.value.rank == last and failed.value.raised(ConnectionError)
    assert "weights_from_file" in failed.value.remote_traceback
    assert (engine.weights_checksum(), engine.weight_version) == (before, version)
    # Nothing staged is left behind: the next update takes only its own tensors.
    assert engine.update_weights_from_worker("weights_from_file", args=(path,)) == version + 1


def test_a_refusal_on_one_rank_names_the_tensor_and_changes_nothing(engine, new_weights):
    path, _ = new_weights
    last = engine.config.num_workers - 1
    before, version = engine.weights_checksum(), engine.weight_version
    refused = rf"(?s)update refused, weights unchanged.*{next(iter(new_weights[1]))}: expected \[.*, got \[.*1\]"
    with pytest.raises(ValueError, match=refused):
        engine.update_weights_from_worker("weights_from_file", args=(path,), kwargs={"short_on_rank": last})
    assert (engine.weights_checksum(), engine.weight_version) == (before, version)


def test_ranks_that_stage_different_updates_are_refused(engine, new_weights):
    if engine.config.num_workers == 1:
        pytest.skip("one rank cannot disagree with itself")
    path, _ = new_weights
    before, version = engine.weights_checksum(), engine.weight_version
    with pytest.raises(ValueError, match=r"staged different numbers of tensors of transformer \(\[1, 6\]"):
        engine.update_weights_from_worker("first_tensor_only_on_rank_0", args=(path,))
    assert (engine.weights_checksum(), engine.weight_version) == (before, version)


def test_what_is_not_a_staging_function_is_refused_before_anything_runs(engine, new_weights):
    path, _ = new_weights
    version = engine.weight_version
    with pytest.raises(ValueError, match=r"'not_marked' is not marked @stages_weights; the ones that stage weights"):
        engine.update_weights_from_worker("not_marked")
    with pytest.raises(ValueError, match=r"'nothing' is not a worker function"):
        engine.update_weights_from_worker("nothing")
    with pytest.raises(TypeError, match="takes the name of a @stages_weights worker function"):
        engine.update_weights_from_worker(FileWeights.weights_from_file)
    with pytest.raises(ValueError, match=r"stages weights, and collective_rpc would apply none of them"):
        engine.collective_rpc("weights_from_file", args=(path,))
    assert engine.weight_version == version


def test_pause_mode_applies_between_two_steps_of_running_requests(engine, new_weights):
    """As `update_weights(mode="pause")`: running requests go on with the new weights, and their
    steps say which version ran each."""
    path, _ = new_weights
    before = engine.weight_version
    (request_id,) = engine.add_request("a red square", SamplingParams(num_inference_steps=4, seed=1))
    engine.step()
    engine.step()
    assert engine.update_weights_from_worker("weights_from_file", args=(path,), mode="pause") == before + 1
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (output,) = outputs
    assert output.request_id == request_id
    assert output.step_weight_versions == (before, before, before + 1, before + 1)
