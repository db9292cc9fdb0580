"""One contract, every backend: uni, mp, ray and an external executor class defined here, on the
tiny SD3; uni and mp on the tiny FLUX.1; mp on Qwen-Image and Z-Image (weights, checksums, LoRA,
sleep/wake) and on FLUX.1 Kontext with every request an edit (`EditingEngine`); and mp and ray on
FLUX.1 with one replica of two ranks (sequence parallel)."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import time

import cloudpickle
import pytest
import torch

from executors.uni import UniExecutor
from recipes.custom_executor import LatentStatsExtension
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.errors import RequestFailedError, WorkerError
from rollout.rescoring import RATIO_TOLERANCE
from rollout.weights.state import base_state
from rollout.worker.worker import Worker
from tests.executors import worker_functions
from tests.executors.worker_functions import fail_decodes_of_height, fail_requests_of, stop_failing
from tests.families import FAMILIES, input_image

# Ray workers cannot import the test modules: ship their functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(worker_functions)

pytestmark = pytest.mark.timeout(180)

EXTENSION = "recipes.custom_executor.LatentStatsExtension"


class ExternalExecutor(UniExecutor):
    """A user's executor, named by dotted path: the standard path plus its own counter."""

    def __init__(self, config):
        super().__init__(config)
        self.executed = 0

    def execute(self, scheduler_output):
        self.executed += 1
        return super().execute(scheduler_output)


BACKENDS = {
    "uni": {"executor": "uni"},
    "mp": {"executor": "mp", "num_workers": 2},
    "ray": {"executor": "ray", "num_workers": 2},
    "external": {"executor": f"{__name__}.ExternalExecutor"},
    # One replica of two ranks (Ulysses sequence parallel; SD3 has no context-parallel plan).
    "mp-group": {"executor": "mp", "num_workers": 2, "sequence_parallel": 2},
    "ray-group": {"executor": "ray", "num_workers": 2, "sequence_parallel": 2},
    # One replica of two ranks, the conditional and the unconditional rows of guidance apart.
    "mp-cfg": {"executor": "mp", "num_workers": 2, "cfg_parallel": 2},
}
GROUP_BACKENDS = ("mp-group", "ray-group", "mp-cfg")
# Case id -> (family, backend). Every backend on SD3; the in-process and the process backend on the others.
CASES = (
    {name: ("sd3", name) for name in BACKENDS if name not in GROUP_BACKENDS}
    | {f"{backend}-flux": ("flux", backend) for backend in ("uni", "mp")}
    # The other families on mp only: its worker runs the same code as uni's, in a process of its own
    # (uni runs the whole contract on SD3 and FLUX.1); one case each keeps CI within its time.
    | {f"mp-{family}": (family, "mp") for family in ("qwen_image", "zimage", "flux_kontext")}
    | {f"{backend}-flux": ("flux", backend) for backend in ("mp-group", "ray-group")}
    | {"mp-cfg-sd3": ("sd3", "mp-cfg")}
)
FAMILY_OF_PIPELINE = {family.pipeline_class: family for family in FAMILIES.values()}


# What only repeats another case for the default suite: Ray (the object store and actors have tests
# of their own), the external class (uni's path once it resolves), mp on FLUX.1 (mp on SD3, uni on
# it), and the other families (FLUX.1 runs the packed-latent path; Z-Image's 41 cases took 135 s on
# a loaded 2-core machine, far past the default suite's budget). The edit family runs the whole
# contract with input images in the slow suite (tests/rollout/test_edits.py keeps a quick edit check
# in the default one). CI runs them all (make test-slow).
REPEATS = {
    "ray",
    "external",
    "mp-flux",
    "mp-qwen_image",
    "mp-zimage",
    "mp-flux_kontext",
    # Processes joined in a gloo group: tests/executors/test_sequence_parallel.py has the equality checks.
    "mp-group-flux",
    "ray-group-flux",
    # ... tests/executors/test_cfg_parallel.py has them for CFG parallel.
    "mp-cfg-sd3",
}


class EditingEngine(RolloutEngine):
    """The real engine, where every request that names no images edits one: an image chosen by
    its prompt's text (so a reference engine edits the same image), so the contract's requests
    run the edit path (encoded images in every condition, on every backend)."""

    def add_request(self, prompt, params, *, images=None, **kwargs):
        if images is None:
            images = [input_image(sum(prompt.encode()) % 7)]
        return super().add_request(prompt, params, images=images, **kwargs)


@pytest.fixture(
    scope="module", params=[pytest.param(name, marks=pytest.mark.slow) if name in REPEATS else name for name in CASES]
)
def case(request) -> tuple[str, str]:
    return CASES[request.param]


@pytest.fixture(scope="module")
def model_path(case, tiny_models) -> str:
    return tiny_models(case[0])


@pytest.fixture(scope="module")
def engine(request, case, model_path):
    backend = case[1]
    if backend.startswith("ray"):
        request.getfixturevalue("ray_cluster")
    config = EngineConfig(model=model_path, worker_extension_cls=EXTENSION, **BACKENDS[backend])
    with engine_class(case)(config) as engine:
        yield engine


def engine_class(case: tuple[str, str]) -> type[RolloutEngine]:
    return EditingEngine if FAMILIES[case[0]].edits else RolloutEngine


@pytest.fixture(scope="module")
def trainer_adapter(model_path):
    """A separate copy of the case's model, as a trainer would hold it."""
    from rollout.pipelines.loading import load_adapter

    return load_adapter(model_path)


def _params(engine, cfg: bool = True, **kwargs) -> SamplingParams:
    """Params for the engine's tiny model: 32x32, with classifier-free guidance unless `cfg=False`."""
    return FAMILY_OF_PIPELINE[engine.model_spec.pipeline_class].params(cfg=cfg, **kwargs)


def _ranks(engine) -> list[int]:
    return list(range(engine.config.num_workers))


def _held_by_replica(engine) -> list[list[str]]:
    """The request ids each replica holds; every rank of a replica group holds the same."""
    held = engine.collective_rpc("request_ids")
    ranks = engine.config.ranks_per_replica
    groups = [held[start : start + ranks] for start in range(0, len(held), ranks)]
    assert all(group == [group[0]] * ranks for group in groups), groups
    return [group[0] for group in groups]


