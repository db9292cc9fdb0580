"""Every model family the project runs: one tuple of their descriptors (`rollout.pipelines.family`).

The engine's registry (`_class_name` -> adapter), the tiny pipelines' lookup by short name, the
tests' family matrix, the benchmarks' `--family` choices and a recipe's config check are all read
from `FAMILIES`; adding a family is its module (the adapter) plus its descriptor here. This module
imports neither torch nor diffusers (the adapters are named by their dotted paths), so a config is
checked against the families without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout.pipelines.family import Family
from rollout.pipelines.guidance import GUIDANCE_FIELDS

if TYPE_CHECKING:
    from rollout.pipelines.adapter import PipelineAdapter

# As Qwen-Image: true CFG when true_cfg_scale > 1 with a negative prompt (encoded with the same
# images); 4.0 is the edit pipelines' default, " " the empty negative prompt their docstrings suggest.
_QWEN_EDIT_CFG_ON = {"true_cfg_scale": 4.0, "negative_prompt": " "}
_QWEN_EDIT_CFG_OFF = {"true_cfg_scale": 1.0}

FAMILIES: tuple[Family, ...] = (
    Family(
        name="sd3",
        title="SD3 / SD3.5",
        adapter_class="rollout.pipelines.sd3.SD3Adapter",
        pipeline_class="StableDiffusion3Pipeline",
        tiny_builder="rollout.pipelines.tiny.sd3.build_tiny_sd3",
        presets={
            "small": "rollout.pipelines.tiny.sd3.build_small_sd3",
            "real": "rollout.pipelines.tiny.sd3.build_real_sd3",
        },
        real_model="SD3.5 Medium",
        # The pipeline guides when guidance_scale > 1, with the negative prompt "" unless one is named.
        # 4.5 is the adapter's default (Flow-GRPO's for SD3.5), so a request that names nothing guides.
        cfg_on={"guidance_scale": 4.5},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale",),
        attention_dispatcher=False,  # JointAttnProcessor2_0 calls F.scaled_dot_product_attention itself
    ),
    Family(
        name="flux",
        title="FLUX.1",
        adapter_class="rollout.pipelines.flux.FluxAdapter",
        pipeline_class="FluxPipeline",
        tiny_builder="rollout.pipelines.tiny.flux.build_tiny_flux",
        presets={
            "small": "rollout.pipelines.tiny.flux.build_small_flux",
            "real": "rollout.pipelines.tiny.flux.build_real_flux",
        },
        real_model="FLUX.1-dev",
        # FluxPipeline guides (a second pass) when true_cfg_scale > 1 and a negative prompt is given; its
        # default 1.0 is off. FLUX.1-dev's guidance_scale is distilled guidance, a transformer input,
        # not CFG: both settings leave it at the pipeline's 3.5. The pipeline has no default with CFG on:
        # these are Qwen-Image's (its default 4, and the empty negative prompt " " its docstring suggests).
        cfg_on={"true_cfg_scale": 4.0, "negative_prompt": " "},
        cfg_off={"true_cfg_scale": 1.0},
        # guidance_scale: FLUX.1 [dev]'s guidance embedding
        accepted_guidance_fields=("true_cfg_scale", "guidance_scale"),
    ),
    Family(
        name="flux_kontext",
        title="FLUX.1 Kontext (image editing)",
        adapter_class="rollout.pipelines.flux_kontext.FluxKontextAdapter",
        pipeline_class="FluxKontextPipeline",
        tiny_builder="rollout.pipelines.tiny.flux.build_tiny_flux_kontext",
        presets={
            "small": "rollout.pipelines.tiny.flux.build_small_flux_kontext",
            "real": "rollout.pipelines.tiny.flux.build_real_flux_kontext",
        },
        real_model="FLUX.1-Kontext-dev",
        # As FLUX.1: FluxKontextPipeline guides (a second pass, over the same input image) when
        # true_cfg_scale > 1 and a negative prompt is given; guidance_scale is distilled guidance.
        cfg_on={"true_cfg_scale": 4.0, "negative_prompt": " "},
        cfg_off={"true_cfg_scale": 1.0},
        accepted_guidance_fields=("true_cfg_scale", "guidance_scale"),  # guidance_scale: its guidance embedding
        edits=True,
    ),
    Family(
        name="qwen_image",
        title="Qwen-Image",
        adapter_class="rollout.pipelines.qwen_image.QwenImageAdapter",
        pipeline_class="QwenImagePipeline",
        tiny_builder="rollout.pipelines.tiny.qwen_image.build_tiny_qwen_image",
        presets={
            "small": "rollout.pipelines.tiny.qwen_image.build_small_qwen_image",
            "real": "rollout.pipelines.tiny.qwen_image.build_real_qwen_image",
        },
        real_model="Qwen-Image",
        # QwenImagePipeline guides when true_cfg_scale > 1 and a negative prompt is given: 4.0 is its
        # default, and " " the empty negative prompt its docstring suggests. Off: 1.0, the adapter's default.
        cfg_on={"true_cfg_scale": 4.0, "negative_prompt": " "},
        cfg_off={"true_cfg_scale": 1.0},
        accepted_guidance_fields=("true_cfg_scale", "guidance_scale"),  # guidance_scale: guidance-distilled variants
    ),
    Family(
        name="qwen_image21",
        title="Qwen-Image 2.1",
        adapter_class="rollout.pipelines.qwen_image21.QwenImage21Adapter",
        pipeline_class="QwenImage21Pipeline",
        tiny_builder="rollout.pipelines.tiny.qwen_image21.build_tiny_qwen_image21",
        presets={
            "small": "rollout.pipelines.tiny.qwen_image21.build_small_qwen_image21",
            "real": "rollout.pipelines.tiny.qwen_image21.build_real_qwen_image21",
        },
        real_model="Qwen-Image 2.1",
        # QwenImage21Pipeline guides when true_cfg_scale > 1 and a negative prompt is given (plain CFG,
        # no norm rescale); its default 1.0 is off, as 2.1 is meant to be sampled. On: Qwen-Image's 4.0
        # and " ", as the pipeline names no guided setting.
        cfg_on={"true_cfg_scale": 4.0, "negative_prompt": " "},
        cfg_off={"true_cfg_scale": 1.0},
        accepted_guidance_fields=("true_cfg_scale",),
    ),
    Family(
        name="qwen_image_edit",
        title="Qwen-Image-Edit (image editing)",
        adapter_class="rollout.pipelines.qwen_image_edit.QwenImageEditAdapter",
        pipeline_class="QwenImageEditPipeline",
        tiny_builder="rollout.pipelines.tiny.qwen_image_edit.build_tiny_qwen_image_edit",
        presets={
            "small": "rollout.pipelines.tiny.qwen_image_edit.build_small_qwen_image_edit",
            "real": "rollout.pipelines.tiny.qwen_image_edit.build_real_qwen_image_edit",
        },
        real_model="Qwen-Image-Edit",
        cfg_on=_QWEN_EDIT_CFG_ON,
        cfg_off=_QWEN_EDIT_CFG_OFF,
        accepted_guidance_fields=("true_cfg_scale", "guidance_scale"),  # guidance_scale: guidance-distilled variants
        edits=True,
    ),
    Family(
        name="qwen_image_edit_plus",
        title="Qwen-Image-Edit-Plus (2509/2511: several reference images)",
        adapter_class="rollout.pipelines.qwen_image_edit.QwenImageEditPlusAdapter",
        pipeline_class="QwenImageEditPlusPipeline",
        tiny_builder="rollout.pipelines.tiny.qwen_image_edit.build_tiny_qwen_image_edit_plus",
        presets={
            "small": "rollout.pipelines.tiny.qwen_image_edit.build_small_qwen_image_edit_plus",
            "real": "rollout.pipelines.tiny.qwen_image_edit.build_real_qwen_image_edit_plus",
        },
        real_model="Qwen-Image-Edit-2511",
        cfg_on=_QWEN_EDIT_CFG_ON,
        cfg_off=_QWEN_EDIT_CFG_OFF,
        accepted_guidance_fields=("true_cfg_scale", "guidance_scale"),  # guidance_scale: guidance-distilled variants
        edits=True,
    ),
    Family(
        name="flux2_klein",
        title="FLUX.2 [klein]",
        adapter_class="rollout.pipelines.flux2.Flux2KleinAdapter",
        pipeline_class="Flux2KleinPipeline",
        tiny_builder="rollout.pipelines.tiny.flux2.build_tiny_flux2_klein",
        presets={
            "small": "rollout.pipelines.tiny.flux2.build_small_flux2_klein",
            "real": "rollout.pipelines.tiny.flux2.build_real_flux2_klein",
        },
        real_model="FLUX.2 [klein] 4B",
        # A base klein model (the tiny one is) guides when guidance_scale > 1, against "" (its default
        # negative): 4.0 is the pipeline's default. Off: 1.0. (A distilled folder takes no guidance field.)
        cfg_on={"guidance_scale": 4.0},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale",),  # none for the distilled FLUX.2 [klein] models
        edits=True,
    ),
    Family(
        name="flux2_dev",
        title="FLUX.2 [dev]",
        adapter_class="rollout.pipelines.flux2_dev.Flux2DevAdapter",
        pipeline_class="Flux2Pipeline",
        tiny_builder="rollout.pipelines.tiny.flux2.build_tiny_flux2_dev",
        presets={
            "small": "rollout.pipelines.tiny.flux2.build_small_flux2_dev",
            "real": "rollout.pipelines.tiny.flux2.build_real_flux2_dev",
        },
        real_model="FLUX.2 [dev]",
        # Flux2Pipeline has no classifier-free guidance pass (no negative prompt): its guidance_scale is
        # the guidance-distilled transformer's input. "On" is the pipeline's default 4.0, "off" 1.0.
        cfg_on={"guidance_scale": 4.0},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale",),
        edits=True,
    ),
    # Wan 2.1 and Wan 2.2 are one pipeline class and one adapter; Wan 2.2's folders add the second expert.
    Family(
        name="wan",
        title="Wan 2.1",
        adapter_class="rollout.pipelines.wan.WanAdapter",
        pipeline_class="WanPipeline",
        tiny_builder="rollout.pipelines.tiny.wan.build_tiny_wan",
        presets={
            "small": "rollout.pipelines.tiny.wan.build_small_wan",
            "real": "rollout.pipelines.tiny.wan.build_real_wan",
        },
        real_model="Wan 2.1 T2V 1.3B",
        # WanPipeline guides when guidance_scale > 1 (negative prompt "" unless one is named); 5.0 is its
        # default and the adapter's.
        cfg_on={"guidance_scale": 5.0},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale",),
        video=True,
    ),
    Family(
        name="wan22",
        title="Wan 2.2, two experts",
        adapter_class="rollout.pipelines.wan.WanAdapter",
        pipeline_class="WanPipeline",
        tiny_builder="rollout.pipelines.tiny.wan.build_tiny_wan22",
        presets={
            "small": "rollout.pipelines.tiny.wan.build_small_wan22",
            "real": "rollout.pipelines.tiny.wan.build_real_wan22",
        },
        real_model="Wan 2.2 T2V A14B",
        # Wan 2.2 A14B's published settings: 4 on the high-noise expert, 3 on the low-noise one
        # (guidance_scale_2). Off: guidance_scale 1, which guidance_scale_2 then takes too.
        cfg_on={"guidance_scale": 4.0, "guidance_scale_2": 3.0},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale", "guidance_scale_2"),  # the second: the low-noise expert's
        video=True,
    ),
    # Wan image-to-video: one pipeline class and adapter for Wan 2.1 I2V (CLIP image embeddings) and
    # Wan 2.2 I2V A14B (two experts, no image encoder); the first frame is the request's input image.
    Family(
        name="wan_i2v",
        title="Wan 2.1 image-to-video",
        adapter_class="rollout.pipelines.wan_i2v.WanImageToVideoAdapter",
        pipeline_class="WanImageToVideoPipeline",
        tiny_builder="rollout.pipelines.tiny.wan_i2v.build_tiny_wan_i2v",
        presets={
            "small": "rollout.pipelines.tiny.wan_i2v.build_small_wan_i2v",
            "real": "rollout.pipelines.tiny.wan_i2v.build_real_wan_i2v",
        },
        real_model="Wan 2.1 I2V 14B 480P",
        # As WanPipeline: guidance when guidance_scale > 1, against "" unless named; 5.0 its default.
        cfg_on={"guidance_scale": 5.0},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale", "guidance_scale_2"),  # the second: Wan 2.2's low-noise expert
        video=True,
        edits=True,
    ),
    Family(
        name="wan22_i2v",
        title="Wan 2.2 image-to-video, two experts",
        adapter_class="rollout.pipelines.wan_i2v.WanImageToVideoAdapter",
        pipeline_class="WanImageToVideoPipeline",
        tiny_builder="rollout.pipelines.tiny.wan_i2v.build_tiny_wan22_i2v",
        presets={
            "small": "rollout.pipelines.tiny.wan_i2v.build_small_wan22_i2v",
            "real": "rollout.pipelines.tiny.wan_i2v.build_real_wan22_i2v",
        },
        real_model="Wan 2.2 I2V A14B",
        # Wan 2.2 I2V A14B's published settings (wan/configs/wan_i2v_A14B.py): 3.5 on both experts.
        cfg_on={"guidance_scale": 3.5, "guidance_scale_2": 3.5},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale", "guidance_scale_2"),
        video=True,
        edits=True,
    ),
    # LTX-2: video and its sound denoised together; one flat latent per sample (docs/ltx2_design.md).
    Family(
        name="ltx2",
        title="LTX-2 text-to-video with audio",
        adapter_class="rollout.pipelines.ltx2.LTX2Adapter",
        pipeline_class="LTX2Pipeline",
        tiny_builder="rollout.pipelines.tiny.ltx2.build_tiny_ltx2",
        presets={
            "small": "rollout.pipelines.tiny.ltx2.build_small_ltx2",
            "real": "rollout.pipelines.tiny.ltx2.build_real_ltx2",
        },
        real_model="LTX-2 (19B)",
        # LTX2Pipeline guides both modalities when guidance_scale > 1 (audio_guidance_scale=None takes
        # it), against "" unless named; 3.0 is its default. Its STG, modality guidance and rescale
        # are not run (stg_scale=0, modality_scale=1, guidance_rescale=0 in the pipeline's terms).
        cfg_on={"guidance_scale": 3.0},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale",),
        video=True,
    ),
    # LTX-2 image-to-video: the first frame (the request's input image) is conditioning at timestep 0;
    # the latent vector holds the video's later latent frames and the audio (docs/ltx2_design.md).
    Family(
        name="ltx2_i2v",
        title="LTX-2 image-to-video with audio",
        adapter_class="rollout.pipelines.ltx2_i2v.LTX2ImageToVideoAdapter",
        pipeline_class="LTX2ImageToVideoPipeline",
        tiny_builder="rollout.pipelines.tiny.ltx2.build_tiny_ltx2_i2v",
        presets={
            "small": "rollout.pipelines.tiny.ltx2.build_small_ltx2_i2v",
            "real": "rollout.pipelines.tiny.ltx2.build_real_ltx2_i2v",
        },
        real_model="LTX-2 (19B)",
        # As LTX2Pipeline (3.0 its default; STG, modality guidance and rescale not run); the
        # unconditional rows see the same first frame, as in the pipeline.
        cfg_on={"guidance_scale": 3.0},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale",),
        video=True,
        edits=True,
    ),
    # HunyuanVideo 1.5: text-to-video and image-to-video, two pipeline classes over one adapter module.
    # Neither pipeline takes a guidance argument: its `guider` component (ClassifierFreeGuidance) guides
    # with its own guidance_scale (6.0 in the published 480p and 720p folders) whenever it is not 1;
    # a request's guidance_scale is that scale (the tests set the pipeline's guider to the same).
    Family(
        name="hunyuan_video15",
        title="HunyuanVideo 1.5 text-to-video",
        adapter_class="rollout.pipelines.hunyuan_video15.HunyuanVideo15Adapter",
        pipeline_class="HunyuanVideo15Pipeline",
        tiny_builder="rollout.pipelines.tiny.hunyuan_video15.build_tiny_hunyuan_video15",
        presets={
            "small": "rollout.pipelines.tiny.hunyuan_video15.build_small_hunyuan_video15",
            "real": "rollout.pipelines.tiny.hunyuan_video15.build_real_hunyuan_video15",
        },
        real_model="HunyuanVideo 1.5 480p T2V",
        cfg_on={"guidance_scale": 6.0},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale",),
        video=True,
    ),
    Family(
        name="hunyuan_video15_i2v",
        title="HunyuanVideo 1.5 image-to-video",
        adapter_class="rollout.pipelines.hunyuan_video15.HunyuanVideo15ImageToVideoAdapter",
        pipeline_class="HunyuanVideo15ImageToVideoPipeline",
        tiny_builder="rollout.pipelines.tiny.hunyuan_video15.build_tiny_hunyuan_video15_i2v",
        presets={
            "small": "rollout.pipelines.tiny.hunyuan_video15.build_small_hunyuan_video15_i2v",
            "real": "rollout.pipelines.tiny.hunyuan_video15.build_real_hunyuan_video15_i2v",
        },
        real_model="HunyuanVideo 1.5 480p I2V",
        cfg_on={"guidance_scale": 6.0},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale",),
        video=True,
        edits=True,
    ),
    Family(
        name="zimage",
        title="Z-Image / Z-Image-Turbo",
        adapter_class="rollout.pipelines.z_image.ZImageAdapter",
        pipeline_class="ZImagePipeline",
        tiny_builder="rollout.pipelines.tiny.z_image.build_tiny_z_image",
        presets={
            "small": "rollout.pipelines.tiny.z_image.build_small_z_image",
            "real": "rollout.pipelines.tiny.z_image.build_real_z_image",
        },
        real_model="Z-Image-Turbo",
        # ZImagePipeline guides when guidance_scale > 0, with the negative prompt "" unless one is named:
        # 5.0 is its default (and the adapter's), 0 what Z-Image-Turbo is sampled with.
        cfg_on={"guidance_scale": 5.0},
        cfg_off={"guidance_scale": 0.0},
        accepted_guidance_fields=("guidance_scale",),
    ),
)


def family_names() -> tuple[str, ...]:
    """The short names, in `FAMILIES` order (what `--family` and `model.tiny_family` take)."""
    return tuple(family.name for family in FAMILIES)


def family_named(name: str) -> Family:
    """The family of short name `name`; ValueError naming the known ones otherwise."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"unknown model family {name!r}; choose one of {', '.join(family_names())}")


