"""FLUX.2 [dev] (`Flux2Pipeline`): text-to-image, and edits from reference images.

The same transformer class and latent layout as FLUX.2 [klein] (flux2.py), and the same encoding of
reference images and schedule (`compute_empirical_mu`), so the adapter is klein's with what the
pipeline changes:
- Text: Mistral Small 3.1's hidden states after layers 10, 20 and 30 (`text_encoder_out_layers`'
  default), concatenated per token, in its chat template with FLUX.2's system message, padded to
  `max_sequence_length` (512), unmasked.
- Guidance: the transformer is guidance-distilled: `guidance_scale` (default 4.0) is a transformer
  input, one pass, no negative prompt (the pipeline has none; a request's `negative_prompt` is
  refused). So `cfg_on` / `cfg_off` of the family are that input's strength (4.0 / 1.0), not a
  second pass.
"""

from __future__ import annotations

import torch

from rollout.pipelines.families.flux2.adapter import Flux2KleinAdapter


class Flux2DevAdapter(Flux2KleinAdapter):
    pipeline_class = "Flux2Pipeline"

    def guidance_spec(self) -> dict:
        # Flux2Pipeline's guidance_scale default, distilled: no classifier-free guidance pass.
        return {"guidance_defaults": {"guidance_scale": 4.0}, "cfg_field": None, "default_negative_prompt": None}

    def guidance_input(self, guidance_scale: torch.Tensor | None) -> torch.Tensor | None:
        # The pipeline's `torch.full([1], guidance_scale, dtype=torch.float32)`, per row.
        return guidance_scale.to(torch.float32)
