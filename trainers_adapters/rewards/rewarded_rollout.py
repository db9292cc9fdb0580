"""A rollout with its rewards, where each prompt's group is rewarded as soon as all its samples
finish, on a background thread or in reward worker processes (`runner`), while the engine
keeps denoising the other groups.

With more samples than fit in one batch, the engine finishes the groups a few at a time, so a slow
reward model (a scorer on its own device, a remote service) overlaps with the rest of the rollout
instead of waiting behind it. The reward only sees images, prompts and (for an edit) the input
images; it never blocks the engine.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from rollout import NodeId, RolloutOutput, SamplingParams
from rollout.input_images import images_per_prompt
from trainers_adapters.rewards.builtin import Reward
from trainers_adapters.rewards.runner import RewardRunner, RewardsOnThreads


class RolloutStopped(Exception):
    """The caller's `stop` event ended a rollout before its last sample; its requests were aborted."""


@dataclass
class RewardedRollout:
    """outputs: ordered by prompt, then sample (then branch path, in a tree rollout: one output per
    leaf); rewards [N] float32 and group_ids [N] (the prompt index) follow that order, and so does
    each of reward_components (name -> [N] float32: a composite reward's components, unweighted; a
    single reward's own scores under its name)."""

    outputs: list[RolloutOutput]
    rewards: torch.Tensor
    group_ids: torch.Tensor
    rollout_s: float  # wall time from the first request to the last reward
    reward_wait_s: float  # of which the rollout waited for rewards after the last sample finished
    branch_steps: tuple[int, ...] = ()  # the sampling params' (the leaves' trees: `trainers_adapters.grpo.tree`)
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)
    # The outputs whose tensors this trainer rank holds, in data-parallel training
    # (`trainers_adapters.data_parallel.rollout_shares`): the others are light copies that carry
    # what every rank's bookkeeping reads (rewards, steps, versions), not latents or conditions.
    # None: every output is whole.
    held: range | None = None

    @property
    def trajectories(self):
        return [output.trajectory for output in self.outputs]

    def holds(self, index: int) -> bool:
        """Whether output `index` is whole here (this rank trains on it)."""
        return self.held is None or index in self.held


def generate_with_rewards(
    engine,
    prompts: Sequence[str],
    params: SamplingParams,
    reward: Reward | RewardRunner,
    pool: ThreadPoolExecutor | None = None,
    request_prefix: str = "rollout",
    images: Sequence | None = None,
    stop: threading.Event | None = None,
    first_prompt_index: int = 0,
) -> RewardedRollout:
    """Generate `params.num_samples` samples of every prompt (each a tree of leaves when `params`
    branch) and reward each group as it finishes: `reward` on `pool` (a thread of this process; a
    one-thread pool for this call when None), or by `reward` itself when it is a `RewardRunner`
    (`RewardWorkerPool`: in worker processes). A group whose scoring fails stops the rollout at the
    engine's next step, its requests aborted, with that error. The reward gets (images [n, 3, H, W]
    or videos [n, F, 3, H, W] uint8, prompts, metadata) with metadata per sample: prompt_index,
    sample_index, branch_path, seed, weight_version, and input_images: the prompt's input images
    (an edit's: `images`, one list of uint8 [3, H, W] per prompt, as `generate` takes them), or None.
    Every reward's output is checked (`trainers_adapters.rewards.checks`): a NaN, an inf or a wrong
    count raises a RewardError naming the reward and the samples, here, before the caller can update
    anything. Once `stop` is set (from another thread) the rollout ends at the engine's next step
    with RolloutStopped, its requests aborted. `first_prompt_index`: the prompt index (and request
    id number) of `prompts[0]`, the next ones following: a data-parallel trainer rank samples its
    share of a step's prompts under the indices, hence the seeds, they have in the whole step."""
    if params.output_type != "image":
        raise ValueError("a rewarded rollout needs images (or videos); set output_type='image' in the sampling params")
    if isinstance(reward, RewardRunner):
        if pool is not None:
            raise ValueError("pass a thread pool with a reward, not with a RewardRunner, which scores groups itself")
        return _generate(engine, prompts, params, reward, request_prefix, images, stop, first_prompt_index)
    with RewardsOnThreads(reward, pool) as runner:
        return _generate(engine, prompts, params, runner, request_prefix, images, stop, first_prompt_index)


def _generate(
    engine, prompts, params, runner: RewardRunner, request_prefix: str, images, stop, first: int
) -> RewardedRollout:
    started = time.perf_counter()
    group_of: dict[str, int] = {}
    finished: list[list[RolloutOutput]] = [[] for _ in prompts]
    futures: dict[int, Future] = {}
    inputs = images_per_prompt(images, len(prompts))  # uint8 tensors, as the reward gets them
    try:
        for index, prompt in enumerate(prompts):
            number = first + index
            ids = engine.add_request(
                prompt, params, images=inputs[index], prompt_index=number, request_id=f"{request_prefix}{number}"
            )
            group_of.update(dict.fromkeys(ids, index))
        while engine.has_unfinished_requests():
            if stop is not None and stop.is_set():
                raise RolloutStopped(f"rollout {request_prefix!r} stopped by its caller")
            for output in engine.step():
                index = group_of[output.request_id]
                group = finished[index]
                group.append(output)
                if len(group) == params.num_samples * params.leaves_per_sample:
                    futures[index] = runner.submit(*group_inputs(group, inputs[index]))
            _raise_first_failure(futures.values())
    except BaseException:
        # Leave no requests behind in the engine; a dead engine cannot abort, and then the
        # original error is the one worth seeing.
        with contextlib.suppress(Exception):
            engine.abort(list(group_of))
        raise
    last_sample_done = time.perf_counter()
    scores = [futures[index].result() for index in range(len(prompts))]
    done = time.perf_counter()
    outputs = [output for group in finished for output in sorted(group, key=_sample_order)]
    return RewardedRollout(
        outputs=outputs,
        rewards=torch.cat([score.total for score in scores]),
        group_ids=torch.tensor([output.prompt_index for output in outputs]),
        rollout_s=done - started,
        reward_wait_s=done - last_sample_done,
        branch_steps=params.branch_steps,
        reward_components={name: torch.cat([s.components[name] for s in scores]) for name in scores[0].components},
    )


def _sample_order(output: RolloutOutput) -> NodeId:
    return output.node_id  # within a group: by sample, then branch path


def _raise_first_failure(futures) -> None:
    """A group that failed fails the rollout now, not after the last sample: the rest is wasted."""
    for future in futures:
        if future.done() and future.exception() is not None:
            raise future.exception()


def group_inputs(group: list[RolloutOutput], input_images) -> tuple[torch.Tensor, list[str], list[dict]]:
    """(images, prompts, metadata) of one finished group, in sample (then branch) order."""
    group = sorted(group, key=_sample_order)
    images = torch.stack([output.image if output.video is None else output.video for output in group])
    metadata = [
        {
            "prompt_index": o.prompt_index,
            "sample_index": o.sample_index,
            "branch_path": o.branch_path,
            "seed": o.seed,
            "weight_version": o.weight_version,
            "input_images": None if input_images is None else list(input_images.tensors),
            # a video with sound (LTX-2): its waveform [channels, samples] float32 and sample rate
            **({"audio": o.audio, "audio_sample_rate": o.audio_sample_rate} if o.audio is not None else {}),
        }
        for o in group
    ]
    return images, [o.prompt for o in group], metadata
