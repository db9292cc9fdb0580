"""The parallel layouts' cost model: its formulas on a case small enough to work by hand, the layouts
it enumerates, its pick, and torch's FLOP counter counting the same on meta as on real tensors."""

from __future__ import annotations

import dataclasses

import diffusers
import pytest
import torch

from benchmarks.flop_count import count_forward_flops
from benchmarks.parallel_cost import (
    Hardware,
    Layout,
    ModelCost,
    analytic_attention_flops,
    latent_tokens,
    layouts,
    pick,
    step_cost,
    ulysses_bytes_per_rank,
)

pytestmark = pytest.mark.timeout(120)

# 5e12 FLOP/s, 1 GB/s, 1 µs a collective, 2 GB a GPU: round numbers for the sums below.
HARDWARE = Hardware(peak_flops=1e13, mfu=0.5, link_bytes_per_s=1e9, collective_latency_s=1e-6, memory_bytes=2e9)
# 16 tokens of 4 heads of 2, 3 attention layers, CFG's two passes of 8 TFLOP each.
MODEL = ModelCost(
    name="by hand",
    flops_per_forward=8e12,
    heads=4,
    head_dim=2,
    attention_layers=3,
    sequence=16,
    passes=2,
    velocity_elements=100,
    weight_bytes=1e9,
    activation_bytes_per_token=10.0,
)


def test_tokens_are_the_latents_patches():
    assert latent_tokens(480, 832, 81) == 21 * 30 * 52 == 32760  # Wan: 4x in time, 8x in space, 1x2x2 patches
    assert latent_tokens(1024, 1024) == 4096 and latent_tokens(2048, 2048) == 16384  # 8x, 2x2 patches


def test_ulysses_and_cfg_costs_by_hand():
    # Each all-to-all moves S·H·D·b = 16·4·2·2 = 256 bytes in all; a rank holds half, sends half of that.
    assert ulysses_bytes_per_rank(16, 4, 2, 2, 2) == 4 * 256 / 4
    cost = step_cost(MODEL, Layout(data=1, cfg=2, ulysses=2), HARDWARE)
    assert cost.compute_s == pytest.approx(8e12 / 2 / 5e12)  # one pass per CFG group, split over 2 ranks
    assert cost.sent_bytes == 3 * 256
    assert cost.ulysses_s == pytest.approx(3 * (256 / 1e9 + 4e-6))  # 3 layers of 4 all-to-alls
    assert cost.ring_exposed_s == 0
    assert cost.cfg_s == pytest.approx(100 / 2 * 2 / 1e9 + 1e-6)
    assert cost.memory_bytes == 1e9 + 1 * 8 * 10
    assert cost.step_s == pytest.approx(0.8 + 3 * (256e-9 + 4e-6) + 1.1e-6)
    assert cost.samples_per_s == pytest.approx(1 / cost.step_s)


def test_ring_costs_by_hand_with_and_without_overlap():
    block = 2 * 8 * 4 * 2 * 2  # K and V of 8 tokens (S/r), 4 heads of 2, bf16
    gathered = step_cost(MODEL, Layout(data=1, ring=2), HARDWARE)
    assert gathered.compute_s == pytest.approx(2 * 8e12 / 2 / 5e12)  # both passes, half the sequence
    assert gathered.sent_bytes == 2 * 3 * block
    assert gathered.ring_exposed_s == pytest.approx(2 * 3 * (block / 1e9 + 1e-6))  # one all-gather a layer
    block_attention_s = 4 * 8 * 8 * 4 * 2 / 5e12
    overlapped = step_cost(MODEL, Layout(data=1, ring=2), HARDWARE, ring_overlap=True)
    assert overlapped.ring_exposed_s == pytest.approx(2 * 3 * (block / 1e9 + 1e-6 - block_attention_s))
    slow_attention = dataclasses.replace(HARDWARE, peak_flops=1e6, mfu=1.0)  # the block's attention outlasts its pass
    assert step_cost(MODEL, Layout(data=1, ring=2), slow_attention, ring_overlap=True).ring_exposed_s == 0
    assert step_cost(MODEL, Layout(data=2), HARDWARE).step_s == pytest.approx(2 * 8e12 / 5e12)  # no traffic


