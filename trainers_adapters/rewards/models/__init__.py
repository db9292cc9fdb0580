"""Reward models as library classes over local folders of the real transformers classes.

Each is built from plain arguments (folders, device, batch size), so a reward worker can build
its own copy from a `RewardSpec`; each scores a batch in `torch.no_grad` and returns [N] float32 on
CPU. Nothing is downloaded: give the folders of models you have (`huggingface-cli download ...`).
"""

from trainers_adapters.rewards.models.aesthetic import AestheticScore
from trainers_adapters.rewards.models.clip import ClipRewardModel
from trainers_adapters.rewards.models.clip_score import ClipScore
from trainers_adapters.rewards.models.pickscore import PickScore

# name in a recipe's `reward:` -> class
REWARD_MODELS: dict[str, type[ClipRewardModel]] = {
    ClipScore.name: ClipScore,
    PickScore.name: PickScore,
    AestheticScore.name: AestheticScore,
}

__all__ = ["REWARD_MODELS", "AestheticScore", "ClipRewardModel", "ClipScore", "PickScore"]
