"""The wan_i2v family folder: its descriptors (what the rest of the project reads), its adapter
and its tiny builder beside them."""

from __future__ import annotations

from rollout.pipelines.family import Family, declare

FAMILIES: tuple[Family, ...] = (
    # Wan image-to-video: one pipeline class and adapter for Wan 2.1 I2V (CLIP image embeddings) and
    # Wan 2.2 I2V A14B (two experts, no image encoder); the first frame is the request's input image.
    declare(
        __name__,
        name="wan_i2v",
        adapter="adapter.WanImageToVideoAdapter",
        title="Wan 2.1 image-to-video",
        pipeline_class="WanImageToVideoPipeline",
        real_model="Wan 2.1 I2V 14B 480P",
        # As WanPipeline: guidance when guidance_scale > 1, against "" unless named; 5.0 its default.
        cfg_on={"guidance_scale": 5.0},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale", "guidance_scale_2"),  # the second: Wan 2.2's low-noise expert
        video=True,
        edits=True,
    ),
    declare(
        __name__,
        name="wan22_i2v",
        adapter="adapter.WanImageToVideoAdapter",
        title="Wan 2.2 image-to-video, two experts",
        pipeline_class="WanImageToVideoPipeline",
        real_model="Wan 2.2 I2V A14B",
        # Wan 2.2 I2V A14B's published settings (wan/configs/wan_i2v_A14B.py): 3.5 on both experts.
        cfg_on={"guidance_scale": 3.5, "guidance_scale_2": 3.5},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale", "guidance_scale_2"),
        video=True,
        edits=True,
    ),
)
