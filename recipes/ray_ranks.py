"""The training recipes on N data-parallel trainer ranks as Ray actors, for runs over several nodes
from one command: `python -m recipes.run CONFIG --ray-ranks N`.

The ranks are what torchrun would start (`recipes.training`, `trainers_adapters.data_parallel`):
each actor gets the torch.distributed rendezvous torchrun would give it (RANK, WORLD_SIZE,
LOCAL_RANK, and MASTER_ADDR/MASTER_PORT: rank 0's node and a free port there) and runs the same
recipe function, so the run, its files and its checkpoints are those of torchrun with N ranks.

Ray: attached to a running cluster when `ray.is_initialized()` or `RAY_ADDRESS` says there is one
(the multi-node case), else a local one started here and stopped at the end, as the engine's `ray`
executor does. The ranks sit in one placement group of N bundles, `{"CPU": k}` on the CPU and
`{"GPU": 1, "CPU": k}` on CUDA (k: `engine.threads_per_worker`, else 1), strategy PACK: ranks fill
a node before the next, so the gradients' all-reduce and the rollouts' gather stay inside a node
where they can, and whole nodes are left for a separate engine; PACK still spreads over nodes when
one is full, where STRICT_PACK would refuse. A separate placement's `ray` engine is rank 0's own
business: its executor places its workers in a placement group of its own beside the ranks'.

On a GPU, Ray gives each rank actor its GPU; the ranks on one node then see all of that node's
rank GPUs (CUDA_VISIBLE_DEVICES) and LOCAL_RANK picks theirs, as under torchrun, so NCCL reaches
its peers on the node directly.

The launch ends with the actors killed and the placement group removed, whether the run finished,
a rank failed (`RankFailedError`: the rank and its traceback; the others get `FAILURE_GRACE_S` to
unwind, closing their engines, before they are killed), or the caller was interrupted (Ctrl-C).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipes.training_config import TrainingConfig

logger = logging.getLogger(__name__)

# After a rank fails, how long the others may take to fail or finish on their own (a peer's closed
# process group ends their collectives), unwinding their engines and files, before they are killed.
FAILURE_GRACE_S = 30.0
# Ray colours the actor's name in an error's text; the message may go to a file.
_ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
# How often the launcher looks up from waiting on the ranks, so that Ctrl-C answers promptly.
_POLL_S = 1.0


def import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError(
            "--ray-ranks needs Ray: pip install 'diffusion-rollout[ray]' (or pip install 'ray[default]')"
        ) from None
    return ray


class RankFailedError(RuntimeError):
    """A trainer rank failed; `rank`: the one whose failure ended the run (a rank whose error came out
    of a collective only saw a peer's failure), and the message carries its traceback."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class RankPlace:
    """Where Ray put a rank actor: its node and the GPUs it was given (none on the CPU)."""

    node_id: str
    gpu_ids: tuple[str, ...]


class TrainerRank:
    """Runs inside a Ray actor: one data-parallel trainer rank of a recipe."""

    def __init__(self):
        self._failed_in_a_collective = False

    def place(self) -> RankPlace:
        ray = import_ray()
        return RankPlace(ray.get_runtime_context().get_node_id(), tuple(str(i) for i in ray.get_gpu_ids()))

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a port free on it (rank 0's: the process group's store)."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return import_ray().util.get_node_ip_address(), port

    def run(self, config: TrainingConfig, environment: dict[str, str]) -> dict:
        """Run the recipe as a torchrun rank with `environment`; rank 0's summary, {} elsewhere."""
        import torch.distributed

        from recipes.loading import recipe_module
        from recipes.run_log import configure_logging

        os.environ.update(environment)
        configure_logging(environment["RANK"] == "0")
        try:
            return recipe_module(config.recipe).run(config)
        except BaseException as error:
            # Raised in torch.distributed: a collective that a failed peer left (gloo: "Connection
            # closed by peer"), most likely; the launcher names the peer's failure first.
            innermost = traceback.extract_tb(error.__traceback__)[-1].filename
            self._failed_in_a_collective = Path(innermost).is_relative_to(Path(torch.distributed.__file__).parent)
            raise

    def failed_in_a_collective(self) -> bool:
        return self._failed_in_a_collective


def rank_environments(places: list[RankPlace], address: str, port: int) -> list[dict[str, str]]:
    """Each rank's torchrun variables: RANK and WORLD_SIZE, MASTER_ADDR/PORT (rank 0's), and
    LOCAL_RANK, its index among the ranks of its node; with GPUs, CUDA_VISIBLE_DEVICES is the node's
    rank GPUs and LOCAL_RANK the index of the rank's own among them (as torchrun's `cuda:LOCAL_RANK`)."""
    on_node: dict[str, list[int]] = defaultdict(list)
    for rank, place in enumerate(places):
        on_node[place.node_id].append(rank)
    environments = []
    for rank, place in enumerate(places):
        environment = {
            "RANK": str(rank),
            "WORLD_SIZE": str(len(places)),
            "MASTER_ADDR": address,
            "MASTER_PORT": str(port),
            "LOCAL_RANK": str(on_node[place.node_id].index(rank)),
        }
        if place.gpu_ids:
            node_gpus = sorted({gpu for peer in on_node[place.node_id] for gpu in places[peer].gpu_ids}, key=int)
            environment["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
            environment["LOCAL_RANK"] = str(node_gpus.index(place.gpu_ids[0]))
        environments.append(environment)
    return environments


def launch_problem(config, num_ranks: int) -> str | None:
    """What is wrong with launching `config` on `num_ranks` Ray ranks, or None."""
    if not isinstance(config, TrainingConfig):
        return f"--ray-ranks runs the training recipes; recipe {config.recipe!r} is not one (run it without)"
    if num_ranks < 1:
        return f"--ray-ranks must be >= 1, got {num_ranks}"
    return None


def run_on_ray_ranks(config: TrainingConfig, num_ranks: int, placement_timeout_s: float = 600.0) -> dict:
    """Run the training recipe `config` names on `num_ranks` Ray actors (see the module's docstring);
    returns rank 0's summary. `placement_timeout_s`: how long the ranks' bundles may wait for room
    (an autoscaling cluster adds nodes in minutes) before the launch fails naming the bundles."""
    problem = launch_problem(config, num_ranks)
    if problem is not None:
        raise ValueError(problem)
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    started_ray = False
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"])
        else:  # the ranks' logs (rank 0's progress, the others' warnings) show here
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False)
            started_ray = True
    cpus = config.engine.threads_per_worker or 1
    bundle = {"CPU": cpus} | ({"GPU": 1} if config.engine.device.startswith("cuda") else {})
    group = placement_group([bundle] * num_ranks, strategy="PACK")
    actors: list = []
    try:
        try:
            ray.get(group.ready(), timeout=placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"Ray could not place {num_ranks} trainer ranks of {bundle} within {placement_timeout_s}s (strategy "
                f"PACK); cluster resources: {ray.cluster_resources()}; ask for fewer ranks or add nodes"
            ) from None
        actor_cls = ray.remote(TrainerRank)
        actors += [
            actor_cls.options(
                num_cpus=cpus,
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(num_ranks)
        ]
        places = ray.get([actor.place.remote() for actor in actors])
        address, port = ray.get(actors[0].rendezvous.remote())
        environments = rank_environments(places, address, port)
        runs = {actor.run.remote(config, environments[rank]): rank for rank, actor in enumerate(actors)}
        return _rank0_summary(ray, runs, actors)
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)
        if started_ray:
            ray.shutdown()


def _rank0_summary(ray, runs: dict[Any, int], actors: list) -> dict:
    """Wait for every rank; rank 0's result, or a RankFailedError naming the rank that failed first
    (and the others that failed in the grace that follows) with its traceback."""
    count = len(runs)
    results: dict[int, dict] = {}
    failures: dict[int, str] = {}  # in the order they came
    deadline = None
    while runs and (deadline is None or time.monotonic() < deadline):
        ready, _ = ray.wait(list(runs), num_returns=1, timeout=_POLL_S)
        if not ready:
            continue
        rank = runs.pop(ready[0])
        try:
            results[rank] = ray.get(ready[0])
        except ray.exceptions.RayTaskError as error:  # the recipe raised: its traceback, without Ray's colours
            failures[rank] = _ANSI_COLOUR.sub("", str(error))
        except ray.exceptions.RayError as error:  # the actor or its node died
            failures[rank] = f"its Ray actor died: {type(error).__name__}: {error}"
        if failures and deadline is None:
            deadline = time.monotonic() + FAILURE_GRACE_S
    if not failures:
        return results[0]
    first = _first_failure(ray, failures, actors)
    message = f"trainer rank {first} of {count} failed: {failures[first]}"
    for rank in failures.keys() - {first}:
        last_line = failures[rank].strip().splitlines()[-1]
        message += f"\n(trainer rank {rank} failed too: {last_line})"
    if runs:
        message += f"\n(trainer ranks {sorted(runs.values())} were still running and were stopped)"
    raise RankFailedError(first, message)


def _first_failure(ray, failures: dict[int, str], actors: list) -> int:
    """The failed rank to name: the first whose error did not come out of a collective, which a
    peer's failure ends on the ranks waiting in it (they may report before the peer does)."""
    for rank in failures:
        try:
            if not ray.get(actors[rank].failed_in_a_collective.remote(), timeout=10):
                return rank
        except ray.exceptions.RayError:  # its actor died: a cause, not a consequence
            return rank
    return next(iter(failures))
