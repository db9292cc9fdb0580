"""Rewards: what scores a rollout's samples, and where the scoring runs.

- `builtin`: the reward callables' type (`Reward`), the built-in rewards and `get_reward`;
- `models/`: reward models (CLIP score, PickScore, LAION aesthetic) over local model folders;
- `composite`: weighted sums of named rewards and groupwise rewards; `checks`: the check every
  reward's output passes; `spec`: rewards as plain data (a recipe's `reward:` key);
- `runner`, `placement`: where a rollout's groups are scored (a thread, `worker_pool`'s processes,
  `ray_pool`'s actors; `worker`, `worker_queue` and `wire` are what those share);
- `rewarded_rollout`: `generate_with_rewards`, each group scored as soon as it finishes;
- `service` (`python -m trainers_adapters.rewards.service`), `service_app`: the reward service,
  and `remote`: its client, `RemoteReward`.
"""
