"""The training recipes on data-parallel trainer ranks as Ray actors (`--ray-ranks N`,
`recipes.ray_ranks`) on a local Ray: two ranks give the metrics and the LoRA of one rank (the
torchrun tests' tolerances), a rank that fails ends the run with an error naming it, and Ctrl-C
ends it too; every way, the ranks' actors and placement group are gone afterwards."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from recipes.loading import load_config, recipe_module
from recipes.ray_ranks import RankFailedError, RankPlace, rank_environments, run_on_ray_ranks
from recipes.run import main
from tests.recipes.test_checkpoint_resume import CONFIG, assert_same_lora
from tests.recipes.test_data_parallel_recipes import LORA_ATOL, assert_close_metrics, metrics, overrides

FAILING_REWARD = "reward=tests.recipes.rank_failing_reward.colour_except_on_rank_1"


def test_ranks_get_torchruns_variables_with_their_nodes_gpus():
    places = [RankPlace("a", ("3",)), RankPlace("b", ("0",)), RankPlace("a", ("1",)), RankPlace("a", ("10",))]
    environments = rank_environments(places, "10.0.0.1", 29500)
    assert [env["RANK"] for env in environments] == ["0", "1", "2", "3"]
    assert {env["WORLD_SIZE"] for env in environments} == {"4"}
    assert {(env["MASTER_ADDR"], env["MASTER_PORT"]) for env in environments} == {("10.0.0.1", "29500")}
    # Node a's ranks see its three rank GPUs, in the numeric order CUDA numbers them, and pick their own.
    assert [env["CUDA_VISIBLE_DEVICES"] for env in environments] == ["1,3,10", "0", "1,3,10", "1,3,10"]
    assert [env["LOCAL_RANK"] for env in environments] == ["1", "0", "0", "2"]
    cpu = rank_environments([RankPlace("a", ()), RankPlace("b", ()), RankPlace("a", ())], "h", 1)
    assert [env["LOCAL_RANK"] for env in cpu] == ["0", "0", "1"]
    assert all("CUDA_VISIBLE_DEVICES" not in env for env in cpu)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("config", "ranks", "message"),
    [
        ("rollout_tiny.yaml", "2", "is not one"),
        ("grpo_tiny.yaml", "0", "--ray-ranks must be >= 1, got 0"),
    ],
)
def test_the_cli_refuses_what_ray_ranks_cannot_run(tiny_model, tmp_path, capsys, config, ranks, message):
    argv = [str(CONFIG.with_name(config)), "--ray-ranks", ranks, "--set", f"model.path={tiny_model}"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--set", f"output_dir={tmp_path}"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def assert_all_released(ray, timeout_s: float = 30.0) -> None:
    """Every CPU of the cluster free again (the ranks' actors killed) and no placement group left."""
    deadline = time.monotonic() + timeout_s
    while True:
        free, total = ray.available_resources(), ray.cluster_resources()
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        if free.get("CPU") == total["CPU"] and not groups:
            return
        assert time.monotonic() < deadline, f"still held: {free} of {total}; placement groups {groups}"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "placement",
    [["trainer.placement=colocated"], ["trainer.placement=separate", "engine.executor=ray"]],
    # separate-ray: rank 0's engine places its worker in a placement group of its own beside the ranks'
    ids=["colocated-uni", "separate-ray"],
)
def test_two_ray_ranks_train_as_one_rank(ray_cluster, tiny_model, tmp_path, placement):
    summary = run_on_ray_ranks(load_config(CONFIG, overrides(tiny_model, tmp_path / "two", *placement)), 2)
    assert_all_released(ray_cluster)
    one = recipe_module("grpo").run(load_config(CONFIG, overrides(tiny_model, tmp_path / "one")))
    assert summary.keys() == one.keys() and summary["steps"] == one["steps"]  # rank 0's summary
    assert_close_metrics(metrics(tmp_path / "two"), metrics(tmp_path / "one"))
    assert_same_lora(tmp_path / "two" / "lora", tmp_path / "one" / "lora", atol=LORA_ATOL)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_failing_rank_ends_the_run_with_its_error(ray_cluster, tiny_model, tmp_path):
    config = load_config(CONFIG, overrides(tiny_model, tmp_path, FAILING_REWARD))
    with pytest.raises(RankFailedError) as failure:
        run_on_ray_ranks(config, 2)
    assert failure.value.rank == 1
    message = str(failure.value)
    assert message.startswith("trainer rank 1 of 2 failed")
    assert "this reward cannot score on trainer rank 1" in message, message
    assert 'rank_failing_reward.py", line' in message and "\x1b[" not in message  # its traceback, plain
    assert_all_released(ray_cluster)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_stops_the_ranks(ray_cluster, tiny_model, tmp_path):
    config = load_config(CONFIG, overrides(tiny_model, tmp_path / "run", "steps=50"))

    def press_ctrl_c() -> None:  # once rank 0 runs the recipe (it makes the output folder)
        while not (tmp_path / "run").is_dir():
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)

    # Python's own Ctrl-C for the test: a shell's background job (a CI runner's may be one) starts with
    # SIGINT ignored, and the run would then go on to its 50th step.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=press_ctrl_c, daemon=True).start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            run_on_ray_ranks(config, 2)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - started < 300  # not 50 steps
    assert_all_released(ray_cluster)
