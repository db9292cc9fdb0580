"""Rollouts sampled ahead of the trainer, with bounded staleness (asynchronous GRPO).

While the trainer updates on the rollout of step k, a thread of its own samples the rollouts of
the next steps with the policy as it was `max_staleness` updates earlier: rollout j samples with
the adapter after max(0, j - N) updates, pushed just before it starts, so the trainer trains rollout
j with its samples exactly min(j, N) versions old. The rule makes the run deterministic, whatever
the timing (it depends on the seed and N only): a resumed run repeats it bitwise, and with N = 0
(each rollout waits for the update before it) it is the synchronous loop's run.

The adapters stay until no rollout or checkpoint needs them, so the trainer re-scores each step's
samples with the adapter that sampled them (`behaviour_of`): the re-scoring contract, checked every
step, as the synchronous loop checks the policy's own samples.

The thread makes every engine call of the loop (pushes included), one at a time, so the engine is
never driven from two threads. The trainer publishes a copy of its adapter after each update; a
rollout that needs a copy not published yet waits for it. An error on either side stops both: the
sampler's reaches the trainer at its next `rollout(step)`, and `close` stops a sampler mid-rollout
(its requests aborted) when the trainer fails.

Credits: the one-step-ahead pipelining is the "one-off" asynchronous PPO of Noukhovitch et al.
(arXiv 2410.18252) and AReaL's staleness bound (arXiv 2505.24298), with verl-omni and UniRL's
asynchronous trainers as the diffusion frameworks that use it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from trainers_adapters.rewards.rewarded_rollout import RewardedRollout, RolloutStopped

# sample(step, stop) -> the rewarded rollout of that step; it raises RolloutStopped once `stop` is set.
SampleFn = Callable[[int, threading.Event], RewardedRollout]
# push(adapter state, version) -> the version the engine reports.
PushFn = Callable[[dict[str, torch.Tensor], int], int]


class RolloutsAhead:
    """Samples the rollouts of `steps` on a thread, each with the adapter `behaviour_index(step)`
    updates old; `snapshots` holds the adapters (index: updates done -> PEFT state) it may need
    first, `pushed` the index the engine holds now (None: none of them, as after a resume).
    Use as a context manager: the thread starts on entry and is stopped and joined on exit."""

    def __init__(
        self,
        sample: SampleFn,
        push: PushFn,
        steps: range,
        max_staleness: int,
        base_version: int,
        snapshots: dict[int, dict[str, torch.Tensor]],
        pushed: int | None,
    ):
        self.max_staleness = max_staleness
        self.base_version = base_version  # the engine version of the adapter after 0 updates
        self._sample, self._push, self._steps = sample, push, steps
        self._snapshots = dict(snapshots)
        self._pushed = pushed
        self._rollouts: dict[int, RewardedRollout] = {}
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollouts-ahead", daemon=True)

    def __repr__(self) -> str:
        return f"RolloutsAhead(steps={self._steps}, max_staleness={self.max_staleness})"

    @property
    def pushed(self) -> int | None:
        """How many updates the adapter the engine holds has had (read once the thread is done)."""
        return self._pushed

    def behaviour_index(self, step: int) -> int:
        """How many updates the adapter that samples `step` has had."""
        return max(0, step - self.max_staleness)

    def version_of(self, index: int) -> int:
        """The engine weight version of the adapter after `index` updates."""
        return self.base_version + index

    def __enter__(self) -> RolloutsAhead:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the sampler (a rollout in flight is aborted) and wait for its thread."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        self._thread.join()

    def publish(self, index: int, state: dict[str, torch.Tensor]) -> None:
        """The trainer's adapter after `index` updates (a copy the trainer no longer changes)."""
        with self._changed:
            self._snapshots[index] = state
            self._changed.notify_all()

    def rollout(self, step: int) -> RewardedRollout:
        """The rollout of `step`, once sampled; raises what stopped the sampler."""
        with self._changed:
            while step not in self._rollouts and self._error is None:
                self._changed.wait()
            if step in self._rollouts:
                return self._rollouts.pop(step)
            raise self._error

    def behaviour_of(self, rollout: RewardedRollout) -> dict[int, dict[str, torch.Tensor]]:
        """The adapters that sampled `rollout`, by the weight version its steps ran with (what
        `grpo_step(behaviour=...)` re-scores them with); a version that none of this run's adapters
        was pushed as raises RuntimeError (the engine's adapter was changed from elsewhere)."""
        versions = {version for output in rollout.outputs for version in output.step_weight_versions}
        with self._changed:
            found = {version: self._snapshots.get(version - self.base_version) for version in versions}
            held = sorted(self.version_of(index) for index in self._snapshots)
        unknown = sorted(version for version, state in found.items() if state is None)
        if unknown:
            raise RuntimeError(
                f"samples carry weight version(s) {unknown}, which none of this run's adapters had (it holds "
                f"versions {held}): was the engine's adapter replaced from elsewhere?"
            )
        return found

    def pending_snapshots(self, done: int) -> dict[int, dict[str, torch.Tensor]]:
        """With `done` updates done: the adapters the rollouts of the steps from `done` on sample
        with that are not the policy itself (what a checkpoint keeps for a bitwise resume)."""
        with self._changed:
            return {i: self._snapshots[i] for i in range(self.behaviour_index(done), done)}

    def forget_before(self, done: int) -> None:
        """With `done` updates done (and its checkpoint written): drop the adapters that neither a
        later rollout nor a later checkpoint needs."""
        with self._changed:
            for old in [i for i in self._snapshots if i < self.behaviour_index(done)]:
                del self._snapshots[old]

    def _run(self) -> None:
        try:
            for step in self._steps:
                index = self.behaviour_index(step)
                state = self._wait_for(index)
                if state is None:
                    return  # stopped
                if self._pushed != index:
                    self._push(state, self.version_of(index))
                    self._pushed = index
                rollout = self._sample(step, self._stop)
                with self._changed:
                    self._rollouts[step] = rollout
                    self._changed.notify_all()
        except RolloutStopped:
            return
        except BaseException as error:  # reaches the trainer at its next rollout(step)
            with self._changed:
                self._error = error
                self._changed.notify_all()

    def _wait_for(self, index: int) -> dict[str, torch.Tensor] | None:
        with self._changed:
            while index not in self._snapshots and not self._stop.is_set():
                self._changed.wait()
            return None if self._stop.is_set() else self._snapshots[index]
