"""The hot-swap bookkeeping on its own: a `HotSwap` over two fake ranks whose worker functions keep
their state in memory and fail where a test scripts it. What the engine believes (weight version,
adapters, sleep level, the encoders' generation) must match what the ranks hold after every outcome.
The engine's part (its open and dead state, draining between the phases) is tested on real engines
(tests/rollout/weights/test_weight_failures.py, the executor contract)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from rollout.api import DEFAULT_BUCKET_BYTES, DEFAULT_COMPONENT
from rollout.config import EngineConfig
from rollout.engine.hot_swap import HotSwap
from rollout.errors import EngineDeadError, WorkerError
from rollout.weights.staging import StagingHandle
from rollout.weights.state import TensorSpec
from rollout.worker.worker import Worker

pytestmark = pytest.mark.timeout(30)

SPECS = {"w": TensorSpec((2,), torch.float32)}


@dataclass
class FakeRank:
    weights: torch.Tensor = field(default_factory=lambda: torch.zeros(2))
    staged: dict = field(default_factory=dict)
    reserved: list = field(default_factory=list)  # staging buffers the engine writes buckets into
    loras: dict = field(default_factory=dict)  # name -> modules bound
    staged_loras: dict = field(default_factory=dict)
    sleep_level: int = 0


class FakeWorkers:
    """The worker functions `HotSwap` calls, on `ranks` in-memory ranks. `script[method]` is what
    the next call of `method` does instead: an exception to raise from rank 1 (after rank 0 ran)."""

    def __init__(self, ranks: int = 2):
        self.ranks = [FakeRank() for _ in range(ranks)]
        self.calls: list[str] = []
        self.script: dict[str, BaseException] = {}

    def rpc(self, method, args=(), kwargs=None, timeout=None, ranks=None):
        method = method if isinstance(method, str) else method.__name__  # `Worker.sleep` travels as "sleep"
        self.calls.append(method)
        results = []
        for index in ranks if ranks is not None else range(len(self.ranks)):
            if index == 1 and method in self.script:
                raise self.script.pop(method)
            results.append(getattr(self, method)(self.ranks[index], *args))
        return results

    def weight_specs(self, rank, component):
        return SPECS

    def stage_weights(self, rank, component, bucket):
        rank.staged.update(bucket)

    def reserve_staging(self, rank, sizes, shared, in_process):
        buffers = [torch.zeros(nbytes, dtype=torch.uint8) for nbytes in sizes]
        rank.reserved += buffers
        return [StagingHandle(nbytes, flat=flat) for nbytes, flat in zip(sizes, buffers, strict=True)]

    def stage_weights_from_staging(self, rank, component, layout):
        rank.staged.update(layout.views(rank.reserved.pop(0)))

    def apply_staged_weights(self, rank, component):
        pass

    def staged_weights_are_live(self, rank, component):
        return all(torch.equal(tensor, rank.weights) for tensor in rank.staged.values())

    def commit_weights(self, rank, component):
        rank.weights = rank.staged.pop("w")

    def rollback_weights(self, rank, component):
        rank.staged.clear()
        rank.reserved.clear()

    def stage_lora(self, rank, name, source, config, check_finite):
        rank.staged_loras[name] = 3
        return 3

    def commit_lora(self, rank, name):
        rank.loras[name] = rank.staged_loras.pop(name)

    def rollback_lora(self, rank, name):
        rank.staged_loras.pop(name, None)

    def discard_lora(self, rank, name):
        rank.staged_loras.pop(name, None)
        rank.loras.pop(name, None)

    def unload_lora(self, rank, name):
        del rank.loras[name]

    def sleep(self, rank, level):
        rank.sleep_level = max(rank.sleep_level, level)

    def wake_up(self, rank):
        rank.sleep_level = 0

    def hot_swap_state(self, rank):
        return {"loras": dict(rank.loras), "sleep_level": rank.sleep_level}

    def weights_checksum(self, rank, component):
        return str(rank.weights.tolist())


def worker_error(method: str, error: BaseException) -> WorkerError:
    return WorkerError(method, 1, WorkerError.type_path(error), str(error), "(remote traceback)")


@dataclass
class FakeExecutor:
    """What a `HotSwap` reads of its executor."""

    config: EngineConfig
    worker_cls: type = Worker
    shares_memory: bool = True  # the ranks' staging buffers come back as tensors


@dataclass
class AnySpec:
    """A model spec that takes every component."""

    def check_component(self, component: str) -> None:
        pass


@pytest.fixture
def swap(tmp_path):
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    workers = FakeWorkers()
    hot_swap = HotSwap(FakeExecutor(EngineConfig(model=str(tmp_path))), AnySpec(), workers.rpc)
    return hot_swap, workers


def checked(hot_swap, named_tensors, *, version=None, mode="wait"):
    """`RolloutEngine.update_weights`'s first phase, with its defaults."""
    return hot_swap.weight_update(
        named_tensors,
        component=DEFAULT_COMPONENT,
        version=version,
        mode=mode,
        check_finite=True,
        bucket_bytes=DEFAULT_BUCKET_BYTES,
    )