def test_generate_returns_every_sample_in_order(engine):
    params = _params(engine, num_inference_steps=3, num_samples=3, seed=0)
    outputs = engine.generate(["a red square", "a blue circle"], params)
    assert [(o.prompt_index, o.sample_index) for o in outputs] == [(p, k) for p in range(2) for k in range(3)]
    assert all(o.status == "finished" and o.image.shape == (3, 32, 32) for o in outputs)
    assert all(torch.isfinite(o.trajectory.log_probs).all() for o in outputs)
    assert engine.collective_rpc("request_ids") == [[] for _ in _ranks(engine)]


def test_samples_share_one_conditioning_per_text(engine):
    """Whatever rank and step a sample finished on, the samples of a prompt reference one
    embeddings object, and every sample with the same negative prompt another."""
    params = _params(engine, num_inference_steps=2, num_samples=3, seed=0)
    outputs = engine.generate(["a red square", "a blue circle"], params)
    conditions = [o.trajectory.condition for o in outputs]
    for group in (conditions[:3], conditions[3:]):
        assert all(c.prompt is group[0].prompt for c in group)
    assert conditions[0].prompt is not conditions[3].prompt
    assert all(c.negative is conditions[0].negative for c in conditions)  # "" for every sample
    assert not torch.equal(conditions[0].prompt.prompt_embeds, conditions[3].prompt.prompt_embeds)
    if isinstance(engine, EditingEngine):  # and the samples of an edit share one encoding of its image
        for group in (conditions[:3], conditions[3:]):
            assert group[0].images is not None and all(c.images is group[0].images for c in group)


def test_abort_leaves_no_state_on_any_rank(engine):
    params = _params(engine, num_inference_steps=4, num_samples=4, seed=0)
    for i in range(5):
        ids = engine.add_request(f"p{i}", params, request_id=f"a{i}")
        engine.step()
        assert sum(len(r) for r in _held_by_replica(engine)) == 4
        assert sorted(o.request_id for o in engine.abort(f"a{i}")) == sorted(ids)
        assert engine.collective_rpc("request_ids") == [[] for _ in _ranks(engine)]
    assert not engine.has_unfinished_requests()


def _drain(engine) -> dict:
    outputs = {}
    while engine.has_unfinished_requests():
        outputs |= {o.request_id: o for o in engine.step()}
    return outputs


@pytest.mark.parametrize("stage", ["step", "encode", "decode"])
def test_a_request_that_fails_in_its_worker_fails_alone(engine, stage):
    """Its output is "failed" with the worker's error (no traceback); a request that shared its
    batch finishes with the same bytes as alone; nothing of it stays on any rank."""
    params = _params(engine, cfg=False, num_inference_steps=2, num_samples=1, seed=3)
    doomed_params = dataclasses.replace(params, height=64) if stage == "decode" else params
    (alone,) = engine.generate("fine", params)
    inject = (fail_decodes_of_height, (64,)) if stage == "decode" else (fail_requests_of, ("doomed", stage))
    engine.collective_rpc(inject[0], args=inject[1])
    try:
        (doomed_id,) = engine.add_request("doomed", doomed_params, request_id=f"doomed_{stage}")
        (fine_id,) = engine.add_request("fine", params, request_id=f"fine_{stage}")
        outputs = _drain(engine)
        with pytest.raises(RequestFailedError, match="failed in a worker, alone.*injected"):
            engine.generate(["also fine", "doomed"], [params, doomed_params])  # the whole call fails...
        assert not engine.has_unfinished_requests()  # ...and leaves none of its requests behind
    finally:
        engine.collective_rpc(stop_failing)
    doomed, fine = outputs[doomed_id], outputs[fine_id]
    assert doomed.status == "failed" and doomed.image is None and doomed.trajectory is None
    assert doomed.error.startswith("RuntimeError: injected") and "Traceback" not in doomed.error
    assert fine.status == "finished" and torch.equal(fine.image, alone.image)
    assert engine.collective_rpc("request_ids") == [[] for _ in _ranks(engine)]
    assert engine.generate("doomed", doomed_params)[0].status == "finished"


def test_collective_rpc_by_name_extension_callable_and_rank_subset(engine):
    ranks = _ranks(engine)
    assert engine.collective_rpc("get_rank") == ranks
    counts = engine.collective_rpc("transformer_parameter_count")
    assert len(counts) == len(ranks) and counts[0] > 0 and len(set(counts)) == 1
    # By reference, a worker's own function or the extension's: sent as its name, as above.
    assert engine.collective_rpc(Worker.get_rank) == ranks
    assert engine.collective_rpc(LatentStatsExtension.transformer_parameter_count) == counts
    assert engine.collective_rpc(lambda worker, a, b=0: worker.rank * 10 + a + b, args=(1,), kwargs={"b": 2}) == [
        r * 10 + 3 for r in ranks
    ]
    assert engine.collective_rpc("get_rank", ranks=[ranks[-1]]) == [ranks[-1]]
    with pytest.raises(TypeError, match=r"ranks must be a list of rank numbers \(e.g. \[0\]\)"):
        engine.collective_rpc("get_rank", ranks=0)
    with pytest.raises(ValueError, match=r"ranks names \[0\] more than once"):
        engine.collective_rpc("get_rank", ranks=[0, 0])
    tensor = torch.arange(6.0).reshape(2, 3)
    echoed = engine.collective_rpc(lambda worker, t: t * 2, args=(tensor,))
    assert all(torch.equal(e, tensor * 2) for e in echoed)


def _sleep_then_rank(worker, seconds):
    time.sleep(seconds)
    return worker.rank


def test_timeout_names_the_ranks_and_drops_the_late_reply(engine):
    sleep_s = 1.5
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"'.*_sleep_then_rank' timed out after 0.3s; ranks that did not answer"):
        engine.collective_rpc(_sleep_then_rank, args=(sleep_s,), timeout=0.3)
    assert time.monotonic() - start < sleep_s  # it did not wait for the worker
    assert engine.collective_rpc("get_rank", timeout=30) == _ranks(engine)  # not the late reply


def _fail_on_last_rank(worker, last):
    if worker.rank == last:
        raise ValueError(f"rank {worker.rank} refuses")
    return worker.rank


class WorkerSideLookupError(LookupError):
    """An exception class of the caller's own, raised in a worker."""


def _raise_own_error(worker):
    raise WorkerSideLookupError("not here")


