"""Each backend checks its own settings (`Executor.config_problems`); the engine reports them with
the config's own, all at once, before any worker starts (`rollout.engine.config_check`)."""

from __future__ import annotations

from executors.uni import UniExecutor
from rollout.engine.config_check import problems_without_model


class FussyExecutor(UniExecutor):
    """A user's backend with a rule of its own."""

    @classmethod
    def config_problems(cls, config):
        problems = super().config_problems(config)
        if config.max_batch_size > 4:
            problems.append(f"FussyExecutor batches at most 4 samples, got max_batch_size={config.max_batch_size}")
        return problems


def test_uni_runs_one_worker():
    assert problems_without_model(num_workers=2) == [
        "executor 'uni' runs one in-process worker, got num_workers=2; use executor='mp' or 'ray' for more"
    ]
    assert problems_without_model(num_workers=2, executor=UniExecutor) == [
        "executor 'uni' runs one in-process worker, got num_workers=2; use executor='mp' or 'ray' for more"
    ]
    # A num_workers that is no count at all gets the general rule alone.
    assert problems_without_model(num_workers=0) == ["num_workers must be an integer >= 1, got 0"]
    assert problems_without_model(executor="mp", num_workers=2) == []


def test_ray_checks_its_placement_strategy():
    assert problems_without_model(executor="ray", num_workers=2, ray_placement_strategy="PILE") == [
        "ray_placement_strategy must be one of ('PACK', 'SPREAD', 'STRICT_PACK', 'STRICT_SPREAD'), got 'PILE'"
    ]
    assert problems_without_model(executor="ray", ray_placement_strategy="SPREAD") == []


def test_a_users_executor_adds_its_own_rules_to_the_others():
    problems = problems_without_model(
        executor=f"{__name__}.FussyExecutor", num_workers=2, max_batch_size=8, dtype="float8"
    )
    assert sorted(problems) == sorted(
        [
            "executor 'uni' runs one in-process worker, got num_workers=2; use executor='mp' or 'ray' for more",
            "FussyExecutor batches at most 4 samples, got max_batch_size=8",
            "dtype must be one of ['bfloat16', 'float16', 'float32'], got 'float8'",
        ]
    )


def test_an_executor_that_does_not_resolve_has_no_rules_to_add():
    assert problems_without_model(executor="nowhere.Executor", num_workers=2) == [
        "executor 'nowhere.Executor': cannot import module 'nowhere': No module named 'nowhere'"
    ]
