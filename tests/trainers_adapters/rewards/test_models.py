"""The reward model classes equal the published computation done directly with transformers, on
a tiny random CLIP saved to a folder: batched and one image at a time, within 1e-5."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import CLIPModel, CLIPProcessor

from trainers_adapters.rewards.models import AestheticScore, ClipScore, PickScore

pytestmark = pytest.mark.timeout(60)

PROMPTS = ["a red square", "a photo of a cat on a mat", "x", "a blue circle, highly detailed, 4k"]


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    # Not the processor's 32 px and not square: its resize and centre crop both do something.
    return torch.randint(0, 256, (4, 3, 40, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def clip(tiny_clip):
    return CLIPModel.from_pretrained(tiny_clip).eval(), CLIPProcessor.from_pretrained(tiny_clip, backend="pil")


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / torch.norm(x, dim=-1, keepdim=True)


def _alone_and_batched(reward, images, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    metadata = [{}] * len(images)
    batched = reward(images, prompts, metadata)
    alone = torch.cat([reward(images[i : i + 1], prompts[i : i + 1], metadata[:1]) for i in range(len(images))])
    assert batched.dtype == torch.float32 and batched.shape == (len(images),)
    return batched, alone


def test_clip_score_is_100_times_the_cosine_clipped_at_0(tiny_clip, clip, images):
    model, processor = clip
    with torch.no_grad():  # torchmetrics' path: uint8 tensors to the processor, text padded
        pixels = processor(images=list(images), return_tensors="pt", padding=True)["pixel_values"]
        tokens = processor(text=PROMPTS, return_tensors="pt", padding=True)
        image = _unit(model.get_image_features(pixel_values=pixels).pooler_output)
        text = _unit(model.get_text_features(**tokens).pooler_output)
    cosine = (image * text).sum(-1)
    expected = torch.clamp(100 * cosine, min=0)
    assert (cosine > 0).any() and (cosine < 0).any(), "the tiny model should test both sides of the clip"
    reward = ClipScore(tiny_clip, batch_size=8)
    batched, alone = _alone_and_batched(reward, images, PROMPTS)
    torch.testing.assert_close(batched, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(alone, expected, atol=1e-5, rtol=0)
    reward.batch_size = 3
    chunked = reward(images, PROMPTS, [{}] * 4)  # one batch over two forward passes
    torch.testing.assert_close(chunked, expected, atol=1e-5, rtol=0)


def test_pickscore_is_the_model_cards_score_of_each_image_against_its_prompt(tiny_clip, clip, images):
    model, processor = clip
    pil = [Image.fromarray(image.permute(1, 2, 0).numpy()) for image in images]
    expected = []
    with torch.no_grad():  # the model card's calc_probs before its softmax, one prompt at a time
        image_inputs = processor(images=pil, padding=True, truncation=True, max_length=77, return_tensors="pt")
        image_embs = _unit(model.get_image_features(**image_inputs).pooler_output)
        for prompt in PROMPTS:
            text_inputs = processor(text=prompt, padding=True, truncation=True, max_length=77, return_tensors="pt")
            text_embs = _unit(model.get_text_features(**text_inputs).pooler_output)
            expected.append(model.logit_scale.exp() * (text_embs @ image_embs.T)[0])
    expected = torch.stack(expected).diagonal()  # each image against its own prompt
    reward = PickScore(tiny_clip)
    batched, alone = _alone_and_batched(reward, images, PROMPTS)
    torch.testing.assert_close(batched, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(alone, expected, atol=1e-5, rtol=0)
    reward.scale = 1 / 26  # Flow-GRPO's
    scaled = reward(images, PROMPTS, [{}] * 4)
    torch.testing.assert_close(scaled, expected / 26, atol=1e-6, rtol=0)


def test_aesthetic_score_is_the_laion_head_over_normalised_image_features(
    tiny_clip, tiny_aesthetic_head, clip, images
):
    model, processor = clip
    weights = load_file(tiny_aesthetic_head)
    assert sorted(weights) == sorted(f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))
    with torch.no_grad():  # DDPO's scorer: processor, image features / their norm, then the head
        pixels = processor(images=list(images), return_tensors="pt")["pixel_values"]
        x = model.get_image_features(pixel_values=pixels).pooler_output
        x = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        for i in (0, 2, 4, 6, 7):  # the Dropouts between them are identities in eval
            x = x @ weights[f"layers.{i}.weight"].T + weights[f"layers.{i}.bias"]
    expected = x.squeeze(1)
    batched, alone = _alone_and_batched(AestheticScore(tiny_clip, head=tiny_aesthetic_head), images, PROMPTS)
    torch.testing.assert_close(batched, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(alone, expected, atol=1e-5, rtol=0)


def test_reward_models_refuse_what_they_cannot_score(tiny_clip, tmp_path, images):
    reward = ClipScore(tiny_clip)
    with pytest.raises(ValueError, match=r"clip_score scores images, got videos \(2, 4, 3, 8, 8\)"):
        reward(torch.zeros(2, 4, 3, 8, 8, dtype=torch.uint8), ["a", "b"], [{}, {}])
    with pytest.raises(ValueError, match=r"clip_score: images must be uint8 \[N, 3, H, W\], got torch.float32"):
        reward(images.float() / 255, PROMPTS, [{}] * 4)
    with pytest.raises(ValueError, match="clip_score: 4 images but 1 prompts"):
        reward(images, PROMPTS[:1], [{}])
    wrong = tmp_path / "wrong.safetensors"
    from trainers_adapters.rewards.models.aesthetic import aesthetic_head, save_aesthetic_head

    save_aesthetic_head(aesthetic_head(768), wrong)  # a ViT-L/14 head on a 32-wide CLIP
    with pytest.raises(RuntimeError, match=r"size mismatch for 0.weight"):
        AestheticScore(tiny_clip, head=str(wrong))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reward_models_score_on_the_device_they_are_given(tiny_clip, tiny_aesthetic_head, images):
    """On CUDA, each class gives its CPU scores (float32 matmuls without TF32: PyTorch's default)
    and returns them on CPU."""
    for build in (
        lambda device: ClipScore(tiny_clip, device=device),
        lambda device: PickScore(tiny_clip, device=device),
        lambda device: AestheticScore(tiny_clip, head=tiny_aesthetic_head, device=device),
    ):
        on_gpu = build("cuda")
        assert next(on_gpu.model.parameters()).device.type == "cuda"
        scores = on_gpu(images, PROMPTS, [{}] * 4)
        assert scores.device.type == "cpu"
        torch.testing.assert_close(scores, build("cpu")(images, PROMPTS, [{}] * 4), atol=1e-4, rtol=1e-5)