def test_worker_exception_returns_rank_and_remote_traceback(engine):
    last = _ranks(engine)[-1]
    with pytest.raises(WorkerError) as error:
        engine.collective_rpc(_fail_on_last_rank, args=(last,))
    assert error.value.rank == last
    assert f"ValueError: rank {last} refuses" in error.value.error
    assert "_fail_on_last_rank" in error.value.remote_traceback
    # The remote type travels as a type, so callers never parse the message.
    assert error.value.error_type == "builtins.ValueError" and error.value.error_class is ValueError
    assert error.value.raised(ValueError) and error.value.raised(Exception) and not error.value.raised(KeyError)
    with pytest.raises(WorkerError) as own:
        engine.collective_rpc(_raise_own_error)
    assert own.value.raised(LookupError) and own.value.message == "not here"
    engine.check_health()  # the workers live on
    assert engine.collective_rpc("get_rank") == _ranks(engine)


def _surface(worker) -> dict:
    """What the README promises a worker function finds on its worker."""
    adapter = worker.adapter
    return {
        "rank": worker.rank,
        "model": worker.config.model,
        "components": sorted(adapter.components),
        "spec": adapter.spec.pipeline_class,
        "pipeline": type(adapter.pipeline).__name__,
        "transformer": adapter.transformer is adapter.pipeline.transformer,
        "device": str(adapter.device),
        "dtype": str(adapter.dtype),
        "predict_velocity": callable(adapter.predict_velocity),
        "loras": dict(worker.loras.configs),
        "requests": dict(worker.requests),
    }


def test_the_documented_worker_surface(engine):
    surfaces = engine.collective_rpc(_surface)
    for rank, surface in enumerate(surfaces):
        assert surface["rank"] == rank and surface["model"] == engine.config.model
        assert surface["spec"] == surface["pipeline"] == engine.model_spec.pipeline_class
        assert {"transformer", "vae", "text_encoder"} <= set(surface["components"]) and surface["transformer"]
        assert surface["predict_velocity"] and surface["loras"] == {} and surface["requests"] == {}


def test_unknown_method_is_refused_before_anything_is_sent(engine):
    with pytest.raises(ValueError, match="unknown worker method 'nope'.*live_latent_norms"):
        engine.collective_rpc("nope")


def test_rpcs_run_between_steps(engine):
    """A worker function sees whole steps: every live request has taken the same number of steps."""
    engine.add_request("x", _params(engine, num_inference_steps=5, num_samples=4, seed=1), request_id="between")
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        steps = engine.collective_rpc(lambda w: sorted({s.step_index for s in w.requests.values()}))
        seen.append(sorted({i for rank in steps for i in rank}))
    assert seen == [[1], [2], [3], [4], []]


def test_external_executor_ran_the_standard_path(engine):
    if not isinstance(engine.executor, ExternalExecutor):
        pytest.skip("only for the external executor")
    assert engine.executor.executed > 0


def test_same_numbers_on_every_backend(engine, model_path):
    prompts = ["a red square", "a blue circle", "a green star"]
    params = [
        _params(engine, num_inference_steps=4, num_samples=2, seed=5),
        _params(engine, cfg=False, num_inference_steps=4, num_samples=2, seed=5, sampler="cps"),
        _params(engine, num_inference_steps=6, num_samples=2, seed=5, sampler="dance_sde", noise_level=0.3),
    ]
    outputs = engine.generate(prompts, params)
    with type(engine)(EngineConfig(model=model_path)) as reference_engine:
        reference = reference_engine.generate(prompts, params)
    # Ranks split the batch and may run other thread counts, so float32 GEMMs round differently:
    # a few ULPs (measured up to 3e-6 on latents of magnitude ~3). Same batches and threads are
    # bitwise equal (test_mp_executor.py).
    for got, want in zip(outputs, reference, strict=True):
        assert (got.trajectory.latents.stack() - want.trajectory.latents.stack()).abs().max() < 1e-5
        assert (got.trajectory.log_probs - want.trajectory.log_probs).abs().max() < 1e-5
        assert (got.image.int() - want.image.int()).abs().max() <= 1


def test_work_is_spread_over_ranks(engine):
    if engine.config.num_replicas == 1:
        pytest.skip("one replica")
    engine.add_request("x", _params(engine, num_inference_steps=2, num_samples=4, seed=0), request_id="spread")
    engine.step()
    held = _held_by_replica(engine)
    assert [len(ids) for ids in held] == [2, 2]
    while engine.has_unfinished_requests():
        engine.step()


def test_worker_processes_are_separate(engine):
    pids = engine.collective_rpc(lambda worker: os.getpid())
    if engine.config.executor in ("mp", "ray"):
        assert os.getpid() not in pids and len(set(pids)) == len(pids)
    else:
        assert pids == [os.getpid()]


# The hot-swap API: weight updates.


@pytest.fixture(scope="module")
def original_weights(model_path):
    from rollout.pipelines.loading import load_adapter

    return {name: t.detach().clone() for name, t in base_state(load_adapter(model_path).transformer).items()}


def _images(engine):
    params = _params(engine, num_inference_steps=3, num_samples=2, seed=4)
    return [o.image for o in engine.generate(["a red square", "a blue circle"], params)]


def test_weight_round_trip(engine, original_weights):
    from rollout.weights.state import checksum

    before = _images(engine)
    assert engine.weights_checksum() == checksum(original_weights)
    generator = torch.Generator().manual_seed(0)
    noisy = {name: t + 0.05 * torch.randn(t.shape, generator=generator) for name, t in original_weights.items()}
    version = engine.update_weights(noisy, bucket_bytes=64 * 1024)  # many buckets
    assert version == engine.weight_version
    assert engine.weights_checksum() == checksum(noisy)
    changed = _images(engine)
    assert any(not torch.equal(a, b) for a, b in zip(before, changed, strict=True))
    engine.update_weights(iter(original_weights.items()), version=version + 10)  # an iterator streams
    assert engine.weight_version == version + 10
    assert engine.weights_checksum() == checksum(original_weights)
    after = _images(engine)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    outputs = engine.generate("x", _params(engine, num_inference_steps=2, seed=0))
    assert outputs[0].weight_version == version + 10 and outputs[0].weight_versions == (version + 10,)


