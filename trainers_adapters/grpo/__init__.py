"""GRPO for diffusion policies (Flow-GRPO, arXiv 2505.05470; DanceGRPO; BranchGRPO).

- `loss`: the clipped policy loss over SDE steps and the KL to the reference;
- `settings`: the knobs (a recipe's `grpo` section; plain data, no torch);
- `trainer`: one update from a rewarded rollout (`grpo_step`);
- `off_policy`: the corrections of an update whose samples an older policy made;
- `tree`: a tree rollout's nodes and their advantages (BranchGRPO).
"""
