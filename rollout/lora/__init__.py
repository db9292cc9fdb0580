"""LoRA adapters on a worker: loading, merging into the base weights, the bypassed forward."""

from rollout.imports import names_moved_to

# Until this release `rollout.lora` was one module, now `rollout.lora.manager`.
__getattr__ = names_moved_to("rollout.lora", "rollout.lora.manager")