def update(hot_swap, named_tensors, **options) -> int:
    """`RolloutEngine.update_weights`'s phases without an engine (which drains between them)."""
    return hot_swap.apply_update(checked(hot_swap, named_tensors, **options))


def load(hot_swap, name: str, version=None) -> int:
    """`RolloutEngine.load_lora`'s phases without an engine (which drains between them)."""
    staged = hot_swap.stage_lora(name, {"a": torch.ones(1)}, {"r": 1}, version=version, check_finite=True)
    return staged.version if staged.repeat else hot_swap.commit_lora(staged)


def test_an_update_reaches_every_rank_and_bumps_version_and_generation(swap):
    hot_swap, workers = swap
    pending = checked(hot_swap, {"w": torch.ones(2)})
    assert workers.calls == [] and hot_swap.weight_version == 0  # checked whole; the engine drains now
    assert pending.mode == "wait" and hot_swap.apply_update(pending) == 1
    assert [r.weights.tolist() for r in workers.ranks] == [[1.0, 1.0]] * 2
    assert (hot_swap.weight_version, hot_swap.encoder_generation) == (1, 1)
    assert update(hot_swap, {"w": torch.ones(2)}, version=7, mode="pause") == 7


def test_a_version_goes_down_only_to_one_the_engine_held(swap):
    """17 then -5 is refused, naming the current version, before anything is staged or drained; a
    trainer resumed from a checkpoint re-pushes its checkpoint's version to the engine that held it:
    refused by the first phases (`weight_update`, `stage_lora`), before the engine drains."""
    hot_swap, workers = swap
    assert update(hot_swap, {"w": torch.ones(2)}, version=5) == 5
    assert update(hot_swap, {"w": torch.ones(2)}) == 6
    assert load(hot_swap, "policy", version=17) == 17
    calls = len(workers.calls)
    message = "version -5 is below this engine's weight version 17, and no weights it held had it"
    with pytest.raises(ValueError, match=message):
        checked(hot_swap, {"w": torch.zeros(2)}, version=-5)
    with pytest.raises(ValueError, match="version 3 is below this engine's weight version 17.* > 17, or none for 18"):
        hot_swap.stage_lora("policy", {"a": torch.zeros(1)}, {"r": 1}, version=3, check_finite=True)
    with pytest.raises(ValueError, match="version must be an int or None, got True"):
        checked(hot_swap, {"w": torch.zeros(2)}, version=True)
    assert (len(workers.calls), hot_swap.weight_version) == (calls, 17)
    assert [r.weights.tolist() for r in workers.ranks] == [[1.0, 1.0]] * 2
    assert update(hot_swap, {"w": torch.ones(2)}, version=6) == 6  # held: a resumed trainer's
    assert update(hot_swap, {"w": torch.ones(2)}) == 7


