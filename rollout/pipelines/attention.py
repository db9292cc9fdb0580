"""Diffusers' attention dispatcher as a setting (`EngineConfig.attention_backend`, `load_adapter`'s
`attention_backend`): which kernel computes every attention of the denoisers.

A name is one of `diffusers.models.attention_dispatch.AttentionBackendName`'s values; None keeps
diffusers' default (its active backend, "native": torch's `scaled_dot_product_attention`). Whether
a name can run here is what the installed diffusers and torch say: diffusers' own requirement
check (the package the kernel comes from), the constraints it registered for the backend (CUDA
only, bfloat16 or float16 only), and, where the device is the CPU, one tiny attention computed
with it. A backend that diffusers fetches from the Hugging Face Hub (`*_hub`) is refused: nothing
is downloaded at run time.

diffusers' dispatcher, its registry and its checks are private names of
`diffusers.models.attention_dispatch` (diffusers 0.36+); this module is the one place that reads them.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping

import torch
from diffusers.models import attention_dispatch as dispatch

logger = logging.getLogger(__name__)

# The constraints diffusers registers that hold a backend to a dtype, and to CUDA: what can be
# checked without touching the device (an engine's process may have no GPU: Ray workers elsewhere).
_DTYPE_CHECKS = (dispatch._check_qkv_dtype_bf16_or_fp16, dispatch._check_qkv_dtype_bf16)
# Probe shape in the dispatcher's layout [batch, tokens, heads, head_dim]; 64 is the head size of
# SD3, FLUX.1, Qwen-Image and Wan (some kernels take only 64 or 128).
_PROBE_SHAPE = (1, 8, 2, 64)


def backend_names() -> tuple[str, ...]:
    """Every name diffusers' dispatcher knows, in its own order."""
    return tuple(member.value for member in dispatch.AttentionBackendName)


def attention_backend_problem(
    name: str, device: str, dtype: torch.dtype, sequence_parallel: int = 1, probe: bool | None = None
) -> str | None:
    """Why backend `name` cannot compute attention for a model on `device` in `dtype` (None: it
    can). `probe`: compute one tiny attention with it on `device` (default: on the CPU only, so a
    process that holds no GPU, as an engine's driver may, checks a CUDA device without one)."""
    if name not in backend_names():
        return f"attention_backend {name!r} is not one of diffusers' attention backends"
    backend = dispatch.AttentionBackendName(name)
    if name.endswith("_hub"):
        return (
            f"attention_backend {name!r} downloads its kernel from the Hugging Face Hub when it is set, and "
            "nothing is downloaded at run time"
        )
    try:
        dispatch._check_attention_backend_requirements(backend)
    except RuntimeError as error:
        return f"attention_backend {name!r} cannot run here: {error}"
    if sequence_parallel > 1 and not dispatch._AttentionBackendRegistry._is_context_parallel_available(backend):
        return (
            f"attention_backend {name!r} does not support diffusers' context parallelism, which "
            f"sequence_parallel={sequence_parallel} runs on"
        )
    device_type = torch.device(device).type
    if probe is None:
        probe = device_type == "cpu"
    checks = dispatch._AttentionBackendRegistry._constraints[backend]
    if not probe:
        checks = [check for check in checks if check in _DTYPE_CHECKS]
        device = "cpu"  # the dtype checks read only the tensors' dtype
    why = _probe_failure(backend, checks, device, dtype, compute=probe)
    if why is not None:
        shown_dtype = str(dtype).removeprefix("torch.")
        return f"attention_backend {name!r} cannot run on {device_type} in {shown_dtype}: {why}"
    return None


def usable_backends(
    device: str, dtype: torch.dtype, sequence_parallel: int = 1, probe: bool | None = None
) -> list[str]:
    """The names `attention_backend_problem` finds no problem with."""
    return [
        name
        for name in backend_names()
        if attention_backend_problem(name, device, dtype, sequence_parallel, probe) is None
    ]


def backend_refusal(
    name: str, device: str, dtype: torch.dtype, sequence_parallel: int = 1, probe: bool | None = None
) -> str | None:
    """`attention_backend_problem`'s answer with the choices that would work here, as an error
    message; None when `name` can run."""
    problem = attention_backend_problem(name, device, dtype, sequence_parallel, probe)
    if problem is None:
        return None
    choices = usable_backends(device, dtype, sequence_parallel, probe)
    return f"{problem.rstrip('.')}; choose None (diffusers' default) or one of: {', '.join(choices)}"


def set_attention_backend(denoisers: Mapping[str, torch.nn.Module], name: str) -> None:
    """Make every attention of every denoiser (`PipelineAdapter.denoisers`) dispatch to backend
    `name`. A denoiser whose attention does not go through diffusers' dispatcher (SD3's
    `JointAttnProcessor2_0` calls torch's attention itself) is refused, never left as it was."""
    for component, module in denoisers.items():
        processors = {type(processor).__name__ for processor in attention_processors(module)}
        ignoring = sorted(processors - _dispatching(module))
        if ignoring:
            raise ValueError(
                f"attention_backend {name!r} cannot apply to {component} ({type(module).__name__}): its attention "
                f"processors {', '.join(ignoring)} call torch's attention directly, not diffusers' dispatcher; "
                "leave attention_backend None for this model"
            )
    # diffusers' `set_attention_backend` also makes `name` the process's active backend, which every
    # other model's attention then uses (a trainer's copy with the default, a second engine in the
    # process). Each processor keeps `name` as its own, so the process's default is put back.
    active = dispatch._AttentionBackendRegistry.get_active_backend()[0]
    quiet = logging.getLogger("diffusers.models.modeling_utils")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its "experimental feature" warning, once per denoiser and process
    try:
        for module in denoisers.values():
            module.set_attention_backend(name)
    finally:
        quiet.setLevel(level)
        dispatch._AttentionBackendRegistry.set_active_backend(active)
    logger.info("attention of %s dispatched to %s", ", ".join(denoisers), name)


def dispatches_attention(module: torch.nn.Module) -> bool:
    """Whether every attention processor of `module` goes through diffusers' dispatcher (declares
    `_attention_backend`, which `set_attention_backend` sets and the processor passes on)."""
    processors = {type(processor).__name__ for processor in attention_processors(module)}
    return bool(processors) and processors <= _dispatching(module)


def attention_processors(module: torch.nn.Module) -> list:
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return [m.processor for m in module.modules() if isinstance(m, Attention | AttentionModuleMixin)]


def _dispatching(module: torch.nn.Module) -> set[str]:
    """The names of `module`'s processor classes that declare `_attention_backend` on the class."""
    return {
        type(processor).__name__
        for processor in attention_processors(module)
        if any("_attention_backend" in vars(cls) for cls in type(processor).__mro__)
    }


def _probe_failure(backend, checks, device: str, dtype: torch.dtype, compute: bool) -> str | None:
    query = torch.randn(_PROBE_SHAPE, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    arguments = {
        "query": query,
        "key": query,
        "value": query,
        "attn_mask": None,
        "dropout_p": 0.0,
        "is_causal": False,
        "scale": None,
    }
    try:
        for check in checks:
            check(**arguments)
        if compute:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # flex on the CPU, uncompiled: its advice to compile it
                dispatch.dispatch_attention_fn(query, query, query, backend=backend)
    except (RuntimeError, ValueError, TypeError, NotImplementedError, AssertionError) as error:
        return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return None
