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

from rollout.imports import warn_moved

# `trainers_adapters.rewards` was the built-ins' module; for one release their names still resolve
# here, with a DeprecationWarning (once per name) that names `builtin`.
_BUILTIN_NAMES = frozenset(
    {
        "Reward",
        "COLOURS",
        "LAYOUT_WEIGHT",
        "BUILTIN_REWARDS",
        "get_reward",
        "jpeg_compressibility",
        "jpeg_incompressibility",
        "colour_target",
        "colour_agreement",
        "colour_edit",
    }
)


def __getattr__(name: str):
    if name not in _BUILTIN_NAMES:  # a submodule not imported yet, or a typo
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from trainers_adapters.rewards import builtin

    warn_moved(f"{__name__}.{name}", f"{builtin.__name__}.{name}")
    value = globals()[name] = getattr(builtin, name)  # warned once: `from ... import` looks it up twice
    return value