def test_bad_updates_are_refused_whole(engine, original_weights):
    digest = engine.weights_checksum()
    version = engine.weight_version
    name, tensor = next((n, t) for n, t in original_weights.items() if t.ndim == 2 and t.shape[0] > 1)
    good = {n: t + 1 for n, t in list(original_weights.items())[:6] if n != name}
    bad_updates = {
        "unknown name": ({**good, "no.such.weight": tensor}, "no.such.weight: not a weight of this component"),
        "wrong shape": (
            {**good, name: tensor[:1]},
            re.escape(f"{name}: expected {list(tensor.shape)} float32, got {[1, tensor.shape[1]]} float32"),
        ),
        "wrong dtype": ({**good, name: tensor.double()}, f"{name}: expected .* float32, got .* float64"),
        "NaN": ({**good, name: torch.full_like(tensor, float("nan"))}, f"{name}: holds NaN or infinite values"),
    }
    for label, (update, message) in bad_updates.items():  # NaN and infinity are refused by default
        with pytest.raises(ValueError, match=f"update refused, weights unchanged: 1 problem.*\n.*{message}"):
            engine.update_weights(update, bucket_bytes=1)
        assert engine.weights_checksum() == digest, label
        assert engine.weight_version == version
    with pytest.raises(ValueError, match="2 problem"):  # every offending name at once
        engine.update_weights({"a.b": tensor, name: tensor[:1]})
    assert engine.weights_checksum() == digest


def _restore_apply(worker) -> None:
    vars(worker.updates).pop("apply", None)


def test_a_rank_that_fails_to_apply_rolls_every_rank_back(engine, original_weights):
    digest = engine.weights_checksum()
    last = engine.config.num_workers - 1

    def break_apply(worker, rank):
        if worker.rank == rank:

            def fail(component):
                raise RuntimeError("out of memory while applying")

            worker.updates.apply = fail

    engine.collective_rpc(break_apply, args=(last,))
    try:
        with pytest.raises(WorkerError, match="out of memory while applying"):
            engine.update_weights({n: t + 1 for n, t in original_weights.items()})
        assert engine.weights_checksum() == digest
    finally:
        engine.collective_rpc(_restore_apply)
    assert engine.weights_checksum() == digest


def _fail_swap_part_way(worker, rank):
    """On `rank`, the third tensor swapped in raises (the first two are already in)."""
    import rollout.weights.state

    if worker.rank != rank:
        return
    swap = rollout.weights.state._set_tensor
    calls = []

    def failing(module, name, tensor):
        calls.append(name)
        if len(calls) == 3:
            raise RuntimeError("device error in the middle of the swap")
        return swap(module, name, tensor)

    worker.saved_set_tensor = swap
    rollout.weights.state._set_tensor = failing


def _restore_swap(worker):
    import rollout.weights.state

    if hasattr(worker, "saved_set_tensor"):
        rollout.weights.state._set_tensor = worker.saved_set_tensor
        del worker.saved_set_tensor


def test_a_swap_that_fails_part_way_on_one_rank_leaves_every_rank_as_it_was(engine, original_weights):
    digest = engine.weights_checksum()
    engine.collective_rpc(_fail_swap_part_way, args=(engine.config.num_workers - 1,))
    try:
        with pytest.raises(WorkerError, match="device error in the middle of the swap"):
            engine.update_weights({n: t + 1 for n, t in original_weights.items()})
    finally:
        engine.collective_rpc(_restore_swap)
    assert engine.weights_checksum() == digest  # every rank, the failing one too


@pytest.mark.parametrize("mode", ["wait", "pause"])
def test_update_during_a_rollout(engine, original_weights, mode):
    v0 = engine.weight_version
    ids = engine.add_request("x", _params(engine, num_inference_steps=4, num_samples=2, seed=0), request_id=mode)
    engine.step()
    engine.step()
    noisy = {n: t * 1.01 for n, t in original_weights.items()}
    v1 = engine.update_weights(noisy, mode=mode)
    outputs = []
    while engine.has_unfinished_requests() or not outputs:
        outputs += engine.step()
    assert sorted(o.request_id for o in outputs) == sorted(ids)
    expected = (v0,) if mode == "wait" else (v0, v1)
    assert all(o.weight_versions == expected and o.status == "finished" for o in outputs)
    # Two steps ran before the update; with "pause" the other two ran on the new weights.
    per_step = (v0,) * 4 if mode == "wait" else (v0, v0, v1, v1)
    assert all(o.step_weight_versions == per_step for o in outputs)
    later = engine.generate("y", _params(engine, num_inference_steps=2, seed=0))
    assert later[0].weight_versions == (v1,)
    engine.update_weights(original_weights)


def test_update_weights_from_disk(engine, original_weights, model_path, tmp_path):
    from safetensors.torch import save_file

    from rollout.weights.state import checksum

    shifted = {name: t + 0.5 for name, t in original_weights.items()}
    save_file(shifted, tmp_path / "shifted.safetensors")
    version = engine.update_weights_from_disk(tmp_path / "shifted.safetensors")
    assert version == engine.weight_version and engine.weights_checksum() == checksum(shifted)

    name = next(n for n, t in original_weights.items() if t.ndim == 2)
    save_file({name: original_weights[name].T.contiguous()}, tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match=f"update refused, weights unchanged: 1 problem.*\n  {re.escape(name)}"):
        engine.update_weights_from_disk(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="is neither a .safetensors file nor a folder holding one"):
        engine.update_weights_from_disk(tmp_path / "missing")
    assert engine.weights_checksum() == checksum(shifted)

    engine.update_weights_from_disk(f"{model_path}/transformer")  # a diffusers component folder
    assert engine.weights_checksum() == checksum(original_weights)


