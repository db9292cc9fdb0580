"""The resolution-dependent shift of flow-matching schedulers with dynamic shifting (FLUX.1,
Qwen-Image, Z-Image, and SD3 where its scheduler config asks for it): `mu` for an image of
`image_seq_len` tokens, on the line the scheduler's config draws through (base_image_seq_len,
base_shift) and (max_image_seq_len, max_shift). diffusers copies one `calculate_shift` into each of
these pipelines; this reads the config as they do, with their defaults."""

from __future__ import annotations


def resolution_shift(config, image_seq_len: int, default_max_shift: float = 1.15) -> float:
    """`mu` as the family's pipeline computes it; `default_max_shift` is the pipeline's own default
    (SD3's is 1.16)."""
    # Imported here, once a pipeline is loaded: diffusers' pipeline modules import transformers'
    # image processors, slow and noisy at import. Every pipeline's copy of the function is this one.
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    return calculate_shift(
        image_seq_len,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", default_max_shift),
    )
