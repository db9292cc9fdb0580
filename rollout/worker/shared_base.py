"""The worker function that gives a colocated trainer denoisers over this worker's base weights.

Only a worker in the caller's process can hand out its modules (`Executor.shares_memory`: the
`uni` executor); the trainer's side is `trainers_adapters.policy.LoraPolicy.sharing_base`.
"""

from __future__ import annotations

from rollout.pipelines.adapter import PipelineAdapter
from rollout.pipelines.shared_base import sharing_adapter


def share_base(worker) -> PipelineAdapter:
    """`engine.collective_rpc(share_base)`: an adapter of the worker's family whose denoisers are
    module trees of their own over the worker's base weights (`rollout.pipelines.shared_base`),
    with the engine's attention backend and compiled blocks. The worker's weight updates swap into
    them too, and its `sleep` is refused while they live (it would free nothing they hold). Like
    every worker function but a step, it runs with no LoRA merged into the base weights."""
    config = worker.config
    adapter = sharing_adapter(worker.adapter, config.attention_backend, config.compile)
    for component, module in adapter.denoisers.items():
        worker.updates.share(component, module)
    return adapter
