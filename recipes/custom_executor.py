"""Example: your own executor and your own worker functions, next to the standard generate path.

    python -m recipes.custom_executor [--model DIR]

An executor is any `executors.Executor` subclass, named in `EngineConfig(executor=...)` by class or
by dotted path. Here `StepTimingExecutor` reuses the `mp` backend and records the wall time of
every engine step. Worker functions come from `worker_extension_cls`: every public method of
`LatentStatsExtension` becomes callable on every worker through `engine.collective_rpc(name)`;
inside it, `self` is the worker (`self.rank`, `self.adapter`, `self.requests`). Both only read,
and say so (`@read_only`): a rollout server calls such functions for any client by name.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

from executors.mp import MPExecutor
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.messages import SchedulerOutput
from rollout.worker.marks import read_only

logger = logging.getLogger(__name__)


class LatentStatsExtension:
    """Worker functions mixed into every worker (they must not reuse a worker method's name)."""

    @read_only
    def live_latent_norms(self) -> dict[str, float]:
        """Norm of the current latents of each request this worker holds, by request id."""
        return {request_id: float(state.latents.norm()) for request_id, state in self.requests.items()}

    @read_only
    def transformer_parameter_count(self) -> int:
        return sum(p.numel() for p in self.adapter.transformer.parameters())


class StepTimingExecutor(MPExecutor):
    """The `mp` backend, plus a record of how long each engine step took."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.step_seconds: list[float] = []

    def execute(self, scheduler_output: SchedulerOutput):
        start = time.perf_counter()
        outputs = super().execute(scheduler_output)
        self.step_seconds.append(time.perf_counter() - start)
        return outputs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.custom_executor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a local pipeline folder (default: build a tiny SD3 in a temp folder)")
    parser.add_argument("--num-workers", type=int, default=2, help="worker processes (default 2)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as scratch:
        if args.model is None:
            from rollout.pipelines.tiny import build_tiny_sd3

            args.model = str(build_tiny_sd3(f"{scratch}/tiny_sd3"))
        config = EngineConfig(
            model=args.model,
            executor=StepTimingExecutor,
            num_workers=args.num_workers,
            worker_extension_cls=LatentStatsExtension,
        )
        with RolloutEngine(config) as engine:
            logger.info("transformer parameters per worker: %s", engine.collective_rpc("transformer_parameter_count"))
            engine.add_request("a red square", SamplingParams(num_inference_steps=6, num_samples=4, seed=0))
            engine.step()
            logger.info("latent norms after one step, per rank: %s", engine.collective_rpc("live_latent_norms"))
            while engine.has_unfinished_requests():
                engine.step()
            steps = engine.executor.step_seconds
            logger.info("%d engine steps, median %.1f ms", len(steps), 1000 * statistics.median(steps))


if __name__ == "__main__":
    main()