def test_non_finite_weights_are_refused_from_tensors_disk_and_broadcast_unless_asked(
    engine, original_weights, tmp_path
):
    """Every rank checks the values it reads itself (files, a broadcast); a refusal is whole, the
    old weights stay, and check_finite=False (for those who measured the check) lets them in."""
    from safetensors.torch import save_file

    from rollout.weights.state import checksum
    from trainers_adapters.weights.broadcast import join_engine

    digest, version = engine.weights_checksum(), engine.weight_version
    names = [n for n, t in original_weights.items() if t.is_floating_point()][:3]
    poisoned = dict(original_weights)
    poisoned[names[0]] = original_weights[names[0]].clone().index_fill_(0, torch.tensor([0]), float("nan"))
    poisoned[names[2]] = original_weights[names[2]].clone().index_fill_(0, torch.tensor([0]), float("-inf"))
    save_file(poisoned, tmp_path / "poisoned.safetensors")
    broadcaster = join_engine(engine, "127.0.0.1", _free_port())
    pushes = {
        "tensors": lambda **kw: engine.update_weights(poisoned, **kw),
        "disk": lambda **kw: engine.update_weights_from_disk(tmp_path / "poisoned.safetensors", **kw),
        "broadcast": lambda **kw: broadcaster.push(engine, poisoned, bucket_bytes=32 * 1024, **kw),
    }
    # Listed in the order the source gives them (a safetensors file sorts its names).
    poisoned_lines = {f"{names[i]}: holds NaN or infinite values" for i in (0, 2)}
    for label, push in pushes.items():
        with pytest.raises(ValueError, match="update refused, weights unchanged: 2 problem") as refusal:
            push()
        assert poisoned_lines <= set(str(refusal.value).split("\n  ")), label
        assert (engine.weights_checksum(), engine.weight_version) == (digest, version), label
    # The group still works after a refusal: the ranks read every bucket.
    assert broadcaster.push(engine, original_weights, bucket_bytes=32 * 1024) == version + 1
    # Opting out lets the same tensors in.
    assert pushes["tensors"](check_finite=False) == version + 2
    assert engine.weights_checksum() == checksum(poisoned)
    engine.update_weights(original_weights)


# The hot-swap API: LoRA adapters.

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


@pytest.fixture(scope="module")
def lora_tensors(model_path):
    """Two random rank-4 adapters (PEFT keys) made on a separate copy of the transformer."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from rollout.pipelines.loading import load_adapter

    transformer = load_adapter(model_path).transformer
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
    adapters = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        transformer.add_adapter(config, adapter_name=f"a{seed}")
        adapters.append(
            {k: v.detach().clone() for k, v in get_peft_model_state_dict(transformer, adapter_name=f"a{seed}").items()}
        )
        transformer.delete_adapters(f"a{seed}")
    return adapters, {"r": 4, "lora_alpha": 8, "target_modules": LORA_TARGETS}


def _modules_named_like(worker, targets) -> int:
    """How many of the transformer's modules a LoRA with `targets` binds (names ending so)."""
    names = [name for name, _ in worker.adapter.transformer.named_modules()]
    return sum(1 for name in names if any(name == t or name.endswith(f".{t}") for t in targets))


def _lora_images(engine, lora=None, scale=1.0):
    params = _params(engine, num_inference_steps=3, num_samples=2, seed=8, lora=lora, lora_scale=scale)
    return [o.image for o in engine.generate(["a red square", "a blue circle"], params)]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_lora_changes_outputs_and_unload_restores_the_base_bitwise(engine, lora_tensors):
    (policy, other), config = lora_tensors
    base = _lora_images(engine)
    version = engine.load_lora("policy", policy, config)
    assert version == engine.weight_version
    assert engine.lora_modules("policy") == engine.collective_rpc(_modules_named_like, args=(LORA_TARGETS,))[0]
    assert engine.list_loras() == ["policy"]
    outputs = engine.generate("x", _params(engine, num_inference_steps=2, seed=0, lora="policy"))
    assert outputs[0].weight_version == version and outputs[0].lora == "policy"
    with_policy = _lora_images(engine, "policy")
    assert not _same(base, with_policy)
    assert _same(base, _lora_images(engine))  # lora=None is the base model while an adapter is resident
    assert not _same(with_policy, _lora_images(engine, "policy", scale=0.5))
    assert engine.load_lora("policy", other, config) == version + 1  # hot swap under the same name
    assert not _same(with_policy, _lora_images(engine, "policy"))
    engine.load_lora("policy", policy, config)
    assert _same(with_policy, _lora_images(engine, "policy"))
    engine.unload_lora("policy")
    assert engine.list_loras() == []
    assert _same(base, _lora_images(engine))
    with pytest.raises(ValueError, match="lora 'policy' is not loaded"):
        _lora_images(engine, "policy")


def test_a_lora_load_staged_while_requests_run_does_not_touch_them(engine, lora_tensors):
    """A load is staged (checked, built) before the running requests finish, so a refusal answers
    at once; the staged layers must not run in those requests' steps: the base model's request,
    and the old adapter's, end as they would without the load."""
    (policy, other), config = lora_tensors
    params = _params(engine, num_inference_steps=6, num_samples=1, seed=9)
    (base,) = engine.generate("base", params)
    for lora in (None, "policy"):
        if lora is not None:
            engine.load_lora("policy", policy, config)
            (base,) = engine.generate("base", dataclasses.replace(params, lora="policy"))
        (request_id,) = engine.add_request("base", dataclasses.replace(params, lora=lora), request_id=f"run_{lora}")
        outputs = engine.step() + engine.step()  # under way
        engine.load_lora("policy", other, config)  # a new adapter, or a hot swap
        outputs += engine.take_finished() + list(_drain(engine).values())  # the load finished them
        (output,) = [o for o in outputs if o.request_id == request_id]
        assert torch.equal(output.image, base.image), lora
        assert output.weight_versions == base.weight_versions
    engine.unload_lora("policy")


def test_several_adapters_resident_and_never_mixed_in_a_batch(engine, lora_tensors):
    (policy, reference), config = lora_tensors
    engine.load_lora("policy", policy, config)
    engine.load_lora("reference", reference, config)
    try:
        prompts = ["a", "b", "c"]
        params = [
            _params(engine, num_inference_steps=3, seed=2, lora="policy"),
            _params(engine, num_inference_steps=3, seed=2, lora="reference"),
            _params(engine, num_inference_steps=3, seed=2),
        ]
        mixed = engine.generate(prompts, params)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(prompt, p, prompt_index=i)
            solo = []
            while engine.has_unfinished_requests():
                solo += engine.step()
            assert (solo[0].trajectory.latents.stack() - mixed[i].trajectory.latents.stack()).abs().max() < 1e-5
            assert mixed[i].lora == p.lora
    finally:
        engine.unload_lora("policy")
        engine.unload_lora("reference")


