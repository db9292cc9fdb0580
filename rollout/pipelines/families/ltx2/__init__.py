"""The ltx2 family folder: its descriptors (what the rest of the project reads), its adapter
and its tiny builder beside them."""

from __future__ import annotations

from rollout.pipelines.family import Family, declare

FAMILIES: tuple[Family, ...] = (
    # LTX-2: video and its sound denoised together; one flat latent per sample (docs/ltx2_design.md).
    declare(
        __name__,
        name="ltx2",
        adapter="adapter.LTX2Adapter",
        title="LTX-2 text-to-video with audio",
        pipeline_class="LTX2Pipeline",
        real_model="LTX-2 (19B)",
        # LTX2Pipeline guides both modalities when guidance_scale > 1 (audio_guidance_scale=None takes
        # it), against "" unless named; 3.0 is its default. Its STG, modality guidance and rescale
        # are not run (stg_scale=0, modality_scale=1, guidance_rescale=0 in the pipeline's terms).
        cfg_on={"guidance_scale": 3.0},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale",),
        video=True,
    ),
    # LTX-2 image-to-video: the first frame (the request's input image) is conditioning at timestep 0;
    # the latent vector holds the video's later latent frames and the audio (docs/ltx2_design.md).
    declare(
        __name__,
        name="ltx2_i2v",
        adapter="i2v.LTX2ImageToVideoAdapter",
        title="LTX-2 image-to-video with audio",
        pipeline_class="LTX2ImageToVideoPipeline",
        real_model="LTX-2 (19B)",
        # As LTX2Pipeline (3.0 its default; STG, modality guidance and rescale not run); the
        # unconditional rows see the same first frame, as in the pipeline.
        cfg_on={"guidance_scale": 3.0},
        cfg_off={"guidance_scale": 1.0},
        accepted_guidance_fields=("guidance_scale",),
        video=True,
        edits=True,
    ),
)
