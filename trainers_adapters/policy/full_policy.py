"""The trainer's policy when it trains every weight of the denoisers (`policy: full`): DanceGRPO's
and Flow-GRPO's full fine-tuning, beside `LoraPolicy`'s adapter.

The denoisers (both of Wan 2.2's experts) are sharded over the trainer ranks with FSDP2
(`fully_shard`, every repeated transformer block a unit of its own, then the whole model): each
rank holds 1/N of the float32 master weights, their gradients and AdamW's two states. The
forward and backward run at the engine's dtype (`MixedPrecisionPolicy(param_dtype=dtype,
reduce_dtype=float32)`: bf16 parameters gathered from float32 masters, gradients reduced in
float32), as the papers' runs do with bf16 autocast over float32 weights; the engine gets the same
bf16 tensors with every push, so the trainer re-scores with exactly the weights that sampled.
Gradients are summed over the ranks (FSDP's mean times the rank count): the updates scale their
losses by the whole minibatch, as for `LoraPolicy`, whose gradients `TrainerRanks.sum_gradients` sums.

Every FSDP forward and backward gathers the shards from every rank, so every rank runs as many as
the others (`sharded`: the updates pad a rank that holds fewer samples with zero-weight passes), and
a push is collective too: every rank gathers each tensor in turn and the ranks with an engine send
it, one tensor at a time, so the whole model is never held on one rank.

The old policy the ratio needs is the engine's behaviour log-prob (recorded with the rollout): no
copy. A reference for a KL term or DPO is a frozen sharded copy of the initial weights
(`keep_reference`), swapped in place under `reference()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from rollout.condition import Condition
from rollout.guidance import Guidance
from rollout.outputs import Trajectory
from rollout.pipelines.attention import backend_refusal, set_attention_backend
from rollout.pipelines.compiled_blocks import repeated_block_classes
from rollout.pipelines.families import families_of
from rollout.pipelines.loading import load_adapter
from rollout.rescoring import check_scorable, score_steps
from rollout.samplers import StepOutput
from rollout.weights.handed_over import HandedOver
from trainers_adapters.policy.checkpointing import enable_gradient_checkpointing

WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"  # what diffusers' save_pretrained writes (unsharded)


class FullPolicy:
    """Every weight of the model's denoisers, trained, sharded with FSDP2 over the ranks of the
    default process group (one rank too: `TrainerRanks.from_environment(..., always_join=True)`).
    `dtype`: the engine's, which the forwards run at (float32 master weights either way)."""

    name = None  # the engine samples with its base weights, which each push replaces: no adapter
    sharded = True  # every rank takes part in each forward, backward and push
    saved_as = "weights"  # its folder in a run's output and checkpoints: a diffusers folder per denoiser
    shares_base = False  # it trains the base: nothing to share with an engine

    def __init__(
        self,
        model: str,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        attention_backend: str | None = None,
        gradient_checkpointing: bool = False,
        keep_reference: bool = False,
    ):
        if not dist.is_initialized():
            raise RuntimeError(
                "FullPolicy shards the denoisers with FSDP2, which needs torch.distributed's process group: launch "
                "with torchrun, or on one rank call TrainerRanks.from_environment(device, always_join=True)"
            )
        # Loaded on the CPU: `fully_shard` moves each unit (a block, then the rest) to the rank's device as
        # it shards it, so a device never holds the whole float32 model (FLUX.1-dev's 48 GB beside its
        # engine). The other components (text encoders, VAE: DPO encodes its prompts) are needed only to
        # run, at the engine's dtype, as the engine runs them.
        if attention_backend is not None:  # checked where and at the dtype the forwards run, before anything loads
            refusal = backend_refusal(attention_backend, device, dtype, probe=True)
            if refusal is not None:
                raise ValueError(refusal)
        self.adapter = load_adapter(model, "cpu", torch.float32)
        self.model = str(model)
        self.dtype = dtype
        self.denoisers = self.adapter.denoisers
        for name, component in self.adapter.components.items():
            if name not in self.denoisers:
                component.to(device=device, dtype=dtype)
        pipeline_class = type(self.adapter.pipeline).__name__
        if gradient_checkpointing:
            families = "/".join(family.name for family in families_of(pipeline_class))
            enable_gradient_checkpointing(self.denoisers, f"{pipeline_class} (family {families})")
        mixed = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))  # the device units move to
        # fully_shard swaps each module's class for an FSDP subclass; saving names the plain one.
        self._classes = {component: type(denoiser) for component, denoiser in self.denoisers.items()}
        for denoiser in self.denoisers.values():
            denoiser.requires_grad_(True)
            blocks = repeated_block_classes(denoiser)
            for module in denoiser.modules():
                if type(module).__name__ in blocks:
                    fully_shard(module, mesh=mesh, mp_policy=mixed)
            fully_shard(denoiser, mesh=mesh, mp_policy=mixed)
        if attention_backend is not None:
            set_attention_backend(self.denoisers, attention_backend)
        self._reference = [p.detach().clone() for p in self.parameters()] if keep_reference else None

    def parameters(self) -> list[torch.nn.Parameter]:
        """Every denoiser weight (this rank's shards): what the optimizer updates."""
        return [p for denoiser in self.denoisers.values() for p in denoiser.parameters()]

    def sum_gradients(self, ranks) -> None:
        """FSDP reduced the gradients over the `ranks` in the backward as their mean; the updates
        scale their losses by the whole minibatch, so they want the sum: times the rank count (exact
        for a power of two). A divide factor of 1 would say it directly, but gloo has no
        pre-multiplied sum for it."""
        for parameter in self.parameters():
            if parameter.grad is not None:
                parameter.grad.mul_(ranks.world_size)

    def full_state(
        self, component: str, masters: bool = False, owned: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) of every weight of denoiser `component` at the engine's dtype (with
        `masters`: the float32 master weights), gathered from the shards one at a time
        (collective: every rank iterates it to the end). `owned`: each tensor is a new one that
        nothing of the policy holds (the gather's or the cast's output; a copy where neither made
        one: a single rank's float32 shard, an unsharded buffer), so it can be handed over."""
        for name, tensor in self.denoisers[component].state_dict().items():
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            full = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()
            if not masters and full.is_floating_point():
                full = full.to(self.dtype)
            if owned and full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
                full = full.clone()
            yield name, full

    def push(self, engine, version: int | None = None) -> int | None:
        """Replace the engine's weights of every denoiser with the trainer's, tensor by tensor as
        they are gathered; returns the weight version of the last (`version`: a resumed run's,
        given to the last). Collective: every rank calls it; a rank without an engine (None: the
        separate placement's other ranks) gathers and drops, and gets None. The gathered tensors
        are handed over (`HandedOver`): an engine in this process (colocated) takes them as its
        weights in place, with no staging copy; any other copies them as it sends them."""
        pushed = None
        components = list(self.denoisers)
        for component in components:
            tensors = self.full_state(component, owned=engine is not None)
            if engine is None:
                for _ in tensors:
                    pass
                continue
            last = component == components[-1]
            update = HandedOver(tensors)
            pushed = engine.update_weights(update, component=component, version=version if last else None)
        return pushed

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Inside this block the denoisers hold the initial weights (`keep_reference`) and run
        without gradients; the trained ones come back after it, bitwise."""
        if self._reference is None:
            raise RuntimeError(
                "this FullPolicy keeps no reference copy (a KL term or DPO needs one): build it with "
                "keep_reference=True"
            )
        with torch.no_grad():
            self._swap_reference()
            try:
                yield
            finally:
                self._swap_reference()

    def _swap_reference(self) -> None:
        # The root module keeps its weights gathered from a forward to its backward; back to the
        # shards, which the next forward (or the backward) gathers again, here with the other values.
        for denoiser in self.denoisers.values():
            denoiser.reshard()
        for parameter, saved in zip(self.parameters(), self._reference, strict=True):
            held = parameter.detach().clone()
            parameter.detach().copy_(saved)
            saved.copy_(held)

    def score(self, trajectories: Sequence[Trajectory], steps: int | Sequence[int]) -> StepOutput:
        """As `LoraPolicy.score`: step `steps[i]` of trajectory i re-scored in one batched forward,
        with gradients through every weight."""
        if isinstance(steps, int):
            steps = [steps] * len(trajectories)
        check_scorable(trajectories, steps)
        return score_steps(self.adapter, trajectories, steps)

    def predict_velocity(
        self, latents: torch.Tensor, sigmas: torch.Tensor, trajectories: Sequence[Trajectory]
    ) -> torch.Tensor:
        """As `LoraPolicy.predict_velocity`: the conditional velocity, without classifier-free guidance."""
        first = trajectories[0]
        conditions = [Condition(t.condition.prompt) for t in trajectories]
        guidance = Guidance(guidance_scale=first.guidance_scale)
        return self.adapter.predict_velocity(
            latents, sigmas, conditions, height=first.height, width=first.width, guidance=guidance
        )

    def save(self, folder: str | Path | None, write: bool = True) -> Path | None:
        """Write every denoiser as diffusers' `save_pretrained` does (`folder/<component>/config.json`
        and its weights in float32), which `from_pretrained` loads as a plain diffusers folder.
        Collective: every rank gathers; only the one with `write` writes (the others may pass None)."""
        folder = Path(folder) if write else None
        for component, denoiser in self.denoisers.items():
            state = {name: tensor.contiguous() for name, tensor in self.full_state(component, masters=True)}
            if write:
                with torch.device("meta"):  # an unsharded module over the gathered tensors, to save from
                    plain = self._classes[component].from_config(denoiser.config)
                plain.load_state_dict(state, assign=True)
                plain.save_pretrained(folder / component, safe_serialization=True)
        return folder

    def load(self, folder: str | Path) -> None:
        """Set every weight to the ones `save` wrote to `folder`, bitwise (each rank takes its shards)."""
        folder = Path(folder)
        with torch.no_grad():
            for component, denoiser in self.denoisers.items():
                saved = load_file(folder / component / WEIGHTS_FILE)
                for name, tensor in denoiser.state_dict().items():
                    if isinstance(tensor, DTensor):  # this rank's shard of the saved tensor, no communication
                        mine = distribute_tensor(
                            saved[name], tensor.device_mesh, tensor.placements, src_data_rank=None
                        )
                        tensor.to_local().copy_(mine.to_local())
                    else:
                        tensor.copy_(saved[name])

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state gathered whole (on every rank; collective), in parameter names."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(torch.nn.ModuleDict(self.denoisers), optimizer, options=options)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Give each rank its shards of the state `optimizer_state` gathered."""
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(torch.nn.ModuleDict(self.denoisers), optimizer, state, options=options)
