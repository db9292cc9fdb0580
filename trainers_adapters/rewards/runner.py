"""Where a rollout's groups are scored: the seam between `generate_with_rewards` and the rewards.

A `RewardRunner` takes one finished group at a time, `submit(images, prompts, metadata)`, and
answers with a future of its `RewardScores`, so the engine goes on denoising the other groups
while the group is scored. Two runners:
- `RewardsOnThreads`: the reward in this process, on a thread (the default: nothing to start);
- `RewardWorkerPool` (`trainers_adapters.rewards.worker_pool`): worker processes, each holding
  the reward's models once, on its own device;
- `RayRewardPool` (`trainers_adapters.rewards.ray_pool`): the same in Ray actors, on a cluster.
`placement.open_reward_runner` gives the one a recipe's `reward_workers`, `reward_runner`,
`reward_devices` and `reward_timeout_s` ask for.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from trainers_adapters.rewards.builtin import Reward
from trainers_adapters.rewards.composite import RewardScores, as_composite


class RewardRunner:
    """Base of the runners: `submit` one group, `close` (or leave the `with` block) when done."""

    def submit(self, images, prompts: Sequence[str], metadata: Sequence[dict]) -> Future[RewardScores]:
        """Score one group: images uint8 [n, 3, H, W] (or videos), its n prompts and metadata."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop whatever the runner started; a group not scored yet fails."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class RewardsOnThreads(RewardRunner):
    """`reward` scored in this process on `pool` (a one-thread pool of its own when None, shut down
    by `close`). A reward on the GIL (a tokenizer, PIL, Python loops) slows the rollout's own
    thread while it runs; a `RewardWorkerPool` does not."""

    def __init__(self, reward: Reward, pool: ThreadPoolExecutor | None = None):
        self.reward = as_composite(reward)
        self._own_pool = pool is None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="reward") if pool is None else pool

    def submit(self, images, prompts: Sequence[str], metadata: Sequence[dict]) -> Future[RewardScores]:
        return self.pool.submit(self.reward.score, images, prompts, metadata)

    def close(self) -> None:
        if self._own_pool:
            self.pool.shutdown(wait=True, cancel_futures=True)
