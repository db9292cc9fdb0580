"""A `StepSeries` answers like the dense [T+1, ...] tensor trainers index (shape, slices, index
lists, torch.stack), by chain position; with record_steps an index past what was kept is refused;
on a real tree rollout the leaves' series still share their prefix parts, moved or not."""

from __future__ import annotations

import pytest
import torch

from rollout import SamplingParams
from rollout.step_series import StepSeries

pytestmark = pytest.mark.timeout(120)

DENSE = torch.arange(6 * 2 * 3, dtype=torch.float32).reshape(6, 2, 3)


def _dense_series() -> StepSeries:
    """DENSE as a tree leaf holds it: three parts (x_0 x_1 | x_2 x_3 | x_4 x_5)."""
    return StepSeries(range(6), [DENSE[:2].clone(), DENSE[2:4].clone(), DENSE[4:].clone()], 6)


def _sparse_series() -> StepSeries:
    """Positions 1, 2, 4, 5 of DENSE kept (what record_steps=(1, 4) keeps of a 5-step chain)."""
    return StepSeries([1, 2, 4, 5], [DENSE[[1, 2]].clone(), DENSE[[4, 5]].clone()], 6)


@pytest.mark.parametrize(
    "key",
    [
        0,
        -1,
        torch.tensor(3),
        slice(None, 3),
        slice(1, -1),
        slice(None, None, 2),
        slice(3, None),
        slice(4, 2),
        [0, 5, 2],
        [],
        torch.tensor([1, 3]),
        torch.tensor([True, False, False, True, True, False]),
        (slice(1, 3), 0),
        (-1, 1, 2),
        ([0, 4], slice(None), 1),
    ],
    ids=repr,
)
def test_every_index_gives_what_the_dense_tensor_gives(key):
    got = _dense_series()[key]
    assert isinstance(got, torch.Tensor) and got.shape == DENSE[key].shape
    assert torch.equal(got, DENSE[key])


def test_shape_dtype_device_len_and_iteration_are_the_dense_tensors():
    series = _dense_series()
    assert series.shape == DENSE.shape == torch.Size([6, 2, 3])
    assert (series.dtype, series.device, len(series), series.ndim) == (torch.float32, torch.device("cpu"), 6, 3)
    assert series.size() == DENSE.size() and series.size(0) == 6 and series.size(-1) == 3
    assert all(torch.equal(a, b) for a, b in zip(series, DENSE, strict=True))
    assert torch.equal(series.stack(), DENSE)


def test_a_slice_inside_one_part_is_a_view_and_one_across_parts_a_copy():
    series = _dense_series()
    inside = series[2:4]
    assert inside.data_ptr() == series.parts[1].data_ptr()  # no copy, as slicing a tensor
    assert series[4::1].data_ptr() == series.parts[2].data_ptr()
    across = series[1:3]
    assert all(across.data_ptr() != part.data_ptr() for part in series.parts)
    assert torch.equal(across, DENSE[1:3])


def test_torch_functions_take_a_series_as_its_stacked_entries():
    series = _dense_series()
    assert torch.stack([series, series]).shape == (2, 6, 2, 3)
    assert torch.equal(torch.stack([series, _dense_series()])[1], DENSE)
    assert torch.equal(torch.cat([series, DENSE[:1]]), torch.cat([DENSE, DENSE[:1]]))
    assert torch.equal(series, DENSE) and not torch.equal(series, DENSE + 1)
    assert torch.equal(DENSE - series, torch.zeros_like(DENSE))


def test_with_record_steps_positions_stay_chain_positions_and_unkept_ones_are_refused():
    series = _sparse_series()
    assert series.shape == (4, 2, 3) and len(series) == 4  # the kept entries
    assert torch.equal(series[4], DENSE[4]) and torch.equal(series[-1], DENSE[5])
    assert torch.equal(series[1:3], DENSE[1:3])  # positions 1 and 2, not the first two kept
    assert torch.equal(series[4:], DENSE[4:])
    assert torch.equal(series[[5, 1]], DENSE[[5, 1]])
    assert torch.equal(series.stack(), DENSE[[1, 2, 4, 5]])
    for reaching_3 in (slice(1, None), slice(1, 4), [2, 3], torch.tensor([3]), (3, 0)):
        with pytest.raises(IndexError, match=r"position 3 of this trajectory was not kept .* widen record_steps"):
            series[reaching_3]
    with pytest.raises(IndexError, match="position 0 .* not kept"):
        series[:]  # every chain position: .stack() gives the kept ones


def test_a_series_with_record_steps_is_never_lined_up_with_steps_by_its_order():
    """torch.stack([t.latents ...])[:, j] would be the j-th kept entry, not step j as log_probs[:, j]
    is: a series that keeps only some positions is refused wherever its order would stand for
    positions (torch functions, iteration), with the calls that say which entries are meant."""
    series = _sparse_series()
    pointer = r"positions \[1, 2, 4, 5\] of 6.*series\[steps\].*series\.stack\(\)"
    for use in (
        lambda: torch.stack([series, series]),
        lambda: torch.cat([series]),
        lambda: torch.equal(series, DENSE[[1, 2, 4, 5]]),
        lambda: list(series),
        lambda: [entry for entry in series],
    ):
        with pytest.raises(TypeError, match=pointer):
            use()
    assert not series.keeps_every_position and _dense_series().keeps_every_position
    # What a ported loop writes instead: the entries by chain position, or the kept ones knowingly.
    assert torch.equal(torch.stack([series[[1, 4]], series[[1, 4]]])[:, 1], DENSE[[4, 4]])
    assert torch.equal(torch.stack([series.stack()])[0, 2], DENSE[series.positions[2]])


