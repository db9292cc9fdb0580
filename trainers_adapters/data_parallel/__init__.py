"""Data-parallel training: the trainer's ranks (`trainer_ranks`) and how a step's rollout is
shared among them (`rollout_shares`)."""
