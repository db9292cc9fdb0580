"""Composite and groupwise rewards, and the check of every reward's output: a weighted sum whose
components stay visible, a groupwise judge that receives whole groups, and a NaN, an inf or a
wrong count refused with the reward's name and the samples'."""

from __future__ import annotations

import pickle

import pytest
import torch

from trainers_adapters.rewards.builtin import colour_target, jpeg_compressibility
from trainers_adapters.rewards.checks import RewardError, checked_scores
from trainers_adapters.rewards.composite import (
    CompositeReward,
    GroupwiseReward,
    RewardComponent,
    RewardScores,
    RewardWithComponents,
    as_composite,
    groupwise,
)
from trainers_adapters.rewards.models import ClipScore
from trainers_adapters.rewards.spec import RewardSpec, build_reward, reward_specs

pytestmark = pytest.mark.timeout(60)


def _batch(groups: list[int], samples_per_group: int = 2):
    """Images, prompts and metadata of the given prompt indices, `samples_per_group` each, the
    groups interleaved (sample 0 of every group, then sample 1, ...) as no caller orders them."""
    rows = [(group, sample) for sample in range(samples_per_group) for group in groups]
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (len(rows), 3, 16, 16), dtype=torch.uint8, generator=generator)
    prompts = [f"a {['red', 'green', 'blue'][group]} square" for group, _ in rows]
    metadata = [{"prompt_index": group, "sample_index": sample, "branch_path": ()} for group, sample in rows]
    return images, prompts, metadata


class MeanBrightnessWinRate(GroupwiseReward):
    """A pairwise judge (as Pref-GRPO's): each sample's share of the others in its group that it
    beats on mean brightness. It records the groups it was given."""

    name = "win_rate"

    def __init__(self):
        self.calls = []

    def __call__(self, images, prompts, metadata):
        self.calls.append([(m["prompt_index"], m["sample_index"]) for m in metadata])
        brightness = images.float().mean(dim=(1, 2, 3))
        wins = (brightness[:, None] > brightness[None, :]).float().sum(dim=1)
        return wins / (len(images) - 1)


def test_a_composite_is_the_weighted_sum_and_keeps_each_component(tiny_clip):
    images, prompts, metadata = _batch([0, 1], 2)
    clip = ClipScore(tiny_clip)
    composite = CompositeReward(
        [
            RewardComponent("colour", colour_target, 1.0),
            RewardComponent("jpeg", jpeg_compressibility, 0.5),
            RewardComponent("clip", clip, -0.25),
        ]
    )
    scores = composite.score(images, prompts, metadata)
    expected = {
        "colour": colour_target(images, prompts, metadata),
        "jpeg": jpeg_compressibility(images, prompts, metadata),
        "clip": clip(images, prompts, metadata),
    }
    assert list(scores.components) == ["colour", "jpeg", "clip"]
    for name, values in expected.items():
        torch.testing.assert_close(scores.components[name], values, atol=0, rtol=0)
    weighted = expected["colour"] + 0.5 * expected["jpeg"] - 0.25 * expected["clip"]
    torch.testing.assert_close(scores.total, weighted, atol=1e-6, rtol=0)
    torch.testing.assert_close(composite(images, prompts, metadata), scores.total, atol=0, rtol=0)
    single = as_composite(colour_target)  # a bare reward is a composite of itself, named by its function
    assert [c.name for c in single.components] == ["colour_target"]
    with pytest.raises(ValueError, match=r"component names must differ, got \['a', 'a'\]"):
        CompositeReward([RewardComponent("a", colour_target), RewardComponent("a", jpeg_compressibility)])
    with pytest.raises(ValueError, match="the weight of 'a' must be a finite number, got nan"):
        CompositeReward([RewardComponent("a", colour_target, float("nan"))])


def test_a_groupwise_reward_is_called_once_per_whole_group_and_its_scores_come_back_in_place():
    images, prompts, metadata = _batch([2, 0, 1], 3)  # rows: (2,0) (0,0) (1,0) (2,1) (0,1) ...
    judge = MeanBrightnessWinRate()
    calls = []

    def pointwise(images, prompts, metadata):
        calls.append(len(images))
        return torch.zeros(len(images))

    scores = CompositeReward([RewardComponent("judge", judge), RewardComponent("zero", pointwise)]).score(
        images, prompts, metadata
    )
    assert judge.calls == [[(2, 0), (2, 1), (2, 2)], [(0, 0), (0, 1), (0, 2)], [(1, 0), (1, 1), (1, 2)]]
    assert calls == [9]  # a pointwise reward scores the whole batch at once
    for group in (0, 1, 2):
        rows = [row for row, meta in enumerate(metadata) if meta["prompt_index"] == group]
        expected = MeanBrightnessWinRate()(images[rows], [prompts[r] for r in rows], [metadata[r] for r in rows])
        torch.testing.assert_close(scores.components["judge"][rows], expected, atol=0, rtol=0)

    @groupwise
    def best_of_group(images, prompts, metadata):
        """1 for the brightest sample of the group, 0 for the others."""
        brightness = images.float().mean(dim=(1, 2, 3))
        return (brightness == brightness.max()).float()

    assert isinstance(best_of_group, GroupwiseReward) and best_of_group.name == "best_of_group"
    best = as_composite(best_of_group).score(images, prompts, metadata).components["best_of_group"]
    winners = [int(best[[r for r, m in enumerate(metadata) if m["prompt_index"] == g]].sum()) for g in (0, 1, 2)]
    assert winners == [1, 1, 1]  # one per group: it saw each group alone
    with pytest.raises(RewardError, match=r"'win_rate' scores whole groups, .* prompt_index; rows \[0, 1\] have none"):
        as_composite(judge).score(images[:2], prompts[:2], [{}, {}])


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (float("nan"), r"reward 'judge' returned nan for 1 of 4 samples \(prompt 1 sample 0\); a reward must return"),
        (float("inf"), r"reward 'judge' returned inf for 1 of 4 samples \(prompt 1 sample 0\)"),
        (-float("inf"), r"reward 'judge' returned -inf for 1 of 4 samples"),
        (1e300, r"reward 'judge' returned inf for 1 of 4 samples"),  # float64 beyond float32's range
    ],
)
def test_a_non_finite_score_is_refused_naming_the_reward_and_the_sample(bad, message):
    images, prompts, metadata = _batch([0, 1], 2)  # rows: (0,0) (1,0) (0,1) (1,1)

    def judge(images, prompts, metadata):
        scores = torch.zeros(len(images), dtype=torch.float64)
        scores[1] = bad
        return scores

    composite = CompositeReward([RewardComponent("colour", colour_target), RewardComponent("judge", judge)])
    with pytest.raises(RewardError, match=message):
        composite.score(images, prompts, metadata)


