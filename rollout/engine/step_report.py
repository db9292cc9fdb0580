"""What one engine step (or worker function) cost, for the engine's step observers.

Benchmarks and logs watch the engine through `RolloutEngine.add_step_observer(fn)`: after every
step that ran work, and every worker function, `fn(StepReport)` is called in the engine's thread.
Nothing is measured twice: the times come from the executor call and the workers' `RunnerOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepReport:
    kind: str  # "step": one denoising step of the scheduled batches; "rpc": a worker function
    name: str  # "step", or the worker function's name
    wall_s: float  # the engine's whole call: scheduling, the executor, making the outputs
    execute_s: float  # the executor call alone (for "rpc": the same as wall_s)
    # Per replica, in replica order (a rank each, unless sequence parallel groups ranks: then the
    # group's first rank's; "step" only; empty for "rpc"): seconds inside the worker's step (0 for
    # a replica with nothing to do), rows through the transformer and seconds in its forwards.
    compute_s: tuple[float, ...] = ()
    transformer_rows: tuple[int, ...] = ()
    transformer_s: tuple[float, ...] = ()
    finished: int = 0  # outputs that finished in this step
