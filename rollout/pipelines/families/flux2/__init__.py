"""The flux2 family folder: its descriptors (what the rest of the project reads), its adapter
and its tiny builder beside them."""

from __future__ import annotations

from rollout.pipelines.family import Family, declare

FAMILIES: tuple[Family, ...] = (
    declare(
        __name__,
        name="flux2_klein",
        adapter="adapter.Flux2KleinAdapter",
        title="FLUX.2 [klein]",
        pipeline_class="Flux2KleinPipeline",
        real_model="FLUX.2 [klein] 4B",
        # A base klein model (the tiny one is) guides when guidance_scale > 1, against "" (its default
        # negative): 4.0 is the pipeline's default. Off: 1.0. (A distilled folder takes no guidance field.)
        cfg_on={"guidance_scale": 4.0},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale",),  # none for the distilled FLUX.2 [klein] models
        edits=True,
    ),
    declare(
        __name__,
        name="flux2_dev",
        adapter="dev.Flux2DevAdapter",
        title="FLUX.2 [dev]",
        pipeline_class="Flux2Pipeline",
        real_model="FLUX.2 [dev]",
        # Flux2Pipeline has no classifier-free guidance pass (no negative prompt): its guidance_scale is
        # the guidance-distilled transformer's input. "On" is the pipeline's default 4.0, "off" 1.0.
        cfg_on={"guidance_scale": 4.0},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale",),
        edits=True,
    ),
)
