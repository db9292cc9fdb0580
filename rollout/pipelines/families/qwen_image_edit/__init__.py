"""The qwen_image_edit family folder: its descriptors (what the rest of the project reads), its adapter
and its tiny builder beside them."""

from __future__ import annotations

from rollout.pipelines.family import Family, declare

# As Qwen-Image: true CFG when true_cfg_scale > 1 with a negative prompt (encoded with the same
# images); 4.0 is the edit pipelines' default, " " the empty negative prompt their docstrings suggest.
_QWEN_EDIT_CFG_ON = {"true_cfg_scale": 4.0, "negative_prompt": " "}
_QWEN_EDIT_CFG_OFF = {"true_cfg_scale": 1.0}

FAMILIES: tuple[Family, ...] = (
    declare(
        __name__,
        name="qwen_image_edit",
        adapter="adapter.QwenImageEditAdapter",
        title="Qwen-Image-Edit (image editing)",
        pipeline_class="QwenImageEditPipeline",
        real_model="Qwen-Image-Edit",
        cfg_on=_QWEN_EDIT_CFG_ON,
        cfg_off=_QWEN_EDIT_CFG_OFF,
        accepted_guidance_fields=("true_cfg_scale", "guidance_scale"),  # guidance_scale: guidance-distilled variants
        edits=True,
    ),
    declare(
        __name__,
        name="qwen_image_edit_plus",
        adapter="adapter.QwenImageEditPlusAdapter",
        title="Qwen-Image-Edit-Plus (2509/2511: several reference images)",
        pipeline_class="QwenImageEditPlusPipeline",
        real_model="Qwen-Image-Edit-2511",
        cfg_on=_QWEN_EDIT_CFG_ON,
        cfg_off=_QWEN_EDIT_CFG_OFF,
        accepted_guidance_fields=("true_cfg_scale", "guidance_scale"),  # guidance_scale: guidance-distilled variants
        edits=True,
    ),
)
