"""The Tinker API's binary messages, as tinker 0.38.0 sends and reads them: a forward_backward
request arrives as protobuf, and the results of forward_backward and of sampling go back as
protobuf (`tinker.proto.tinker_public_pb2`, the SDK's own schema). Every other message is JSON.
"""

from dataclasses import dataclass

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from forge.actors.trainer.client_steps import TokenDatum

PROTOBUF = "application/x-protobuf"

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class WireError(ValueError):
    """A request the server cannot read; its message names what is wrong."""


@dataclass
class ForwardBackward:
    """A decoded forward / forward_backward request."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    data: list[TokenDatum]
    problem: str | None = None  # why the data cannot be read: the request fails in its turn


def read_forward_backward(body: bytes) -> ForwardBackward:
    """Decodes a serialized `ForwardBackwardRequest`.

    A datum that is not text tokens with 1-D inputs as long as its tokens, or a config
    value that is not a number, is the request's `problem`.

    Raises:
        WireError: the body is not a ForwardBackwardRequest.
    """
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as error:  # protobuf's DecodeError, or a body of another kind
        raise WireError(
            f"the forward_backward body is not a ForwardBackwardRequest: {error}"
        ) from None
    request = ForwardBackward(
        message.model_id, message.seq_id, message.loss_fn, {}, message.forward_only, []
    )
    # From here on a problem fails the request, not its delivery: its seq_id must still take
    # its turn, or every later request of the model would wait for it.
    try:
        request.loss_fn_config = _config(message)
        request.data = [_datum(i, d) for i, d in enumerate(message.data)]
    except WireError as error:
        request.problem = str(error)
    return request


def _config(message: pb.ForwardBackwardRequest) -> dict[str, float]:
    config = dict(message.loss_fn_config)
    for key, value in message.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise WireError(f"loss_fn_config {key!r}: only numbers are served")
        config[key] = value.number
    return config


def _datum(index: int, datum: pb.Datum) -> TokenDatum:
    tokens: list[int] = []
    for chunk in datum.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise WireError(
                f"datum {index}: only text chunks are served, not {chunk.WhichOneof('chunk')}"
            )
        tokens += np.frombuffer(chunk.encoded_text.tokens, np.int32).tolist()
    # By name: a protobuf map's order varies, and the first misfit is the one named.
    inputs = {name: _vector(index, name, t) for name, t in sorted(datum.loss_fn_inputs.items())}
    for name, values in inputs.items():
        if len(values) != len(tokens):
            raise WireError(
                f"datum {index}: loss_fn_inputs {name!r} has {len(values)} values for "
                f"{len(tokens)} input tokens"
            )
    return TokenDatum(tokens, inputs)


def _vector(index: int, name: str, tensor: pb.Tensor) -> list[float]:
    if tensor.WhichOneof("encoding") != "dense" or len(tensor.shape) > 1:
        raise WireError(f"datum {index}: loss_fn_inputs {name!r} must be a dense 1-D tensor")
    if tensor.dtype not in _NUMPY:
        raise WireError(f"datum {index}: loss_fn_inputs {name!r} has an unserved dtype")
    return np.frombuffer(tensor.dense, _NUMPY[tensor.dtype]).tolist()


def forward_backward_output(
    logprobs: list[list[float]], elementwise: list[list[float]], metrics: dict[str, float]
) -> bytes:
    """A serialized `ForwardBackwardOutput`: each datum's target-token logprobs and per-token
    loss, and `metrics` (keys `name:reduction`, which the SDK combines across chunks by)."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(logprobs))
    record.fields["logprobs"].CopyFrom(_batched(logprobs))
    record.fields["elementwise_loss"].CopyFrom(_batched(elementwise))
    output = pb.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record], metrics=metrics
    )
    return output.SerializeToString()


def _batched(rows: list[list[float]]) -> pb.BatchedTensor:
    arrays = [np.asarray(row, np.float32) for row in rows]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
    return pb.BatchedTensor(
        data=b"".join(a.tobytes() for a in arrays),
        offsets=offsets.tobytes(),
        dtype=pb.DTYPE_FLOAT32,
    )


@dataclass
class Sequence:
    """One sampled sequence."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # ended on a stop token or string; else on max_tokens


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float] | None) -> bytes:
    """A serialized `SampleResponse`. `prompt_logprobs`, when asked for, has one per prompt
    token, NaN at the first (nothing predicts it)."""
    response = pb.SampleResponse(
        sequences=[
            pb.SampledSequence(
                stop_reason=pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH,
                tokens=np.asarray(s.tokens, np.int32).tobytes(),
                logprobs=np.asarray(s.logprobs, np.float32).tobytes(),
            )
            for s in sequences
        ]
    )
    if prompt_logprobs is not None:
        response.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
    return response.SerializeToString()
