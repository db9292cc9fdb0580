"""The trainer's side of the engine's weights (`rollout.weights`).

- `broadcast`: join the engine's broadcast group as rank 0 and send weights in buckets;
- `checksum`: the digest `RolloutEngine.weights_checksum` compares, of the trainer's own copy.
"""
