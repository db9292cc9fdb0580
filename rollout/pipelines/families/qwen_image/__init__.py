"""The qwen_image family folder: its descriptors (what the rest of the project reads), its adapter
and its tiny builder beside them."""

from __future__ import annotations

from rollout.pipelines.family import Family, declare

FAMILIES: tuple[Family, ...] = (
    declare(
        __name__,
        name="qwen_image",
        adapter="adapter.QwenImageAdapter",
        title="Qwen-Image",
        pipeline_class="QwenImagePipeline",
        real_model="Qwen-Image",
        # QwenImagePipeline guides when true_cfg_scale > 1 and a negative prompt is given: 4.0 is its
        # default, and " " the empty negative prompt its docstring suggests. Off: 1.0, the adapter's default.
        cfg_on={"true_cfg_scale": 4.0, "negative_prompt": " "},
        cfg_off={"true_cfg_scale": 1.0},
        accepted_guidance_fields=("true_cfg_scale", "guidance_scale"),  # guidance_scale: guidance-distilled variants
    ),
)
