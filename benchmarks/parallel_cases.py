"""The published transformers the parallel cost model sizes, at the sizes it sizes them: each case's
config, its tokens, its passes per step and what the cost model needs beside its FLOPs, and the
count of one forward on the meta device.

Tokens: the VAE's latent cut into the transformer's patches (Wan: 4x in time, 8x in space, 1x2x2
patches; Qwen-Image and FLUX.1: 8x, 2x2), plus the text tokens where attention is joint (FLUX.1's
512 T5 tokens, Qwen-Image's prompt at its own length); Wan's 512 umT5 tokens enter through
cross-attention. Text encoder and VAE sizes are the published ones, rounded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import diffusers
import torch

from benchmarks.flop_count import ForwardFlops, count_forward_flops
from benchmarks.model_presets import FLUX1_DEV, QWEN_IMAGE, WAN21_T2V_14B
from benchmarks.parallel_cost import ModelCost, latent_tokens


@dataclass(frozen=True)
class RealSizeCase:
    """One published transformer at one sample size, and what the cost model needs beside its FLOPs."""

    name: str
    size: str
    transformer_class: str
    config: dict
    published_billions: float
    image_tokens: int
    text_tokens: int
    joint: bool  # text tokens join the attention's sequence (FLUX, Qwen-Image), else cross-attention (Wan)
    passes: int  # forwards per step: 2 with CFG
    cfg_note: str
    attention_layers: int
    ffn_dim: int
    velocity_elements: int
    other_billions: float  # text encoders and VAE, resident beside the transformer (published sizes, rounded)
    inputs: Callable[[], dict]  # the forward's inputs for one pass of one sample (called under the meta device)

    @property
    def heads(self) -> int:
        return self.config["num_attention_heads"]

    @property
    def head_dim(self) -> int:
        return self.config["attention_head_dim"]

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    @property
    def sequence(self) -> int:
        return self.image_tokens + (self.text_tokens if self.joint else 0)


def wan21_14b(height: int = 480, width: int = 832, frames: int = 81) -> RealSizeCase:
    tokens = latent_tokens(height, width, frames)  # VAE 4x in time, 8x in space; 1x2x2 patches
    latent = (16, (frames - 1) // 4 + 1, height // 8, width // 8)
    return RealSizeCase(
        name="Wan 2.1 T2V 14B",
        size=f"{height}x{width}x{frames}",
        transformer_class="WanTransformer3DModel",
        config=WAN21_T2V_14B,
        published_billions=14.3,
        image_tokens=tokens,
        text_tokens=512,  # umT5, padded to 512
        joint=False,
        passes=2,
        cfg_note="CFG: 2 passes (guidance_scale 5.0)",
        attention_layers=WAN21_T2V_14B["num_layers"],
        ffn_dim=WAN21_T2V_14B["ffn_dim"],
        velocity_elements=latent[0] * latent[1] * latent[2] * latent[3],
        other_billions=5.7 + 0.13,  # umT5-XXL encoder, Wan VAE
        inputs=lambda: {
            "hidden_states": torch.empty(1, *latent),
            "timestep": torch.ones(1),
            "encoder_hidden_states": torch.empty(1, 512, 4096),
        },
    )


def qwen_image(height: int = 1024, width: int = 1024, prompt_tokens: int = 64) -> RealSizeCase:
    tokens = latent_tokens(height, width)  # VAE 8x, 2x2 patches
    return RealSizeCase(
        name="Qwen-Image",
        size=f"{height}x{width}",
        transformer_class="QwenImageTransformer2DModel",
        config=QWEN_IMAGE,
        published_billions=20.4,
        image_tokens=tokens,
        text_tokens=prompt_tokens,  # the prompt's own length (the pipeline drops its template, does not pad)
        joint=True,
        passes=2,
        cfg_note="true CFG: 2 passes (true_cfg_scale 4.0 with a negative prompt)",
        attention_layers=QWEN_IMAGE["num_layers"],
        ffn_dim=4 * QWEN_IMAGE["num_attention_heads"] * QWEN_IMAGE["attention_head_dim"],
        velocity_elements=tokens * 64,
        other_billions=8.29 + 0.13,  # Qwen2.5-VL-7B, its VAE
        inputs=lambda: {
            "hidden_states": torch.empty(1, tokens, 64),
            "encoder_hidden_states": torch.empty(1, prompt_tokens, 3584),
            "timestep": torch.ones(1),
            "img_shapes": [(1, height // 16, width // 16)],
        },
    )


def flux1_dev(height: int = 1024, width: int = 1024, true_cfg: bool = False) -> RealSizeCase:
    tokens = latent_tokens(height, width)
    return RealSizeCase(
        name="FLUX.1-dev",
        size=f"{height}x{width}",
        transformer_class="FluxTransformer2DModel",
        config=FLUX1_DEV,
        published_billions=11.9,
        image_tokens=tokens,
        text_tokens=512,  # T5, max_sequence_length 512
        joint=True,
        passes=2 if true_cfg else 1,
        cfg_note="true CFG on: 2 passes" if true_cfg else "distilled guidance: 1 pass (true CFG off)",
        attention_layers=FLUX1_DEV["num_layers"] + FLUX1_DEV["num_single_layers"],
        ffn_dim=4 * FLUX1_DEV["num_attention_heads"] * FLUX1_DEV["attention_head_dim"],
        velocity_elements=tokens * 64,
        other_billions=4.76 + 0.12 + 0.08,  # T5-XXL encoder, CLIP-L, VAE
        inputs=lambda: {
            "hidden_states": torch.empty(1, tokens, 64),
            "encoder_hidden_states": torch.empty(1, 512, 4096),
            "pooled_projections": torch.empty(1, 768),
            "timestep": torch.ones(1),
            "guidance": torch.ones(1),
            "img_ids": torch.zeros(tokens, 3),
            "txt_ids": torch.zeros(512, 3),
        },
    )


@dataclass(frozen=True)
class Counted:
    case: RealSizeCase
    parameters: float
    flops: ForwardFlops

    def model_cost(self, bytes_per_element: int = 2) -> ModelCost:
        case = self.case
        return ModelCost(
            name=case.name,
            flops_per_forward=self.flops.total,
            heads=case.heads,
            head_dim=case.head_dim,
            attention_layers=case.attention_layers,
            sequence=case.sequence,
            passes=case.passes,
            velocity_elements=case.velocity_elements,
            weight_bytes=(self.parameters + case.other_billions * 1e9) * bytes_per_element,
            # the residual stream in and out, Q, K, V and the attention's output, and the MLP's hidden
            activation_bytes_per_token=(6 * case.width + case.ffn_dim) * bytes_per_element,
            bytes_per_element=bytes_per_element,
        )


def count(case: RealSizeCase, modules: dict) -> Counted:
    """The case's transformer on the meta device (built once per class and config) and one forward's FLOPs."""
    key = (case.transformer_class, repr(case.config))
    with torch.device("meta"):
        if key not in modules:
            modules[key] = getattr(diffusers, case.transformer_class)(**case.config)
        inputs = case.inputs()
    module = modules[key]
    return Counted(case, float(sum(p.numel() for p in module.parameters())), count_forward_flops(module, inputs))
