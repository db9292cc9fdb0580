"""Text embeddings cross from a worker to the engine once while its requests use them, and the
outputs still carry them, shared (rollout.worker.sent_conditions). In process: the executors carry the
same `RunnerOutput`, and the contract tests check the sharing on every backend."""

from __future__ import annotations

import pytest
import torch

from executors.uni import UniExecutor
from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.messages import ConditionKeys


class RecordingExecutor(UniExecutor):
    """The in-process executor, keeping every step's `RunnerOutput`."""

    def __init__(self, config):
        self.replies = []
        super().__init__(config)

    def execute(self, scheduler_output):
        outputs = super().execute(scheduler_output)
        self.replies += outputs
        return outputs


@pytest.fixture(scope="module")
def engine(tiny_model):
    with RolloutEngine(EngineConfig(model=tiny_model, executor=RecordingExecutor)) as engine:
        yield engine


def _encoded(worker, text: str, length: int) -> torch.Tensor:
    return worker.adapter.encode_prompts([text], length)[0].prompt_embeds.to("cpu", torch.float32)


def test_a_texts_embeddings_cross_once_while_its_requests_run(engine):
    engine.executor.replies.clear()
    for steps in (2, 4):  # two groups of one text, finishing in different steps
        engine.add_request("a red square", SamplingParams(num_inference_steps=steps, seed=steps))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    first, second = [reply for reply in engine.executor.replies if reply.finished]
    keys = first.finished[0].condition
    assert isinstance(keys, ConditionKeys) and keys.negative is not None  # SD3 guides with ""
    assert sorted(first.embeds) == sorted([keys.prompt, keys.negative]) and first.released_embeds == ()
    assert second.embeds == {} and second.finished[0].condition == keys  # numbers only
    assert sorted(second.released_embeds) == sorted(first.embeds)  # no live request uses them now
    a, b = (o.trajectory.condition for o in outputs)
    assert a.prompt is b.prompt and a.negative is b.negative
    length = engine.model_spec.resolve(SamplingParams())[0].max_sequence_length
    assert torch.equal(a.prompt.prompt_embeds, engine.collective_rpc(_encoded, args=("a red square", length))[0])
    assert engine.collective_rpc(lambda worker: len(worker.sent_conditions)) == [0]
    # Released numbers are never reused: the text's next request sends its embeddings again.
    engine.generate(["a red square"], SamplingParams(num_inference_steps=1, seed=0))
    again = engine.executor.replies[-1]
    assert len(again.embeds) == 2 and not set(again.embeds) & set(first.embeds)


def test_an_abort_releases_the_embeddings_its_request_held(engine):
    engine.add_request("a blue circle", SamplingParams(num_inference_steps=1, seed=0))
    engine.add_request("a blue circle", SamplingParams(num_inference_steps=6, seed=1), request_id="long")
    (output,) = engine.step()  # the short one: its embeddings are sent, the long one holds them
    reply = engine.executor.replies[-1]
    keys = reply.finished[0].condition
    assert output.trajectory.condition.prompt is reply.embeds[keys.prompt]  # in process: the one sent
    assert len(reply.embeds) == 2 and reply.released_embeds == ()
    engine.abort("long")
    assert sorted(engine.executor.replies[-1].released_embeds) == sorted(reply.embeds)  # the frees' reply
    assert engine.collective_rpc(lambda worker: len(worker.sent_conditions)) == [0]