def test_a_push_may_not_give_the_current_version_other_weights_nor_leave_64_bits(swap):
    """Version 5 pushed twice with different weights was taken: samples before and after carried 5
    for two sets of weights; now it is refused once staged (compared on every rank), and nothing is
    applied; the weights held, pushed again under 5, change nothing. And a 4300-digit version was
    taken, after which a server could write no answer (its version header) until it restarted: it
    is refused before anything is sent."""
    hot_swap, workers = swap
    assert update(hot_swap, {"w": torch.ones(2)}, version=5) == 5
    with pytest.raises(ValueError, match="version 5 is this engine's current weight version: .* pass 6 or none"):
        update(hot_swap, {"w": torch.zeros(2)}, version=5)
    assert update(hot_swap, {"w": torch.ones(2)}, version=5) == 5  # a repeat: nothing changes
    assert "apply_staged_weights" not in workers.calls[-4:] and not any(r.staged for r in workers.ranks)
    assert [r.weights.tolist() for r in workers.ranks] == [[1.0, 1.0]] * 2
    calls = len(workers.calls)
    for version in (1 << 63, -(1 << 63) - 1, 10**5000):
        with pytest.raises(ValueError, match="version must be a 64-bit signed integer .*got (-?\\d+|an integer of)"):
            checked(hot_swap, {"w": torch.zeros(2)}, version=version)
        with pytest.raises(ValueError, match="version must be a 64-bit signed integer"):
            hot_swap.stage_lora("policy", {"a": torch.zeros(1)}, {"r": 1}, version=version, check_finite=True)
    assert (len(workers.calls), hot_swap.weight_version) == (calls, 5)
    assert [r.weights.tolist() for r in workers.ranks] == [[1.0, 1.0]] * 2
    assert update(hot_swap, {"w": torch.zeros(2)}, version=(1 << 63) - 1) == (1 << 63) - 1
    with pytest.raises(ValueError, match="the weight version is at its largest"):
        update(hot_swap, {"w": torch.ones(2)})
    assert update(hot_swap, {"w": torch.ones(2)}, version=0) == 0  # where every engine starts


def test_a_refused_update_changes_nothing(swap):
    hot_swap, workers = swap
    with pytest.raises(ValueError, match="w"):
        update(hot_swap, {"w": torch.ones(3)})
    with pytest.raises(ValueError, match="non-finite|NaN|finite"):
        update(hot_swap, {"w": torch.tensor([0.0, float("nan")])})
    assert hot_swap.weight_version == 0 and hot_swap.encoder_generation == 0
    assert all(r.weights.tolist() == [0.0, 0.0] and not r.staged for r in workers.ranks)


def test_a_commit_that_fails_on_one_rank_is_the_engines_death(swap):
    hot_swap, workers = swap
    workers.script["commit_weights"] = worker_error("commit_weights", RuntimeError("disk full"))
    with pytest.raises(EngineDeadError, match="committing the update of transformer failed"):
        update(hot_swap, {"w": torch.ones(2)})
    assert hot_swap.weight_version == 0


def test_a_lora_refused_on_one_rank_is_rolled_back_everywhere(swap):
    hot_swap, workers = swap
    assert load(hot_swap, "policy") == 1
    workers.script["stage_lora"] = worker_error("stage_lora", ValueError("bad key"))
    with pytest.raises(ValueError, match="bad key"):  # by the first phase: before the engine drains
        hot_swap.stage_lora("policy", {"a": torch.ones(1)}, {"r": 1}, version=None, check_finite=True)
    assert hot_swap.list_loras() == ["policy"] and hot_swap.weight_version == 1
    assert all(r.loras == {"policy": 3} and not r.staged_loras for r in workers.ranks)


def test_a_lora_build_failure_names_the_rank_and_keeps_the_old_adapter(swap):
    hot_swap, workers = swap
    load(hot_swap, "policy")
    workers.script["stage_lora"] = worker_error("stage_lora", RuntimeError("peft broke"))
    with pytest.raises(RuntimeError, match="failed on rank 1.*peft broke.*keeps the 'policy' it had"):
        load(hot_swap, "policy")
    assert all(r.loras == {"policy": 3} for r in workers.ranks)


def test_a_staged_lora_the_engine_could_not_wait_for_is_dropped_everywhere(swap):
    hot_swap, workers = swap
    load(hot_swap, "policy")
    staged = hot_swap.stage_lora("policy", {"a": torch.ones(1)}, {"r": 1}, version=None, check_finite=True)
    assert all(r.staged_loras == {"policy": 3} for r in workers.ranks)
    hot_swap.drop_staged_lora(staged)  # the engine's drain failed
    assert hot_swap.list_loras() == ["policy"] and hot_swap.weight_version == 1
    assert all(r.loras == {"policy": 3} and not r.staged_loras for r in workers.ranks)