def test_an_adapter_that_does_not_fit_is_refused_and_the_old_one_stays(engine, lora_tensors):
    (policy, _), config = lora_tensors
    engine.load_lora("policy", policy, config)
    try:
        before = _lora_images(engine, "policy")
        renamed = {f"renamed.{k}": v for k, v in policy.items()}
        with pytest.raises(ValueError, match="LoRA 'policy' refused: its keys match no module of the model"):
            engine.load_lora("policy", renamed, config)
        partial = {k: v for k, v in policy.items() if ".to_q." not in k}
        queries = engine.collective_rpc(_modules_named_like, args=(["to_q"],))[0]  # 2 in SD3's and FLUX.1's
        with pytest.raises(ValueError, match=f"its config targets {queries} modules it has no tensors for"):
            engine.load_lora("policy", partial, config)
        with pytest.raises(ValueError, match="needs a config"):
            engine.load_lora("policy", policy)
        key = sorted(policy)[0]
        diverged = {**policy, key: torch.full_like(policy[key], float("nan"))}
        version = engine.weight_version
        with pytest.raises(ValueError, match=f"LoRA 'policy' refused: 1 of its tensors hold NaN.*{re.escape(key)}"):
            engine.load_lora("policy", diverged, config)
        assert engine.weight_version == version
        assert engine.list_loras() == ["policy"]
        assert _same(before, _lora_images(engine, "policy"))
    finally:
        engine.unload_lora("policy")


def rank_refusal(name: str, tensors: dict, expected_rank: int) -> str:
    """The refusal (a regex) of adapter `name` whose first tensor has another rank than `expected_rank`."""
    key = next(iter(tensors))
    got = list(tensors[key].shape)
    expected = [expected_rank, got[1]] if ".lora_A." in key else [got[0], expected_rank]
    return re.escape(f"LoRA {name!r} refused: {key} expected {expected}, got {got}")


def test_a_lora_whose_rank_is_not_its_configs_is_refused_naming_the_tensor(engine, lora_tensors):
    """Rank-4 tensors under a config of r=8 are refused (ValueError) with the tensor's name and
    shapes, under a new name and under a new layout alike, as a hot swap of the same layout is
    refused (its rank-8 tensors against the live rank-4 layers); the adapter loaded before stays."""
    (policy, _), config = lora_tensors
    wider = {**config, "r": 8}
    with pytest.raises(ValueError, match=rank_refusal("fresh", policy, 8)):
        engine.load_lora("fresh", policy, wider)
    assert engine.list_loras() == []
    engine.load_lora("policy", policy, config)
    try:
        before, version = _lora_images(engine, "policy"), engine.weight_version
        with pytest.raises(ValueError, match=rank_refusal("policy", policy, 8)):
            engine.load_lora("policy", policy, wider)
        doubled = {key: torch.cat([t, t], dim=0 if ".lora_A." in key else 1) for key, t in policy.items()}
        with pytest.raises(ValueError, match=rank_refusal("policy", doubled, 4)):
            engine.load_lora("policy", doubled, config)
        assert engine.weight_version == version and engine.list_loras() == ["policy"]
        assert _same(before, _lora_images(engine, "policy"))
        engine.load_lora("fresh", doubled, wider)  # rank 8 under r=8 loads
        engine.unload_lora("fresh")
    finally:
        engine.unload_lora("policy")


def test_lora_from_peft_and_diffusers_folders(engine, lora_tensors, tmp_path):
    from peft import LoraConfig
    from safetensors.torch import save_file

    (policy, _), config = lora_tensors
    engine.load_lora("from_tensors", policy, config)
    want = _lora_images(engine, "from_tensors")
    engine.unload_lora("from_tensors")

    peft_folder = tmp_path / "peft"
    peft_folder.mkdir()
    LoraConfig(**config).save_pretrained(peft_folder)
    save_file({f"base_model.model.{k}": v for k, v in policy.items()}, peft_folder / "adapter_model.safetensors")
    diffusers_folder = tmp_path / "diffusers"
    diffusers_folder.mkdir()
    save_file(
        {f"transformer.{k}": v for k, v in policy.items()}, diffusers_folder / "pytorch_lora_weights.safetensors"
    )
    for name, folder in (("peft", peft_folder), ("diffusers", diffusers_folder)):
        engine.load_lora(name, folder)
        # A diffusers file carries no alpha, so alpha = rank: scale 2 makes up for alpha 8 / rank 4.
        got = _lora_images(engine, name, scale=2.0 if name == "diffusers" else 1.0)
        engine.unload_lora(name)
        assert all((g.int() - w.int()).abs().max() <= 1 for g, w in zip(got, want, strict=True)), name
    with pytest.raises(ValueError, match="holds neither adapter_config.json"):
        engine.load_lora("nothing", tmp_path)


def _rss_mib(worker) -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.timeout(300)
def test_lora_load_swap_unload_cycles_do_not_grow_memory(engine, lora_tensors, case):
    if case[0] != "sd3":
        pytest.skip("memory growth is measured on one family (the code path is the same)")
    (policy, other), config = lora_tensors
    for _ in range(20):  # warm up allocator pools
        engine.load_lora("cycle", policy, config)
        engine.unload_lora("cycle")
    before = engine.collective_rpc(_rss_mib)
    cycles = 150  # a leak of a third of a MiB per cycle shows
    for _ in range(cycles):
        engine.load_lora("cycle", policy, config)
        engine.load_lora("cycle", other, config)
        engine.unload_lora("cycle")
    after = engine.collective_rpc(_rss_mib)
    growth = [a - b for a, b in zip(after, before, strict=True)]
    assert max(growth) < 50, f"resident memory grew by {growth} MiB over {cycles} cycles"


def test_a_merged_adapter_is_merged_once_per_change_not_per_step(engine, lora_tensors, original_weights):
    """With merge_lora on (float32 "auto"), a step runs an adapter that is merged already as it is:
    every rank merges once per change of adapter, and once more after a weight push or any worker
    function but the read-only ones (which get the base weights back), never once per step. The
    workers count their merges themselves (`hot_swap_state`, read-only: it leaves a merge in place)."""
    (policy, other), config = lora_tensors
    assert engine.config.merges_lora
    engine.load_lora("policy", policy, config)
    engine.load_lora("other", other, config)
    once = [1] * engine.config.num_workers  # every replica gets a sample: every rank merges

    def merges_in_generate(lora: str) -> list[int]:
        """Each rank's merges during one 6-step generate with adapter `lora`."""
        before = [state["merges"] for state in engine.collective_rpc("hot_swap_state")]
        params = _params(engine, num_inference_steps=6, num_samples=engine.config.num_replicas, seed=5, lora=lora)
        engine.generate("a merged adapter", params)
        after = [state["merges"] for state in engine.collective_rpc("hot_swap_state")]
        return [a - b for a, b in zip(after, before, strict=True)]

    try:
        assert merges_in_generate("policy") == once
        assert merges_in_generate("policy") == [0] * len(once)  # still merged
        assert merges_in_generate("other") == once
        engine.update_weights(original_weights)  # a push restores the base weights and changes them
        assert merges_in_generate("other") == once
        engine.collective_rpc(lambda worker: None)  # a worker function may read or write any weight
        assert merges_in_generate("other") == once
    finally:
        engine.unload_lora("policy")
        engine.unload_lora("other")