def adapters_by_pipeline() -> dict[str, type[PipelineAdapter]]:
    """Diffusers pipeline class (`_class_name`) -> the adapter that runs it (imported). Families may
    share a class (Wan 2.1 and Wan 2.2 are both `WanPipeline`), and then share its adapter."""
    return {family.pipeline_class: family.adapter for family in FAMILIES}


def families_help() -> str:
    """One line per family for `--help` texts: "name: PipelineClass (title)"."""
    return "; ".join(f"{family.name}: {family.pipeline_class} ({family.title})" for family in FAMILIES)


def edit_families_help() -> str:
    """The families that take input images, for errors: "name (PipelineClass), ..."."""
    edits = [family for family in FAMILIES if family.edits]
    return ", ".join(f"{family.name} ({family.pipeline_class})" for family in edits) or "none"


def request_field_problems(families: tuple[Family, ...], params) -> list[str]:
    """The fields of `params` (a `SamplingParams`) that no model of `families` takes (the families
    of one pipeline class; Wan 2.1 and 2.2 share theirs), in the engine's words. Known before any
    model loads; the loaded model's spec refuses more (a distilled variant takes fewer fields)."""
    model = families[0].pipeline_class
    taken = sorted({name for family in families for name in family.accepted_guidance_fields})
    problems = [
        f"{name} is not used by {model}; leave it unset ({model} takes {', '.join(taken)})"
        for name in GUIDANCE_FIELDS
        if getattr(params, name) is not None and name not in taken
    ]
    if params.num_frames is not None and not any(family.video for family in families):
        problems.append(f"num_frames is for video pipelines; {model} makes images, so leave num_frames unset")
    return problems


def families_of(pipeline_class: str) -> tuple[Family, ...]:
    """The families that register `pipeline_class` (a model_index.json's `_class_name`)."""
    return tuple(family for family in FAMILIES if family.pipeline_class == pipeline_class)
