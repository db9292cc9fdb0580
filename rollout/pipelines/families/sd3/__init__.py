"""The sd3 family folder: its descriptors (what the rest of the project reads), its adapter
and its tiny builder beside them."""

from __future__ import annotations

from rollout.pipelines.family import Family, declare

FAMILIES: tuple[Family, ...] = (
    declare(
        __name__,
        name="sd3",
        adapter="adapter.SD3Adapter",
        title="SD3 / SD3.5",
        pipeline_class="StableDiffusion3Pipeline",
        real_model="SD3.5 Medium",
        # The pipeline guides when guidance_scale > 1, with the negative prompt "" unless one is named.
        # 4.5 is the adapter's default (Flow-GRPO's for SD3.5), so a request that names nothing guides.
        cfg_on={"guidance_scale": 4.5},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale",),
        attention_dispatcher=False,  # JointAttnProcessor2_0 calls F.scaled_dot_product_attention itself
    ),
)
