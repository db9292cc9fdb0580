"""The z_image family folder: its descriptors (what the rest of the project reads), its adapter
and its tiny builder beside them."""

from __future__ import annotations

from rollout.pipelines.family import Family, declare

FAMILIES: tuple[Family, ...] = (
    declare(
        __name__,
        name="zimage",
        adapter="adapter.ZImageAdapter",
        builders="z_image",
        title="Z-Image / Z-Image-Turbo",
        pipeline_class="ZImagePipeline",
        real_model="Z-Image-Turbo",
        # ZImagePipeline guides when guidance_scale > 0, with the negative prompt "" unless one is named:
        # 5.0 is its default (and the adapter's), 0 what Z-Image-Turbo is sampled with.
        cfg_on={"guidance_scale": 5.0},
        cfg_off={"guidance_scale": 0.0},
        accepted_guidance_fields=("guidance_scale",),
    ),
)
