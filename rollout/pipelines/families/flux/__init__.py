"""The flux family folder: its descriptors (what the rest of the project reads), its adapter
and its tiny builder beside them."""

from __future__ import annotations

from rollout.pipelines.family import Family, declare

FAMILIES: tuple[Family, ...] = (
    declare(
        __name__,
        name="flux",
        adapter="adapter.FluxAdapter",
        title="FLUX.1",
        pipeline_class="FluxPipeline",
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
    declare(
        __name__,
        name="flux_kontext",
        adapter="kontext.FluxKontextAdapter",
        title="FLUX.1 Kontext (image editing)",
        pipeline_class="FluxKontextPipeline",
        real_model="FLUX.1-Kontext-dev",
        # As FLUX.1: FluxKontextPipeline guides (a second pass, over the same input image) when
        # true_cfg_scale > 1 and a negative prompt is given; guidance_scale is distilled guidance.
        cfg_on={"true_cfg_scale": 4.0, "negative_prompt": " "},
        cfg_off={"true_cfg_scale": 1.0},
        accepted_guidance_fields=("true_cfg_scale", "guidance_scale"),  # guidance_scale: its guidance embedding
        edits=True,
    ),
)