# The hot-swap API: sleep and wake.


def _transformer_elements(worker) -> int:
    return sum(t.numel() for t in base_state(worker.adapter.transformer).values())


def _weight_elements(engine) -> list[int]:
    return engine.collective_rpc(_transformer_elements)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_weights_and_wake_up_restores_them(engine, level):
    before = _images(engine)
    digests = {name: engine.weights_checksum(name) for name in ("transformer", "text_encoder")}
    engine.sleep(level)
    engine.sleep(level)  # idempotent
    assert _weight_elements(engine) == [0] * engine.config.num_workers
    with pytest.raises(RuntimeError, match=f"asleep \\(level {level}\\); call wake_up\\(\\) before generating"):
        engine.generate("x", _params(engine, num_inference_steps=2))
    with pytest.raises(RuntimeError, match="asleep"):
        engine.update_weights({})
    engine.wake_up()
    engine.wake_up()  # idempotent
    assert all(count > 0 for count in _weight_elements(engine))
    assert {name: engine.weights_checksum(name) for name in digests} == digests  # every component is back
    assert _same(before, _images(engine))


def test_level_2_reloads_the_saved_weights_and_resets_the_version(engine, original_weights):
    digest = engine.weights_checksum()
    engine.update_weights({name: t + 1 for name, t in original_weights.items()})
    assert engine.weight_version > 0 and engine.weights_checksum() != digest
    engine.sleep(1)
    engine.sleep(2)  # deeper: the host copy goes too
    engine.wake_up()
    assert engine.weights_checksum() == digest  # the model folder's weights
    assert engine.weight_version == 0


def test_cannot_sleep_with_requests_in_flight(engine):
    engine.add_request("x", _params(engine, num_inference_steps=3, seed=0), request_id="busy")
    with pytest.raises(RuntimeError, match="cannot sleep with 1 unfinished requests"):
        engine.sleep(1)
    engine.abort("busy")
    with pytest.raises(ValueError, match="sleep level must be 1"):
        engine.sleep(3)


# The hot-swap API: a trainer's broadcast group.


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_weights_through_a_broadcast_group(engine, original_weights):
    from rollout.weights.state import checksum
    from trainers_adapters.weights.broadcast import join_engine

    broadcaster = join_engine(engine, "127.0.0.1", _free_port())
    shifted = {name: t - 0.25 for name, t in original_weights.items()}
    version = broadcaster.push(engine, shifted, bucket_bytes=32 * 1024)
    assert version == engine.weight_version
    assert engine.weights_checksum() == checksum(shifted)
    name = next(iter(original_weights))
    with pytest.raises(ValueError, match=f"update refused.*\n  {re.escape(name)}: expected"):
        broadcaster.push(engine, {name: original_weights[name].double()})  # refused before any byte is sent
    engine.update_weights(original_weights)


def _break_lora_load(worker, rank):
    if worker.rank == rank:
        stage = worker.loras.stage

        def stage_then_fail(*args):
            stage(*args)
            raise RuntimeError("device lost while loading")

        worker.loras.stage = stage_then_fail


def _restore_lora_load(worker) -> None:
    vars(worker.loras).pop("stage", None)


def test_a_lora_load_that_fails_on_a_rank_is_taken_by_no_rank(engine, lora_tensors):
    """Every rank stages the adapter before any switches to it: one rank failing rolls every rank
    back to what it had (here its first adapter, which still serves, bitwise)."""
    (policy, other), config = lora_tensors
    engine.load_lora("policy", policy, config)
    before, version = _lora_images(engine, "policy"), engine.weight_version
    engine.collective_rpc(_break_lora_load, args=(engine.config.num_workers - 1,))
    try:
        with pytest.raises(
            RuntimeError, match=r"loading LoRA 'policy' failed on rank .*; every rank keeps the 'policy'"
        ):
            engine.load_lora("policy", other, config)
    finally:
        engine.collective_rpc(_restore_lora_load)
    assert engine.list_loras() == ["policy"] and engine.weight_version == version
    assert engine.collective_rpc(lambda worker: sorted(worker.loras.configs)) == [["policy"] for _ in _ranks(engine)]
    assert _same(before, _lora_images(engine, "policy"))
    engine.unload_lora("policy")
    assert engine.collective_rpc(lambda worker: sorted(worker.loras.configs)) == [[] for _ in _ranks(engine)]


def _break_add_adapter(worker):
    def fail(config, adapter_name):
        raise ValueError("PEFT could not build the layers")

    worker.adapter.transformer.add_adapter = fail


def _restore_add_adapter(worker) -> None:
    vars(worker.adapter.transformer).pop("add_adapter", None)


def test_a_new_layout_that_fails_midway_leaves_the_old_adapter_serving(engine, lora_tensors):
    """A hot swap to a new layout builds the new layers beside the old ones; if PEFT then fails
    (even with a ValueError), the old adapter still serves, bitwise, and the next load works."""
    (policy, _), config = lora_tensors
    engine.load_lora("policy", policy, config)
    before = _lora_images(engine, "policy")
    bigger = {**config, "r": 8}
    tensors = {k: torch.cat([v, v], dim=0 if ".lora_A." in k else 1) for k, v in policy.items()}
    engine.collective_rpc(_break_add_adapter)
    try:
        with pytest.raises(RuntimeError, match="loading LoRA 'policy' failed on rank .*every rank keeps the 'policy'"):
            engine.load_lora("policy", tensors, bigger)
    finally:
        engine.collective_rpc(_restore_add_adapter)
    assert engine.list_loras() == ["policy"]
    assert engine.collective_rpc(lambda worker: sorted(worker.loras.configs)) == [["policy"] for _ in _ranks(engine)]
    assert _same(before, _lora_images(engine, "policy"))
    engine.load_lora("policy", tensors, bigger)  # the engine still works
    assert engine.collective_rpc("hot_swap_state")[0]["loras"]["policy"] == engine.lora_modules("policy")
    engine.unload_lora("policy")