def test_tensor_methods_and_arithmetic_point_to_stack():
    series = _dense_series()
    for method in ("clone", "float", "mean", "numpy", "cpu", "detach", "sum", "view"):
        with pytest.raises(AttributeError, match=rf"has no \.{method}.*\.stack\(\)"):
            getattr(series, method)
    for use in (
        lambda: series + 1,
        lambda: 1 + series,
        lambda: series * 2,
        lambda: 2.0 * series,
        lambda: series - DENSE,
        lambda: series / 2,
        lambda: -series,
        lambda: series**2,
        lambda: series < 1,
    ):
        with pytest.raises(TypeError, match=r"not a tensor .*\.stack\(\)"):
            use()
    with pytest.raises(AttributeError, match="no attribute 'not_a_tensor_name'"):
        series.not_a_tensor_name  # noqa: B018
    assert torch.equal(series.stack().clone().float() * 2, DENSE * 2)


def test_bad_keys_say_what_a_series_takes():
    series = _dense_series()
    for key in ("0", 1.5, None, torch.tensor([0.5])):
        with pytest.raises(TypeError, match=r"\.stack\(\)"):
            series[key]
    with pytest.raises(TypeError, match=r"starts with chain positions .*\.stack\(\)"):
        series[..., 0]
    with pytest.raises(IndexError, match=r"one entry per chain position, shape \(6,\), got \(5,\)"):
        series[torch.ones(5, dtype=torch.bool)]
    with pytest.raises(IndexError, match="position 6 .* not kept"):
        series[6]


def test_to_moves_the_parts_and_a_shared_memo_keeps_shared_parts_shared():
    root = DENSE[:2].clone()
    a = StepSeries(range(6), [root, DENSE[2:].clone()], 6)
    b = StepSeries(range(6), [root, DENSE[2:].clone() + 1], 6)
    memo = {}
    moved_a, moved_b = a.to(torch.float64, memo=memo), b.to(torch.float64, memo=memo)
    assert moved_a.dtype == torch.float64 and torch.equal(moved_a.stack(), DENSE.double())
    assert moved_a.parts[0] is moved_b.parts[0]  # the shared part moved once
    assert moved_a.parts[1] is not moved_b.parts[1]
    alone = a.to(torch.float64), b.to(torch.float64)
    assert alone[0].parts[0] is not alone[1].parts[0]  # without a memo each moves its own copy
    assert a.to(torch.float32).parts[0] is root  # already there: Tensor.to's own answer, no copy


TREE = SamplingParams(num_inference_steps=4, seed=5, branch_steps=(1, 2), branch_factor=2)


@pytest.fixture(scope="module")
def leaves(engine):
    return engine.generate("a red square", TREE)


def test_a_tree_leafs_latents_index_like_the_dense_chain(leaves):
    for leaf in leaves:
        latents = leaf.trajectory.latents
        dense = latents.stack()
        assert latents.shape == dense.shape == (5, 4, 16, 16) and latents.dtype == torch.float32
        assert torch.equal(latents[:-1], dense[:-1]) and torch.equal(latents[1:], dense[1:])
        assert torch.equal(latents[::2], dense[::2]) and torch.equal(latents[[0, 4]], dense[[0, 4]])
    batch = torch.stack([leaf.trajectory.latents for leaf in leaves])  # as Flow-GRPO stacks its samples
    assert batch.shape == (4, 5, 4, 16, 16)
    assert torch.equal(batch[:, :2], batch[:1, :2].expand(4, -1, -1, -1, -1))  # x_0, x_1: before any branch


def test_a_tree_leafs_prefix_slices_are_the_shared_part_and_stay_shared_when_moved(leaves):
    # x_0 x_1 (before the first branch) are one tensor in every leaf: their slices are views of it.
    assert len({leaf.trajectory.latents[:2].data_ptr() for leaf in leaves}) == 1
    assert leaves[0].trajectory.latents[2].data_ptr() == leaves[1].trajectory.latents[2].data_ptr()
    assert leaves[0].trajectory.latents[2].data_ptr() != leaves[2].trajectory.latents[2].data_ptr()
    memo = {}
    moved = [leaf.trajectory.latents.to(torch.float64, memo=memo) for leaf in leaves]
    unique_before = {id(part) for leaf in leaves for part in leaf.trajectory.latents.parts}
    unique_after = {id(part) for series in moved for part in series.parts}
    assert len(unique_after) == len(unique_before) == 1 + 2 + 4  # root, two branches, four leaves
    assert len({series[:2].data_ptr() for series in moved}) == 1
    for series, leaf in zip(moved, leaves, strict=True):
        assert torch.equal(series.stack(), leaf.trajectory.latents.stack().double())


def test_a_record_steps_trajectory_slices_its_kept_positions(engine):
    params = SamplingParams(num_inference_steps=5, seed=5, record=("x0",), record_steps=(1, 3))
    (full,) = engine.generate("x", SamplingParams(**{**params.__dict__, "record_steps": None}))
    (kept,) = engine.generate("x", params)
    latents = kept.trajectory.latents  # positions 1, 2, 3, 4, 5
    assert latents.shape == (5, 4, 16, 16)
    assert torch.equal(latents[1:], full.trajectory.latents[1:])
    assert torch.equal(kept.trajectory.records["x0"][[1, 3]], full.trajectory.records["x0"][[1, 3]])
    with pytest.raises(IndexError, match="position 0 .* widen record_steps"):
        latents[:-1]
    with pytest.raises(IndexError, match="position 2 .* widen record_steps"):
        kept.trajectory.records["x0"][1:3]
