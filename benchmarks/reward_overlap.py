"""Reward overlap: one GRPO step's rollout and rewards with a slow reward, scored after the rollout,
on a thread of the trainer, and in a reward worker process.

Builds the tiny SD3 (random weights) behind an `mp` engine (one worker process) whose batches hold
one group, so the groups finish one after another, and a slow reward: `BusyReward` holds the GIL
(as tokenizers, PIL and Python-side pre-processing do; by default in a C sleep, which leaves the
machine's cores to the rollout; `--busy spin`: a Python loop, which takes a core too) for as long as
the rollout of one group takes (timed again at the start of each round, as the machine's load moves
it; `--reward-s` fixes it), then scores the colour built-in. Each round runs, in a rotated order:

  rollout   `engine.generate` alone: no reward (the floor);
  after     `engine.generate`, then each group scored in turn on this thread;
  thread    `generate_with_rewards` with the reward on a thread of this process (`RewardsOnThreads`);
  worker    `generate_with_rewards` with the reward in a `RewardWorkerPool` of one process.

The goal (issue 24): with a worker the step takes at most the rollout time plus the last group's
reward. Target: worker time / (rollout time + one group's reward) <= 1.10, the median of the
rounds' ratios. One worker can meet it only while a group's reward takes no longer than a group's
rollout (else the groups queue behind it). The rewards of the thread and worker modes are checked
equal to "after"'s.

    python -m benchmarks.reward_overlap                    # 4 groups of 2, 4 steps, 1 warmup + 3 rounds
    python -m benchmarks.reward_overlap --groups 8 --repeats 5 --json out.json
"""

from __future__ import annotations

import ctypes
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import harness
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.pipelines.tiny import build_tiny_sd3
from trainers_adapters.rewards.builtin import colour_target
from trainers_adapters.rewards.composite import CompositeReward, RewardComponent
from trainers_adapters.rewards.rewarded_rollout import generate_with_rewards
from trainers_adapters.rewards.runner import RewardsOnThreads
from trainers_adapters.rewards.spec import RewardSpec
from trainers_adapters.rewards.worker_pool import RewardWorkerPool

MODES = {
    "rollout": "rollout alone (floor)",
    "after": "rewards after the rollout",
    "thread": "rewards on a thread",
    "worker": "rewards in a worker process",
}
TARGET_WORKER_VS_GOAL = 1.10
COLOURS = ("red", "green", "blue", "yellow", "cyan", "magenta", "orange", "purple")


class BusyReward:
    """The colour built-in after `seconds` of holding the GIL (per call: one group). mode "hold": one
    C sleep that keeps the GIL (ctypes.PyDLL does not release it), a scorer whose host code never lets
    the trainer's thread run, without taking a CPU core from the rollout, so a small machine measures
    the overlap and not its cores; "spin": a Python loop, which also takes a core. The seconds are
    read from `seconds_file` at each call: each round sets them to its own group's rollout time."""

    def __init__(self, seconds_file: str, mode: str = "hold"):
        if mode not in ("hold", "spin"):
            raise ValueError(f"BusyReward mode must be 'hold' or 'spin', got {mode!r}")
        self.seconds_file = Path(seconds_file)
        self.mode = mode

    def __call__(self, images, prompts, metadata) -> torch.Tensor:
        seconds = float(self.seconds_file.read_text())
        if self.mode == "hold":
            ctypes.PyDLL(None).usleep(int(seconds * 1e6))
        else:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass
        return colour_target(images, prompts, metadata)


def build_parser():
    parser = harness.parser("reward_overlap", __doc__, repeats=3, warmup=1)
    run = parser.add_argument_group("what to run")
    run.add_argument("--groups", type=harness.positive_int, default=4, help="prompts per step (groups)")
    run.add_argument("--group-size", type=harness.positive_int, default=2, help="samples per prompt")
    run.add_argument("--steps", type=harness.positive_int, default=4, help="denoising steps")
    run.add_argument(
        "--reward-s",
        type=float,
        default=None,
        help="seconds the reward takes per group (default: one group's rollout)",
    )
    run.add_argument(
        "--busy", choices=("hold", "spin"), default="hold", help="how the reward holds the GIL (see BusyReward)"
    )
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    with tempfile.TemporaryDirectory() as scratch:
        model = str(build_tiny_sd3(Path(scratch) / "sd3", seed=0))
        config = EngineConfig(model=model, executor="mp", num_workers=1, max_batch_size=args.group_size)
        with RolloutEngine(config) as engine:
            return _measure(args, argv, engine, Path(scratch) / "reward_s")


