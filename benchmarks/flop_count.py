"""FLOPs of one forward as torch counts them (`torch.utils.flop_counter.FlopCounterMode`).

The counter reads FLOPs from the shapes of matmuls, convolutions and attention, so it counts on the
meta device too: a 20B transformer at 32k tokens costs no memory. Attention runs under the math
kernel of `scaled_dot_product_attention` here, because the kernel the CPU picks by default
(`_scaled_dot_product_flash_attention_for_cpu`) is not in the counter's registry and would count as
zero; the math kernel's two batched matmuls count 4·S_q·S_kv·H·D per attention, what every fused
kernel does too, and the count is the same on meta and on real tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

# The aten ops that are attention's QK^T and PV under the math kernel (the rest are the linear layers
# and the patch embedding's convolution).
ATTENTION_OPS = ("aten.bmm",)


@dataclass(frozen=True)
class ForwardFlops:
    """FLOPs of one forward (multiply and add counted as 2), split by what does them."""

    total: float
    attention: float  # the QK^T and PV matmuls of every attention
    by_op: Mapping[str, float]

    @property
    def linear(self) -> float:
        """Everything but attention: linear layers (and a patch-embedding convolution)."""
        return self.total - self.attention


def count_forward_flops(module: torch.nn.Module, inputs: Mapping[str, object]) -> ForwardFlops:
    """The FLOPs of `module(**inputs)` without gradients (meta or real tensors alike)."""
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        module(**inputs)
    by_op = {str(op): float(flops) for op, flops in counter.get_flop_counts()["Global"].items()}
    attention = sum(flops for op, flops in by_op.items() if op in ATTENTION_OPS)
    return ForwardFlops(float(counter.get_total_flops()), attention, by_op)
