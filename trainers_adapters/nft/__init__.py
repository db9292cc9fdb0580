"""DiffusionNFT (Zheng et al., arXiv 2509.16117): a decoupled algorithm trained on an old policy's
ODE samples (`trainers_adapters.policy.old_policy`).

- `loss`: the implicit positive and negative policies' loss;
- `settings`: the knobs (a recipe's `nft` section; plain data, no torch);
- `trainer`: one update from a rewarded rollout of the old policy (`nft_step`).
"""
