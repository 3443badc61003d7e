"""Tinker's protobuf payloads <-> gapless records, using the schema the pinned `tinker` SDK ships.

    decode_forward_backward(bytes) -> ForwardBackwardCall (datums as token lists and float tensors)
    encode_forward_backward(logprobs per datum, metrics) -> ForwardBackwardOutput bytes
    encode_sample(sequences, extras) -> SampleResponse bytes

Tokens arrive as int32, `target_tokens` as int64, the other loss inputs as float32, dense or
sparse CSR; all become dense torch tensors here. Guaranteed: a malformed datum (a non-text chunk,
a tensor whose bytes do not fill its shape) raises `WireError` naming the datum and field, which
the service turns into a user error; nothing here touches a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as pb

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class WireError(ValueError):
    """A payload that does not decode into what the call needs (a user error)."""


@dataclass
class DatumIn:
    tokens: list[int]  # model input: the context, one position per target token
    inputs: dict[str, torch.Tensor]  # loss_fn_inputs by name: target_tokens (int64) and float32 tensors


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    datums: list[DatumIn]
    loss_fn: str
    config: dict[str, float]
    forward_only: bool


def _tensor(msg: pb.Tensor, where: str) -> torch.Tensor:
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise WireError(f"{where}: unsupported dtype {msg.dtype} (float32 or int64 expected)")
    shape = tuple(msg.shape)
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        crow, col = np.frombuffer(csr.crow_indices, dtype=np.int64), np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
            raise WireError(f"{where}: sparse CSR tensor with inconsistent indices for shape {shape}")
        return torch.sparse_csr_tensor(
            torch.from_numpy(crow.copy()), torch.from_numpy(col.copy()), torch.from_numpy(values.copy()), size=shape
        ).to_dense()
    flat = np.frombuffer(msg.dense, dtype=dtype)
    if not shape:
        shape = (flat.size,)
    if int(np.prod(shape)) != flat.size:
        raise WireError(f"{where}: {flat.size} values do not fill shape {shape}")
    return torch.from_numpy(flat.reshape(shape).copy())


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 -- any parse failure is a bad request
        raise WireError(f"the forward_backward body is not a ForwardBackwardRequest protobuf: {exc}") from None
    datums = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise WireError(f"datum {i}: only encoded_text chunks are served (got {chunk.WhichOneof('chunk')})")
            tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
        inputs = {name: _tensor(t, f"datum {i} loss_fn_inputs[{name!r}]") for name, t in d.loss_fn_inputs.items()}
        datums.append(DatumIn(tokens, inputs))
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        if v.WhichOneof("value") == "number":
            config[k] = v.number
    return ForwardBackwardCall(msg.model_id, msg.seq_id, datums, msg.loss_fn, config, msg.forward_only)


def encode_forward_backward(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """A `logprobs` float32 field per datum, and the metrics (`name:reduction` keys): one ArrayRecord
    per run of datums whose arrays share a trailing shape ((T,) or top-k (T, K); the SDK reads a
    chunk's `trailing_shape`)."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    arrays = [np.asarray(a, dtype=np.float32) for a in logprobs]
    start = 0
    while start < len(arrays):
        end = start + 1
        while end < len(arrays) and arrays[end].shape[1:] == arrays[start].shape[1:]:
            end += 1
        chunk = arrays[start:end]
        record = out.loss_fn_outputs.add(num_datums=len(chunk))
        field = record.fields["logprobs"]
        field.data = b"".join(a.tobytes() for a in chunk)
        field.offsets = np.concatenate([[0], np.cumsum([a.nbytes for a in chunk])]).astype(np.int64).tobytes()
        field.dtype = pb.DTYPE_FLOAT32
        field.trailing_shape.extend(chunk[0].shape[1:])
        start = end
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    return out.SerializeToString()


@dataclass
class SequenceOut:
    tokens: list[int]
    logprobs: list[float]
    is_length: bool  # finished by max_tokens (else by a stop token or string)


def encode_sample(sequences: list[SequenceOut], extras=None) -> bytes:
    """`extras`: the log-prob options asked for (service/logprobs.py's `SampleExtras`), or None."""
    out = pb.SampleResponse()
    for s in sequences:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_LENGTH if s.is_length else pb.STOP_REASON_STOP
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
    if extras is not None:
        extras.write(out)
    return out.SerializeToString()
