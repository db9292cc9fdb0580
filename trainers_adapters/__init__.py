"""What GRPO and DPO training loops need from the engine. Re-scoring of stored trajectories is
`rollout.rescoring` for now; the losses, advantages, rewards and weight push land here."""
