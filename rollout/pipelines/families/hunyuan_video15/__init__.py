"""The hunyuan_video15 family folder: its descriptors (what the rest of the project reads), its adapter
and its tiny builder beside them."""

from __future__ import annotations

from rollout.pipelines.family import Family, declare

FAMILIES: tuple[Family, ...] = (
    # HunyuanVideo 1.5: text-to-video and image-to-video, two pipeline classes over one adapter module.
    # Neither pipeline takes a guidance argument: its `guider` component (ClassifierFreeGuidance) guides
    # with its own guidance_scale (6.0 in the published 480p and 720p folders) whenever it is not 1;
    # a request's guidance_scale is that scale (the tests set the pipeline's guider to the same).
    declare(
        __name__,
        name="hunyuan_video15",
        adapter="adapter.HunyuanVideo15Adapter",
        title="HunyuanVideo 1.5 text-to-video",
        pipeline_class="HunyuanVideo15Pipeline",
        real_model="HunyuanVideo 1.5 480p T2V",
        cfg_on={"guidance_scale": 6.0},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale",),
        video=True,
    ),
    declare(
        __name__,
        name="hunyuan_video15_i2v",
        adapter="adapter.HunyuanVideo15ImageToVideoAdapter",
        title="HunyuanVideo 1.5 image-to-video",
        pipeline_class="HunyuanVideo15ImageToVideoPipeline",
        real_model="HunyuanVideo 1.5 480p I2V",
        cfg_on={"guidance_scale": 6.0},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale",),
        video=True,
        edits=True,
    ),
)