@pytest.mark.parametrize("heads, passes", [(24, 2), (40, 2), (24, 1), (12, 1), (6, 2)])
def test_layouts_fill_the_gpus_and_split_whole_heads(heads, passes):
    found = layouts(8, heads, passes)
    expected = {
        (d, c, u, r)
        for d in range(1, 9)
        for c in (1, 2)
        for u in range(1, 9)
        for r in range(1, 9)
        if d * c * u * r == 8 and heads % u == 0 and c <= passes
    }
    assert {(x.data, x.cfg, x.ulysses, x.ring) for x in found} == expected
    assert len(found) == len(expected) and found[0] == Layout(data=8)
    assert all(layout.gpus == 8 for layout in found)
    if heads == 12:
        assert max(layout.ulysses for layout in found) == 4  # 12 heads: no Ulysses 8
    if heads == 6:
        assert {layout.ulysses for layout in found} == {1, 2}


def test_pick_splits_only_what_does_not_fit():
    # 10 kB/s links: an all-to-all costs about a tenth of a step, CFG's exchange about 1%.
    slow = dataclasses.replace(HARDWARE, link_bytes_per_s=1e4)
    costs = [step_cost(MODEL, layout, slow) for layout in layouts(8, MODEL.heads, MODEL.passes)]
    assert costs[0].layout == Layout(data=8) and costs[0].samples_per_s == max(c.samples_per_s for c in costs)
    roomy = pick(costs, memory_bytes=1e12, tie=0.02)
    assert roomy.layout == Layout(data=4, cfg=2)  # within 2% of 8 x data parallel's throughput, half its latency
    assert pick(costs, memory_bytes=1e12, tie=0.0).layout == Layout(data=8)
    # Activations of 1e8 bytes a token: a GPU holds 10 tokens' worth beside the weights, so a sample's 2 x 16
    # tokens need splitting over 4 GPUs; the best of those gives up CFG's 1%, not an all-to-all's 10%.
    heavy = dataclasses.replace(MODEL, activation_bytes_per_token=1e8)
    costs = [step_cost(heavy, layout, slow) for layout in layouts(8, heavy.heads, heavy.passes)]
    forced = pick(costs, memory_bytes=HARDWARE.memory_bytes, tie=0.02)
    assert forced.memory_bytes <= HARDWARE.memory_bytes < costs[0].memory_bytes
    assert forced.layout.per_sample == 4 and forced.layout.data == 2 and forced.layout.cfg == 2
    assert pick(costs, memory_bytes=1e9, tie=0.02) is None  # the weights alone fill it


TINY_FLUX = {
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 32,
    "guidance_embeds": True,
    "axes_dims_rope": (4, 6, 6),
}


def flux_inputs(tokens: int, text: int) -> dict:
    return {
        "hidden_states": torch.randn(1, tokens, 16),
        "encoder_hidden_states": torch.randn(1, text, 32),
        "pooled_projections": torch.randn(1, 32),
        "timestep": torch.tensor([0.5]),
        "guidance": torch.tensor([3.5]),
        "img_ids": torch.zeros(tokens, 3),
        "txt_ids": torch.zeros(text, 3),
    }


def wan_inputs() -> dict:
    return {
        "hidden_states": torch.randn(1, 4, 2, 8, 8),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": torch.randn(1, 8, 32),
    }


@pytest.mark.parametrize(
    "class_name, config, inputs",
    [
        ("FluxTransformer2DModel", TINY_FLUX, lambda: flux_inputs(64, 8)),
        (
            "WanTransformer3DModel",
            {"num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 4, "out_channels": 4, "text_dim": 32}
            | {"freq_dim": 32, "ffn_dim": 64, "num_layers": 2, "rope_max_seq_len": 64},
            wan_inputs,
        ),
    ],
)
def test_flop_counter_counts_the_same_on_meta_as_on_real_tensors(class_name, config, inputs):
    torch.manual_seed(0)
    real = count_forward_flops(getattr(diffusers, class_name)(**config), inputs())
    with torch.device("meta"):
        meta = count_forward_flops(getattr(diffusers, class_name)(**config), inputs())
    assert meta.total == real.total and meta.by_op == real.by_op
    assert 0 < real.attention < real.total  # attention counted (the CPU's default kernel would count 0)
    if class_name == "FluxTransformer2DModel":  # 2 joint attentions over 64 image + 8 text tokens, width 32
        assert real.attention == analytic_attention_flops(2, 32, 72, 72)
    else:  # 2 self-attentions over 2 x 4 x 4 patches, 2 cross-attentions over 8 text tokens
        assert real.attention == analytic_attention_flops(2, 32, 32, 32) + analytic_attention_flops(2, 32, 32, 8)