def _measure(args, argv, engine, seconds_file: Path) -> dict:
    report = harness.Report("reward_overlap", args, __doc__, argv)
    prompts = [f"a {COLOURS[i % len(COLOURS)]} square" for i in range(args.groups)]
    params = SamplingParams(num_inference_steps=args.steps, num_samples=args.group_size, seed=0)
    for _ in range(2):  # warm the worker before timing one rollout
        engine.generate(prompts, params)
    reward_s_of_round: dict[int, float] = {}

    def calibrate(round_) -> None:
        """Once per round, before its first mode: one group's rollout time, as the machine runs now."""
        if round_.index in reward_s_of_round:
            return
        rollout_s = harness.timed_call(engine.generate, prompts, params)[1]
        reward_s = args.reward_s if args.reward_s is not None else rollout_s / args.groups
        seconds_file.write_text(repr(reward_s))
        reward_s_of_round[round_.index] = reward_s
        print(f"  [{round_.tag}] a rollout took {rollout_s:.3f} s: the reward takes {reward_s:.3f} s per group")

    reward = CompositeReward([RewardComponent("busy", BusyReward(str(seconds_file), args.busy))])
    # By its module's name, not __main__'s: the worker imports it.
    settings = {"seconds_file": str(seconds_file), "mode": args.busy}
    spec = RewardSpec(name="busy", reward="benchmarks.reward_overlap.BusyReward", settings=settings)
    rewards: dict[str, torch.Tensor] = {}

    with RewardsOnThreads(reward) as on_thread, RewardWorkerPool([spec], num_workers=1) as workers:

        def after(round_):
            calibrate(round_)
            started = time.perf_counter()
            outputs = engine.generate(prompts, params)
            scores = []
            for index in range(args.groups):
                group = outputs[index * args.group_size : (index + 1) * args.group_size]
                images = torch.stack([o.image for o in group])
                metadata = [{"prompt_index": o.prompt_index, "sample_index": o.sample_index} for o in group]
                scores.append(reward.score(images, [o.prompt for o in group], metadata).total)
            rewards["after"] = torch.cat(scores)
            return time.perf_counter() - started

        def rewarded(mode, runner):
            def run(round_):
                calibrate(round_)
                rollout = generate_with_rewards(
                    engine, prompts, params, runner, request_prefix=f"{mode}{round_.index}-"
                )
                rewards[mode] = rollout.rewards
                return rollout.rollout_s

            return run

        modes = {
            "rollout": lambda round_: calibrate(round_) or harness.timed_call(engine.generate, prompts, params)[1],
            "after": after,
            "thread": rewarded("thread", on_thread),
            "worker": rewarded("worker", workers),
        }
        times = harness.run_rounds(modes, args.warmup, args.repeats)
    for mode in ("thread", "worker"):
        if not torch.equal(rewards[mode], rewards["after"]):
            raise AssertionError(f"{MODES[mode]} gave other rewards than scoring after the rollout")

    seconds = {mode: times[mode]["s"] for mode in modes}
    timed_reward_s = [reward_s_of_round[index] for index in sorted(reward_s_of_round)][args.warmup :]
    # Per round: its rollout plus one group's reward.
    goal = [rollout + reward_s for rollout, reward_s in zip(seconds["rollout"], timed_reward_s, strict=True)]
    reward_s = statistics.median(timed_reward_s)
    rows = []
    for mode in modes:
        stats = harness.Stats.of(seconds[mode])
        vs_rollout = harness.per_round_ratio(seconds[mode], seconds["rollout"])
        vs_goal = harness.per_round_ratio(seconds[mode], goal)
        rows.append([MODES[mode], stats.median, vs_rollout, vs_goal])
        report.results[mode] = {"s": stats, "vs_rollout": vs_rollout, "vs_goal": vs_goal}
    report.results["reward_s_per_group"] = timed_reward_s
    report.table(
        f"{args.groups} groups of {args.group_size}, {args.steps} steps, tiny SD3 (mp), reward {reward_s:.3f} s/group",
        ["mode", "median s", "time / rollout", "time / (rollout + 1 group's reward)"],
        rows,
        note="ratios: the median over rounds of each round's ratio; scoring after the rollout would take "
        f"about {1 + args.groups * reward_s / statistics.median(seconds['rollout']):.2f} x the rollout",
    )
    report.check(
        harness.Target(
            "worker time / (rollout + one group's reward)",
            report.results["worker"]["vs_goal"],
            "<=",
            TARGET_WORKER_VS_GOAL,
        )
    )
    return report.finish()


if __name__ == "__main__":
    main()
