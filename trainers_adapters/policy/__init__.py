"""The policy the trainer moves, shared by every algorithm.

- `lora_policy`: the trainer's trainable LoRA copy of the policy, re-scoring rollouts with gradients;
- `checkpointing`: its denoisers' gradient checkpointing (activations recomputed in the backward);
- `old_policy`: a decoupled algorithm's frozen old adapter, following the current one as an EMA;
- `micro_batches`: the batches one re-scoring forward can take, and re-scoring without gradient;
- `optim`: the end of every update (finite loss and gradient, clipping, the optimizer step).
"""