def test_trainer_recomputes_rollout_log_probs_with_ratio_one(engine, trainer_adapter):
    from rollout.rescoring import recompute_log_probs

    params = _params(engine, num_inference_steps=4, num_samples=2, seed=13, sde_window=(0, 3))
    for output in engine.generate(["a red square", "a blue circle"], params):
        trajectory = output.trajectory
        log_ratio = recompute_log_probs(trainer_adapter, trajectory) - trajectory.log_probs
        assert log_ratio.abs().max() < RATIO_TOLERANCE


def test_tree_rollouts_batch_with_flat_requests_and_rescore_with_ratio_one(engine, model_path, trainer_adapter):
    from rollout.rescoring import recompute_log_probs

    prompts = ["a red square", "a blue circle"]
    params = [
        _params(engine, num_inference_steps=4, num_samples=2, seed=21, branch_steps=(1, 2), branch_factor=2),
        _params(engine, num_inference_steps=4, num_samples=2, seed=21),  # flat, in the same batches
    ]
    outputs = engine.generate(prompts, params)
    with type(engine)(EngineConfig(model=model_path)) as reference_engine:
        reference = reference_engine.generate(prompts, params)
    assert [(o.prompt_index, o.sample_index, o.branch_path) for o in outputs] == [
        (0, k, (a, b)) for k in range(2) for a in range(2) for b in range(2)
    ] + [(1, k, ()) for k in range(2)]
    for got, want in zip(outputs, reference, strict=True):
        assert got.request_id.partition("-")[2] == want.request_id.partition("-")[2] and got.seed == want.seed
        assert (got.trajectory.latents.stack() - want.trajectory.latents.stack()).abs().max() < 1e-5
        log_ratio = recompute_log_probs(trainer_adapter, got.trajectory) - got.trajectory.log_probs
        assert log_ratio.abs().max() < RATIO_TOLERANCE
    # Each root's history before its first branch is one tensor in this process, for its 4 leaves.
    assert len({id(o.trajectory.latents.parts[0]) for o in outputs[:4]}) == 1
    assert engine.collective_rpc("request_ids") == [[] for _ in _ranks(engine)]


def test_aborting_a_subtree_frees_it_and_its_siblings_run_on(engine):
    params = _params(engine, num_inference_steps=4, num_samples=2, seed=3, branch_steps=(1,), branch_factor=2)
    ids = engine.add_request("x", params, request_id="tree")
    assert ids == ["tree-0.0", "tree-0.1", "tree-1.0", "tree-1.1"]
    for _ in range(2):
        engine.step()
    assert sorted(i for held in _held_by_replica(engine) for i in held) == ids
    aborted = engine.abort(["tree-0.1", "tree-1"])  # one leaf, and the whole second root
    assert sorted((o.request_id, o.status) for o in aborted) == [
        (i, "aborted") for i in ("tree-0.1", "tree-1.0", "tree-1.1")
    ]
    assert [i for held in _held_by_replica(engine) for i in held] == ["tree-0.0"]
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [(o.request_id, o.status, o.branch_path) for o in outputs] == [("tree-0.0", "finished", (0,))]
    assert engine.collective_rpc("request_ids") == [[] for _ in _ranks(engine)]


def test_an_update_handed_over_applies_on_every_backend(engine, original_weights):
    from rollout.weights.handed_over import HandedOver
    from rollout.weights.state import checksum

    pushed = {name: t + 0.25 for name, t in original_weights.items()}
    digest = checksum(pushed)
    engine.update_weights(HandedOver(pushed))
    assert engine.weights_checksum() == digest
    engine.update_weights(original_weights)


def test_the_engine_never_aliases_the_callers_tensors(engine, original_weights):
    from rollout.weights.state import checksum

    pushed = {name: t.clone() + 0.125 for name, t in original_weights.items()}
    digest = checksum(pushed)
    engine.update_weights(pushed)
    for tensor in pushed.values():  # the trainer's optimizer step, in place
        tensor.mul_(3.0)
    assert engine.weights_checksum() == digest
    echoed = torch.ones(3)
    engine.collective_rpc(lambda worker, t: t.add_(1), args=(echoed,))
    assert torch.equal(echoed, torch.ones(3))
    engine.update_weights(original_weights)


def test_a_push_staged_in_parts_lets_requests_step_between_them(engine, original_weights):
    """`open_weight_push`: the HTTP server's streamed push stages each bucket in a call of its own;
    requests step on the old weights between the parts (bitwise as without the push), nothing
    else may update or sleep meanwhile, and the update applies whole at the end, or not at all."""
    from rollout.weights.handed_over import HandedOver
    from rollout.weights.state import checksum

    before, version = _images(engine), engine.weight_version
    pushed = {name: t + 0.25 for name, t in original_weights.items()}
    items = list(pushed.items())
    push = engine.open_weight_push(bucket_bytes=1)
    push.add(HandedOver(dict(items[: len(items) // 2])))
    assert all(torch.equal(a, b) for a, b in zip(_images(engine), before, strict=True))  # steps between the parts
    with pytest.raises(RuntimeError, match="is being received and staged"):
        engine.update_weights(original_weights)
    with pytest.raises(RuntimeError, match="is being received and staged"):
        engine.sleep(1)
    push.add(HandedOver(dict(items[len(items) // 2 :])))
    assert engine.finish_weight_push(push) == version + 1
    assert engine.weights_checksum() == checksum(pushed)
    dropped = engine.open_weight_push()
    dropped.add(iter(original_weights.items()))
    engine.abort_weight_push(dropped, ValueError("the body was cut off"))
    assert engine.weights_checksum() == checksum(pushed) and engine.weight_version == version + 1
    engine.update_weights(original_weights, version=version)


@pytest.mark.parametrize("timeout", [1e308, float("inf"), float("nan"), 0, -1])
def test_an_rpc_timeout_is_finite_positive_and_bounded(engine, timeout):
    with pytest.raises(ValueError, match=r"timeout must be a number of seconds in \(0, 604800\]"):
        engine.collective_rpc("get_rank", timeout=timeout)
