"""Online Diffusion-DPO (Wallace et al., arXiv 2311.12908) in its flow-matching form.

- `loss`: preference pairs, flow-matching errors and the DPO loss;
- `settings`: the knobs (a recipe's `dpo` section; plain data, no torch);
- `trainer`: one update from a rewarded rollout (`dpo_step`).
"""
