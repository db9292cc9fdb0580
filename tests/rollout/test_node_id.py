"""Ids are data: a `NodeId` (group, sample, branch path) whose text is today's id form, read back
only where text arrives; every output carries it, through the engine, trees, aborts and the wire."""

from __future__ import annotations

import itertools
import random

import pytest

from rollout import NodeId, SamplingParams
from rollout.http.wire import FrameReader, OutputDecoder, OutputEncoder, WireError

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("node_id", "text"),
    [
        (NodeId("req0", 1), "req0-1"),
        (NodeId("req12", 0, (2, 0, 1)), "req12-0.2.0.1"),
        (NodeId("my-run-3", 10, (0,)), "my-run-3-10.0"),  # a group may hold '-': the sample is after the last
        (NodeId("", 0), "-0"),
    ],
)
def test_the_text_form_is_the_old_id_and_parses_back(node_id, text):
    assert str(node_id) == text
    assert NodeId.parse(text) == node_id


@pytest.mark.parametrize("text", ["req0", "req0-", "req0-x", "req0-1.", "req0-1.a", "req0-01", "req0-1.01", "a.b-1"])
def test_text_of_another_form_is_refused(text):
    with pytest.raises(ValueError, match=r"is not a sample or branch id; those read '\{group\}-\{sample\}'"):
        NodeId.parse(text)


def test_bad_parts_are_refused_by_name():
    with pytest.raises(ValueError, match="group is a str without '.'"):
        NodeId("a.b", 0)
    with pytest.raises(ValueError, match="sample is an int >= 0"):
        NodeId("a", -1)
    with pytest.raises(ValueError, match="branch_path holds child indices"):
        NodeId("a", 0, (1, -2))
    assert NodeId("a", 0, [1, 2]).branch_path == (1, 2)  # a list is taken as the tuple it means


def test_family_relations():
    leaf = NodeId("g", 1, (2, 0))
    assert leaf.root == NodeId("g", 1) and leaf.parent == NodeId("g", 1, (2,)) and leaf.root.parent is None
    assert leaf.ancestors == (NodeId("g", 1), NodeId("g", 1, (2,))) and leaf.depth == 2
    assert NodeId("g", 1).child(2).child(0) == leaf == NodeId("g", 1).descendant((2, 0))
    assert leaf.root.is_ancestor_of(leaf) and leaf.parent.is_ancestor_of(leaf) and leaf.is_descendant_of(leaf.root)
    assert not leaf.is_ancestor_of(leaf) and not leaf.is_ancestor_of(leaf.root)
    assert not NodeId("g", 1, (1,)).is_ancestor_of(leaf)  # a sibling's subtree
    assert not NodeId("g", 2).is_ancestor_of(leaf) and not NodeId("h", 1).is_ancestor_of(leaf)
    assert len({leaf, NodeId.parse("g-1.2.0")}) == 1  # hashable, equal by value


def test_the_leaves_of_a_group_sort_as_the_engine_returns_them():
    ordered = [NodeId("g", k, path) for k in range(3) for path in itertools.product(range(2), repeat=2)]
    shuffled = random.Random(0).sample(ordered, len(ordered))
    assert sorted(shuffled) == ordered


def test_plain_outputs_carry_their_group_and_node(engine):
    params = SamplingParams(num_inference_steps=2, num_samples=3, seed=1)
    ids = engine.add_request("a red square", params, request_id="my-run")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    outputs.sort(key=lambda o: o.node_id)
    assert ids == ["my-run-0", "my-run-1", "my-run-2"] == [o.request_id for o in outputs]
    assert [o.node_id for o in outputs] == [NodeId("my-run", k) for k in range(3)]
    assert {o.group_id for o in outputs} == {"my-run"} and [o.sample_index for o in outputs] == [0, 1, 2]
    made = engine.generate(["a", "b"], SamplingParams(num_inference_steps=2, seed=1))
    assert made[0].group_id != made[1].group_id and made[0].request_id == f"{made[0].group_id}-0"


@pytest.fixture(scope="module")
def tree(engine):
    params = SamplingParams(num_inference_steps=3, num_samples=2, seed=2, branch_steps=(1,), branch_factor=2)
    return engine.generate(["a red square"], params)


def test_tree_outputs_carry_their_node_and_come_in_node_order(tree):
    assert len(tree) == 4 and len({o.group_id for o in tree}) == 1
    group = tree[0].group_id
    assert [o.node_id for o in tree] == [NodeId(group, k, (c,)) for k in range(2) for c in range(2)]
    assert all(str(o.node_id) == o.request_id and o.node_id.branch_path == o.branch_path for o in tree)
    assert sorted(o.node_id for o in reversed(tree)) == [o.node_id for o in tree]


def test_aborting_a_branch_by_its_text_id_ends_that_subtree(engine):
    params = SamplingParams(num_inference_steps=3, seed=2, branch_steps=(1,), branch_factor=3)
    ids = engine.add_request("x", params, request_id="cut")
    aborted = engine.abort("cut-0.1")  # before it exists: pruned from its root
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert ids == ["cut-0.0", "cut-0.1", "cut-0.2"]
    assert [(o.node_id, o.status) for o in aborted] == [(NodeId("cut", 0, (1,)), "aborted")]
    assert sorted(o.node_id for o in outputs) == [NodeId("cut", 0, (0,)), NodeId("cut", 0, (2,))]


def test_the_wire_carries_group_and_node(tree):
    encoder, reader, decoder = OutputEncoder(), FrameReader(), OutputDecoder()
    frames = list(reader.feed(b"".join(encoder.encode(output) for output in tree)))
    decoded = [o for o in (decoder.decode(fields, tensors) for fields, tensors in frames) if o is not None]
    assert [(o.node_id, o.group_id, o.request_id) for o in decoded] == [
        (o.node_id, o.group_id, o.request_id) for o in tree
    ]
    fields, tensors = next((f, t) for f, t in frames if f["kind"] == "output")
    assert (fields["group_id"], fields["sample_index"], fields["branch_path"]) == (tree[0].group_id, 0, [0])
    with pytest.raises(WireError, match="request_id 'other-0.0' is not its group, sample and branch path"):
        decoder.decode({**fields, "request_id": "other-0.0"}, tensors)
