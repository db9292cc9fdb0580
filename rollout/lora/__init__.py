"""LoRA adapters on a worker: loading, merging into the base weights, the bypassed forward."""
