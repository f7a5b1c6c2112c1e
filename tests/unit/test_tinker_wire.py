"""forge serve's protobuf messages against the tinker SDK's own encoders and decoders (0.38.0):
a request the SDK encodes is what the server reads, and what the server answers is what the
SDK reads back. No process, no server."""

import math

import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from forge.serve.tinker.wire import (
    Sequence,
    WireError,
    forward_backward_output,
    read_forward_backward,
    sample_response,
)


def encoded(data: list[types.Datum], **config: float) -> bytes:
    request = types.ForwardBackwardRequest(
        model_id="s:train:0",
        seq_id=3,
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn="ppo", loss_fn_config=config or None
        ),
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def datum(tokens: list[int], **inputs: list[float]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def test_a_request_the_sdk_encodes_is_read_whole():
    body = encoded(
        [
            datum([1, 2, 3], target_tokens=[2, 3, 4], logprobs=[-1, -2, -0.5], advantages=[1] * 3),
            datum([9, 8], target_tokens=[8, 7], logprobs=[-0.1, -0.2], advantages=[-1.0, -1.0]),
        ],
        clip_low_threshold=0.7,
    )  # fmt: skip
    request = read_forward_backward(body)
    assert (request.model_id, request.seq_id, request.loss_fn) == ("s:train:0", 3, "ppo")
    assert request.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7)}
    assert request.problem is None and not request.forward_only
    first, second = request.data
    assert first.tokens == [1, 2, 3] and second.tokens == [9, 8]
    assert first.inputs["target_tokens"] == [2, 3, 4]
    assert first.inputs["logprobs"] == pytest.approx([-1, -2, -0.5])
    assert second.inputs["advantages"] == [-1.0, -1.0]


def test_inputs_of_the_wrong_length_are_the_requests_problem_not_its_delivery():
    body = encoded([datum([1, 2, 3], target_tokens=[2, 3], weights=[1.0, 1.0])])
    request = read_forward_backward(body)
    assert request.seq_id == 3  # it still takes its turn
    assert (
        request.problem == "datum 0: loss_fn_inputs 'target_tokens' has 2 values for 3 input tokens"
    )


def test_a_body_that_is_no_request_is_refused():
    with pytest.raises(WireError, match="not a ForwardBackwardRequest"):
        read_forward_backward(b"\xff\xff\xff not protobuf")


def test_the_sdk_reads_the_servers_outputs():
    out = deserialize_forward_backward_output(
        forward_backward_output([[-1.0, -2.0], [-0.5]], [[1.0, 2.0], [0.5]], {"loss:sum": 3.5})
    )
    assert out.metrics == {"loss:sum": 3.5}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]
    assert out.loss_fn_outputs[1]["elementwise_loss"].tolist() == [0.5]
    sampled = deserialize_sample_response(
        sample_response(
            [Sequence([5, 6], [-0.25, -0.5], stopped=True), Sequence([7], [-1.0], stopped=False)],
            [math.nan, -3.0, -4.0],
        )
    )
    assert [s.tokens for s in sampled.sequences] == [[5, 6], [7]]
    assert [s.stop_reason for s in sampled.sequences] == ["stop", "length"]
    assert sampled.sequences[0].logprobs == [-0.25, -0.5]
    assert sampled.prompt_logprobs == [None, -3.0, -4.0]