def test_a_lora_commit_that_fails_unloads_it_everywhere(swap):
    hot_swap, workers = swap
    workers.script["commit_lora"] = worker_error("commit_lora", RuntimeError("gone"))
    with pytest.raises(RuntimeError, match="unloaded everywhere"):
        load(hot_swap, "policy")
    assert hot_swap.list_loras() == [] and all(not r.loras for r in workers.ranks)


def test_a_lora_commit_whose_unload_fails_too_is_the_engines_death(swap):
    """Ranks that may disagree on what an adapter is must not serve, as after a failed rollback."""
    hot_swap, workers = swap
    workers.script["commit_lora"] = worker_error("commit_lora", RuntimeError("gone"))
    workers.script["discard_lora"] = worker_error("discard_lora", RuntimeError("still gone"))
    with pytest.raises(EngineDeadError, match="(?s)committing LoRA .policy. failed .*unloading it failed too"):
        load(hot_swap, "policy")
    assert hot_swap.list_loras() == []


def test_a_lora_stage_that_times_out_is_rolled_back(swap):
    hot_swap, workers = swap
    workers.script["stage_lora"] = TimeoutError("worker call 'stage_lora' timed out")
    with pytest.raises(TimeoutError, match="rolled back on every rank"):
        load(hot_swap, "policy")
    assert hot_swap.list_loras() == [] and all(not r.staged_loras for r in workers.ranks)


def test_a_lora_in_use_is_not_unloaded_and_names_are_checked(swap):
    hot_swap, _ = swap
    load(hot_swap, "policy")
    with pytest.raises(RuntimeError, match="1 unfinished requests use LoRA 'policy'"):
        hot_swap.unload_lora("policy", users=["req0-0"])
    with pytest.raises(RuntimeError, match="cannot sleep with 1 unfinished requests"):
        hot_swap.sleep(1, unfinished=1)
    with pytest.raises(ValueError, match="1-64 letters"):
        load(hot_swap, "a.b")
    hot_swap.unload_lora("policy", users=[])
    assert hot_swap.list_loras() == []


def test_sleep_and_wake_track_level_version_and_generation(swap):
    hot_swap, workers = swap
    update(hot_swap, {"w": torch.ones(2)})
    hot_swap.sleep(1, unfinished=0)
    with pytest.raises(RuntimeError, match="asleep"):
        hot_swap.check_awake()
    hot_swap.wake_up()
    assert (hot_swap.sleep_level, hot_swap.weight_version, hot_swap.encoder_generation) == (0, 1, 2)
    hot_swap.sleep(2, unfinished=0)
    hot_swap.wake_up()  # level 2 discarded the weights: the model folder's come back, version 0
    assert (hot_swap.sleep_level, hot_swap.weight_version, hot_swap.encoder_generation) == (0, 0, 3)
    assert all(r.sleep_level == 0 for r in workers.ranks)


def test_a_timed_out_call_is_read_back_and_split_adapters_dropped(swap):
    hot_swap, workers = swap
    load(hot_swap, "policy")
    workers.ranks[0].loras["stray"] = 1  # only one rank holds it
    workers.script["unload_lora"] = TimeoutError("worker call 'unload_lora' timed out")
    # Rank 0 unloaded "policy" before rank 1 timed out: it is split as well, and dropped too.
    with pytest.raises(TimeoutError, match="read their state back: LoRAs \\[\\] \\(dropped \\['policy', 'stray'\\]"):
        hot_swap.unload_lora("policy", users=[])
    assert hot_swap.list_loras() == [] and all(not r.loras for r in workers.ranks)


def test_ranks_at_different_sleep_levels_after_a_timeout_are_the_engines_death(swap):
    hot_swap, workers = swap
    workers.script["sleep"] = TimeoutError("worker call 'sleep' timed out")
    with pytest.raises(EngineDeadError, match="different sleep levels"):
        hot_swap.sleep(1, unfinished=0)
