"""The qwen_image21 family folder: its descriptors (what the rest of the project reads), its adapter
and its tiny builder beside them."""

from __future__ import annotations

from rollout.pipelines.family import Family, declare

FAMILIES: tuple[Family, ...] = (
    declare(
        __name__,
        name="qwen_image21",
        adapter="adapter.QwenImage21Adapter",
        title="Qwen-Image 2.1",
        pipeline_class="QwenImage21Pipeline",
        real_model="Qwen-Image 2.1",
        # QwenImage21Pipeline guides when true_cfg_scale > 1 and a negative prompt is given (plain CFG,
        # no norm rescale); its default 1.0 is off, as 2.1 is meant to be sampled. On: Qwen-Image's 4.0
        # and " ", as the pipeline names no guided setting.
        cfg_on={"true_cfg_scale": 4.0, "negative_prompt": " "},
        cfg_off={"true_cfg_scale": 1.0},
        accepted_guidance_fields=("true_cfg_scale",),
    ),
)
