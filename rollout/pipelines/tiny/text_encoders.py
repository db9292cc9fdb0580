"""Tiny text encoders of the real transformers classes, with random weights."""

from __future__ import annotations

# A Qwen-VL vision tower of one block, 16 wide: the tiny edit pipelines' input images pass through it.
TINY_VISION_TOWER = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2}


def vision_markers(markers: list[int]) -> dict:
    """A Qwen-VL config's vision token ids: start, end, image, video (`markers`, in that order)."""
    start, end, image, video = markers
    return {
        "vision_start_token_id": start,
        "vision_end_token_id": end,
        "image_token_id": image,
        "video_token_id": video,
    }


def text_model_sizes(tokenizer, width: int, layers: int) -> dict:
    """What every tiny language model's config shares: the tokenizer's vocabulary, `layers` layers of
    `width` with MLPs twice as wide."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": width,
        "intermediate_size": 2 * width,
        "num_hidden_layers": layers,
    }


def clip_text_encoder(tokenizer, hidden_size: int, layers: int, with_projection: bool):
    """CLIP's text model (`CLIPTextModelWithProjection` as SD3 has, or `CLIPTextModel` as FLUX has)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    vocab = tokenizer.get_vocab()
    config = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=max(2, hidden_size // 64),
        projection_dim=hidden_size,
        max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_act="gelu",
    )
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)


def t5_encoder(tokenizer, width: int):
    """A one-layer `T5EncoderModel` (gated-GELU, as T5 v1.1 XXL in SD3.5 and FLUX.1)."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(**_t5_sizes(tokenizer, width)))


def umt5_encoder(tokenizer, width: int):
    """A one-layer `UMT5EncoderModel` (gated-GELU, as Wan's umt5-xxl)."""
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(**_t5_sizes(tokenizer, width)))


def _t5_sizes(tokenizer, width: int) -> dict:
    heads = max(4, width // 64)
    return dict(
        vocab_size=len(tokenizer),
        d_model=width,
        d_kv=width // heads,
        d_ff=2 * width,
        num_layers=1,
        num_heads=heads,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )


def qwen25_vl_encoder(tokenizer, width: int, layers: int, reads_images: bool = False):
    """A `Qwen2_5_VLForConditionalGeneration` (Qwen-Image's text encoder) with a `width`-wide
    language model of `layers` layers and a one-block vision tower. Text prompts never use the
    tower; with `reads_images` its markers are the tokenizer's own (`qwen25_vl_tokenizer()`), so
    the processor's image tokens reach it (Qwen-Image-Edit)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from rollout.pipelines.tiny.tokenizers import QWEN_VISION_TOKENS  # start, end, image, video

    heads = max(2, width // 128)
    rotary_half = width // heads // 2  # multimodal RoPE splits each head's rotary half in 3 sections
    sections = [rotary_half - 2 * (rotary_half // 3), rotary_half // 3, rotary_half // 3]
    vocab_size = len(tokenizer)
    if reads_images:
        markers = tokenizer.convert_tokens_to_ids(list(QWEN_VISION_TOKENS))
    else:  # image and video markers past the vocabulary: prompts are text only
        markers = [vocab_size, vocab_size + 1, vocab_size + 2, vocab_size + 3]
    config = Qwen2_5_VLConfig(
        text_config={
            **text_model_sizes(tokenizer, width, layers),
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "max_position_embeddings": 2048,
            "rope_scaling": {"mrope_section": sections, "rope_type": "default", "type": "default"},
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.pad_token_id,
        },
        vision_config=TINY_VISION_TOWER | {"out_hidden_size": width},
        **vision_markers(markers),
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def qwen3_encoder(tokenizer, width: int, layers: int):
    """A `Qwen3ForCausalLM` (FLUX.2 Klein's text encoder; its `.model` is the `Qwen3Model` Z-Image
    has) `width` wide with `layers` layers, grouped-query attention as Qwen3's (4 query heads per
    key-value head where the width allows)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = max(2, width // 128)
    config = Qwen3Config(
        **text_model_sizes(tokenizer, width, layers),
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=width // heads,
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.pad_token_id,
    )
    return Qwen3ForCausalLM(config)


def mistral3_encoder(tokenizer, width: int, layers: int):
    """A `Mistral3ForConditionalGeneration` (FLUX.2 [dev]'s text encoder, Mistral Small 3.1) with a
    `width`-wide language model of `layers` layers (grouped-query attention, 4 query heads per
    key-value head where the width allows) and a one-layer Pixtral vision tower that text prompts
    never use (its image token past the vocabulary)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    heads = max(2, width // 128)
    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            **text_model_sizes(tokenizer, width, layers),
            "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 4),
            "head_dim": width // heads,
            "max_position_embeddings": 2048,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 8,
            "patch_size": 14,
            "image_size": 56,
        },
        image_token_index=len(tokenizer),
        spatial_merge_size=2,
        vision_feature_layer=-1,
    )
    return Mistral3ForConditionalGeneration(config)


def gemma3_encoder(tokenizer, width: int, layers: int):
    """A `Gemma3ForConditionalGeneration` (LTX-2's text encoder) of `layers` text layers of `width`,
    with a one-layer vision tower the text-only prompts never use."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config={
            **text_model_sizes(tokenizer, width, layers),
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": width // 2,
            "max_position_embeddings": 1024,
            "sliding_window": 64,
        },
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
        },
        mm_tokens_per_image=4,
    )
    return Gemma3ForConditionalGeneration(config)