def test_a_wrong_count_or_type_is_refused_naming_the_reward_and_the_samples():
    images, prompts, metadata = _batch([0], 2)
    metadata[1]["branch_path"] = (0, 2)
    with pytest.raises(RewardError, match=r"reward 'r' returned shape \(3,\) for 2 images \(prompt 0 sample 0, "):
        checked_scores("r", torch.zeros(3), metadata)
    with pytest.raises(RewardError, match=r"shape \(2, 1\) for 2 images .*sample 1 branch \[0, 2\]\); expected \[2\]"):
        checked_scores("r", torch.zeros(2, 1), metadata)
    with pytest.raises(RewardError, match=r"reward 'r' returned a NoneType for 2 images"):
        checked_scores("r", None, metadata)
    with pytest.raises(RewardError, match=r"returned nan for 1 of 1 samples \(row 0\)"):
        checked_scores("r", [float("nan")], [{}])  # a direct call without metadata: by row
    assert checked_scores("r", [1, 2], metadata).dtype == torch.float32
    weights_overflow = CompositeReward([RewardComponent("big", lambda i, p, m: torch.full((2,), 3e38), 10.0)])
    with pytest.raises(RewardError, match=r"reward 'the weighted sum of big' returned inf for 2 of 2 samples"):
        weights_overflow.score(images, prompts, metadata)


def test_a_reward_spec_is_plain_data_a_worker_can_build_from(tiny_clip):
    value = {"clip_score": {"weight": 2.0, "model": tiny_clip, "batch_size": 4}, "colour": 0.5}
    specs = reward_specs(value)
    assert specs == [
        RewardSpec("clip_score", "clip_score", 2.0, {"model": tiny_clip, "batch_size": 4}),
        RewardSpec("colour", "colour", 0.5),
    ]
    shipped = pickle.loads(pickle.dumps(specs[0]))  # what a reward worker process would receive
    reward = shipped.build()
    assert isinstance(reward, ClipScore) and reward.batch_size == 4
    composite = build_reward(value)
    assert [(c.name, c.weight) for c in composite.components] == [("clip_score", 2.0), ("colour", 0.5)]
    assert composite.components[1].reward is colour_target
    mine = build_reward({"mine": {"reward": "trainers_adapters.rewards.models.ClipScore", "model": tiny_clip}})
    assert isinstance(mine.components[0].reward, ClipScore)  # a dotted path to a class, built with its settings


class GroupParts(RewardWithComponents, GroupwiseReward):
    """A groupwise reward with components of its own, as a reward service's; `odd` names another
    component for the groups of odd prompt indices (a service that changed what it serves)."""

    def __init__(self, odd: str = "b"):
        self.odd = odd

    def score(self, images, prompts, metadata):
        brightness = images.float().mean(dim=(1, 2, 3)) / 255
        second = self.odd if metadata[0]["prompt_index"] % 2 else "b"
        return RewardScores(total=brightness + 1, components={"a": brightness, second: torch.ones(len(images))})


def test_a_component_with_components_of_its_own_passes_them_on_outside_the_sum():
    images, prompts, metadata = _batch([0, 1, 2])
    inner = CompositeReward([RewardComponent("colour", colour_target), RewardComponent("judge", GroupParts(), 2.0)])
    outer = CompositeReward([RewardComponent("service", inner, 0.5), RewardComponent("jpeg", jpeg_compressibility)])
    scores = outer.score(images, prompts, metadata)
    parts = ["service/colour", "service/judge", "service/judge/a", "service/judge/b"]
    assert list(scores.components) == ["service", *parts, "jpeg"]
    brightness = images.float().mean(dim=(1, 2, 3)) / 255
    torch.testing.assert_close(scores.components["service/judge/a"], brightness)  # put back in the batch's order
    torch.testing.assert_close(scores.components["service/judge"], brightness + 1)
    torch.testing.assert_close(scores.total, 0.5 * scores.components["service"] + scores.components["jpeg"])
    changed = CompositeReward([RewardComponent("judge", GroupParts(odd="c"))])
    with pytest.raises(
        RewardError,
        match=r"reward 'judge' gave components \['judge/a', 'judge/c'\] for prompt 1 but \['judge/a', 'judge/b'\]",
    ):
        changed.score(images, prompts, metadata)
    with pytest.raises(ValueError, match="component names must not hold '/'"):
        CompositeReward([RewardComponent("judge/a", colour_target)])
