"""The wan family folder: its descriptors (what the rest of the project reads), its adapter
and its tiny builder beside them."""

from __future__ import annotations

from rollout.pipelines.family import Family, declare

FAMILIES: tuple[Family, ...] = (
    # Wan 2.1 and Wan 2.2 are one pipeline class and one adapter; Wan 2.2's folders add the second expert.
    declare(
        __name__,
        name="wan",
        adapter="adapter.WanAdapter",
        title="Wan 2.1",
        pipeline_class="WanPipeline",
        real_model="Wan 2.1 T2V 1.3B",
        # WanPipeline guides when guidance_scale > 1 (negative prompt "" unless one is named); 5.0 is its
        # default and the adapter's.
        cfg_on={"guidance_scale": 5.0},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale",),
        video=True,
    ),
    declare(
        __name__,
        name="wan22",
        adapter="adapter.WanAdapter",
        title="Wan 2.2, two experts",
        pipeline_class="WanPipeline",
        real_model="Wan 2.2 T2V A14B",
        # Wan 2.2 A14B's published settings: 4 on the high-noise expert, 3 on the low-noise one
        # (guidance_scale_2). Off: guidance_scale 1, which guidance_scale_2 then takes too.
        cfg_on={"guidance_scale": 4.0, "guidance_scale_2": 3.0},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale", "guidance_scale_2"),  # the second: the low-noise expert's
        video=True,
    ),
)
