"""Built-in rewards and reward lookup."""

from __future__ import annotations

import pytest
import torch

from trainers_adapters.rewards.builtin import colour_target, get_reward, jpeg_compressibility, jpeg_incompressibility

pytestmark = pytest.mark.timeout(30)


def _solid(rgb, size=32):
    return torch.tensor(rgb, dtype=torch.uint8).view(3, 1, 1).expand(3, size, size).clone()


def test_colour_reward_prefers_the_named_colour():
    images = torch.stack([_solid((255, 0, 0)), _solid((0, 0, 255)), _solid((128, 128, 128))])
    rewards = colour_target(images, ["a red square"] * 3, [{}] * 3)
    assert rewards[0] == pytest.approx(0.0, abs=1e-6)
    assert rewards[0] > rewards[2] > rewards[1]
    assert colour_target(images[1:2], ["A BLUE circle"], [{}]).item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="prompt 'a square' names no colour"):
        colour_target(images[:1], ["a square"], [{}])


def test_jpeg_rewards_rank_flat_above_noisy():
    flat = _solid((100, 150, 200))
    noisy = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    images = torch.stack([flat, noisy])
    compress = jpeg_compressibility(images, ["x", "x"], [{}, {}])
    assert compress[0] > compress[1]
    assert torch.equal(jpeg_incompressibility(images, ["x", "x"], [{}, {}]), -compress)


def test_get_reward_by_name_or_path():
    assert get_reward("colour") is colour_target
    assert get_reward("trainers_adapters.rewards.builtin.jpeg_compressibility") is jpeg_compressibility
    with pytest.raises(ValueError, match="unknown reward 'aesthetic'"):
        get_reward("aesthetic")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        get_reward("no_such_module.reward")


def test_colour_edit_wants_the_named_colour_and_the_inputs_layout():
    """Of edits with the same colours, the one that keeps the input's layout scores higher; of
    edits with the same layout, the one nearer the named colour. Without input images: an error."""
    from trainers_adapters.rewards.builtin import colour_edit

    square = torch.zeros(3, 16, 16, dtype=torch.uint8)
    square[2] = 200  # a blue background ...
    square[:, 4:12, 4:12] = torch.tensor([0, 200, 0], dtype=torch.uint8).view(3, 1, 1)  # ... a green square
    red_square = torch.zeros_like(square)
    red_square[0] = 120
    red_square[0, 4:12, 4:12] = 255  # the same layout, in reds
    moved = torch.roll(red_square, shifts=(5, 5), dims=(1, 2))  # the same colours, another layout
    blue_square = square.clone()  # the input itself: its layout, not red
    metadata = [{"input_images": [square]}] * 3
    rewards = colour_edit(torch.stack([red_square, moved, blue_square]), ["make it red"] * 3, metadata)
    assert rewards[0] > rewards[1] and rewards[0] > rewards[2]
    with pytest.raises(ValueError, match="carry no input_images"):
        colour_edit(red_square[None], ["make it red"], [{"input_images": None}])
