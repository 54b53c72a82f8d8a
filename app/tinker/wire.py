"""The Tinker SDK's protobuf bodies, to and from the JSON stored on futures.

The SDK (tinker 0.38) sends `forward_backward` (and `forward`, its `forward_only` flag) as a
`tinker.proto.tinker_public_pb2.ForwardBackwardRequest`, zstd-compressed when the server's client
config says `proto_compress_fwdbwd` (tinker/resources/training.py), and asks for
`ForwardBackwardOutput` and `SampleResponse` results as protobuf (`Accept: application/x-protobuf`;
tinker/proto/response_conv.py decodes them; JSON is refused for those two).  This module uses the
installed SDK's own message classes and pydantic types to decode and encode; the stored forms are:

payload of forward / forward_backward: `tinker.types.ForwardBackwardInput.model_dump(mode="json")`,
    {"data": [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": [int]}]},
               "loss_fn_inputs": {name: {"data": [...], "dtype": "float32"|"int64", "shape": [int]}}}],
     "loss_fn": str, "loss_fn_config": {str: float|str} | None}
result of forward / forward_backward (what the trainer writes):
    {"loss_fn_output_type": "ArrayRecord", "metrics": {str: float},
     "loss_fn_outputs": [{name: {"data": [...], "dtype": "float32"|"int64", "shape": [int]}}]}
    (one dict per datum, every datum with the same field names and trailing shape)
result of sample (what the sampler writes):
    {"sequences": [{"stop_reason": "stop"|"length", "tokens": [int], "logprobs": [float] | None}],
     "prompt_logprobs": [float | None] | None, "prompt_cache_hit_tokens": int}

Errors: `WireError` (a ValueError) says what is malformed; the service answers it with a 400.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import zstandard

PROTO_CONTENT_TYPE = "application/x-protobuf"


class WireError(ValueError):
    """A body that is not the SDK's wire format (bad protobuf, bad zstd, unsupported chunk)."""


def _pb():
    from tinker.proto import tinker_public_pb2  # imports torch when installed: only where a proto is read

    return tinker_public_pb2


_DTYPES = {"float32": np.float32, "int64": np.int64}


def decompress(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """`body` as sent, zstd-decoded when `Content-Encoding: zstd`; at most `max_bytes` after decoding.
    Raises `WireError` for another encoding, a broken frame or a body over `max_bytes`."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        out = body
    elif encoding == "zstd":
        try:
            with zstandard.ZstdDecompressor().stream_reader(body) as reader:
                out = reader.read(max_bytes + 1)
        except zstandard.ZstdError as exc:
            raise WireError(f"the body is not a valid zstd frame: {exc}") from None
    else:
        raise WireError(f"Content-Encoding {content_encoding!r} is not supported (identity or zstd)")
    if len(out) > max_bytes:
        raise WireError(f"the body is over this key's limit of {max_bytes} bytes")
    return out


def _tensor_json(msg: Any) -> dict[str, Any]:
    pb = _pb()
    names = {pb.DTYPE_FLOAT32: "float32", pb.DTYPE_INT64: "int64"}
    if msg.dtype not in names:
        raise WireError(f"tensor dtype {msg.dtype} is not float32 or int64")
    dtype = names[msg.dtype]
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        return {"data": np.frombuffer(csr.values, dtype=_DTYPES[dtype]).tolist(), "dtype": dtype, "shape": shape,
                "sparse_crow_indices": np.frombuffer(csr.crow_indices, dtype=np.int64).tolist(),
                "sparse_col_indices": np.frombuffer(csr.col_indices, dtype=np.int64).tolist()}
    item = np.dtype(_DTYPES[dtype]).itemsize
    if len(msg.dense) % item:
        raise WireError(f"a {dtype} tensor of {len(msg.dense)} bytes (not a multiple of {item})")
    data = np.frombuffer(msg.dense, dtype=_DTYPES[dtype])
    if shape and math.prod(shape) != data.size:
        raise WireError(f"a tensor of shape {shape} holds {data.size} values")
    return {"data": data.tolist(), "dtype": dtype, "shape": shape or [int(data.size)]}


def decode_forward_backward(body: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """(request fields, payload) of a protobuf `ForwardBackwardRequest`.

    Request fields: {"model_id": str, "seq_id": int, "forward_only": bool}; the payload is the
    `ForwardBackwardInput` JSON of the module docstring, checked by the SDK's own pydantic type.
    Raises `WireError` for a body that does not parse, a non-text chunk, or a malformed tensor.
    """
    from google.protobuf.message import DecodeError

    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise WireError(f"the body is not a ForwardBackwardRequest protobuf: {exc}") from None
    data = []
    for i, datum in enumerate(msg.data):
        chunks = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise WireError(f"data[{i}]: a {kind or 'empty'} chunk; this server trains text models only "
                                "(encoded_text chunks)")
            tokens = chunk.encoded_text.tokens
            if len(tokens) % 4:
                raise WireError(f"data[{i}]: encoded_text tokens of {len(tokens)} bytes (int32 each)")
            chunks.append({"type": "encoded_text", "tokens": np.frombuffer(tokens, dtype=np.int32).tolist()})
        inputs = {name: _tensor_json(t) for name, t in datum.loss_fn_inputs.items()}
        data.append({"model_input": {"chunks": chunks}, "loss_fn_inputs": inputs})
    config: dict[str, Any] | None = None
    if msg.loss_fn_config_v2:  # the SDK writes both maps; v2 also carries strings
        config = {k: (v.text if v.WhichOneof("value") == "text" else v.number)
                  for k, v in msg.loss_fn_config_v2.items()}
    elif msg.loss_fn_config:
        config = dict(msg.loss_fn_config)
    payload = validate_input({"data": data, "loss_fn": msg.loss_fn, "loss_fn_config": config})
    return {"model_id": msg.model_id, "seq_id": msg.seq_id, "forward_only": msg.forward_only}, payload


def validate_input(raw: Any) -> dict[str, Any]:
    """`raw` checked as the SDK's ForwardBackwardInput and dumped as its JSON.  `tinker.types`
    exports that type as a dataclass; its pydantic twin (the one the SDK's own JSON conversion
    validates with, tinker/lib/_pydantic_conv.py) checks it here.  Raises `WireError`."""
    from pydantic import ValidationError
    from tinker.types._pydantic_types.forward_backward_input import ForwardBackwardInput

    try:
        return ForwardBackwardInput.model_validate(raw).model_dump(mode="json")
    except ValidationError as exc:
        raise WireError(f"the request is not a ForwardBackwardInput: {_first_error(exc)}") from None


def _first_error(exc: Any) -> str:
    err = exc.errors()[0]
    return f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg')}"


def encode_forward_backward_output(result: dict[str, Any]) -> bytes:
    """The protobuf `ForwardBackwardOutput` of a stored forward/forward_backward `result` (one
    ArrayRecord: each field's per-datum arrays concatenated, byte offsets per datum, as
    tinker/proto/response_conv.py reads it).  Raises `WireError` for a result of another shape."""
    pb = _pb()
    out = pb.ForwardBackwardOutput()
    out.loss_fn_output_type = str(result.get("loss_fn_output_type") or "ArrayRecord")
    for key, value in (result.get("metrics") or {}).items():
        out.metrics[key] = float(value)
    datums = result.get("loss_fn_outputs") or []
    if datums:
        record = out.loss_fn_outputs.add()
        record.type_tag = out.loss_fn_output_type
        record.num_datums = len(datums)
        for name in datums[0]:
            dtype = datums[0][name]["dtype"]
            if dtype not in _DTYPES:
                raise WireError(f"loss_fn_outputs field {name!r}: dtype {dtype!r}")
            trailing = list(datums[0][name].get("shape") or [])[1:]
            arrays = []
            for i, datum in enumerate(datums):
                if name not in datum:
                    raise WireError(f"loss_fn_outputs[{i}] has no field {name!r}")
                arrays.append(np.asarray(datum[name]["data"], dtype=_DTYPES[dtype]).ravel())
            sizes = [a.nbytes for a in arrays]
            bt = record.fields[name]
            bt.dtype = pb.DTYPE_FLOAT32 if dtype == "float32" else pb.DTYPE_INT64
            bt.data = b"".join(a.tobytes() for a in arrays)
            bt.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tobytes()
            bt.trailing_shape.extend(trailing)
    return out.SerializeToString()


def encode_sample_response(result: dict[str, Any]) -> bytes:
    """The protobuf `SampleResponse` of a stored sample `result` (module docstring).  A prompt
    logprob of None (the first prompt token) is sent as NaN, as the SDK documents."""
    pb = _pb()
    out = pb.SampleResponse()
    stops = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    for seq in result.get("sequences") or []:
        if seq.get("stop_reason") not in stops:
            raise WireError(f"sequence stop_reason {seq.get('stop_reason')!r} is not 'stop' or 'length'")
        s = out.sequences.add()
        s.stop_reason = stops[seq["stop_reason"]]
        s.tokens = np.asarray(seq.get("tokens") or [], dtype=np.int32).tobytes()
        if seq.get("logprobs") is not None:
            s.logprobs = np.asarray(seq["logprobs"], dtype=np.float32).tobytes()
    prompt = result.get("prompt_logprobs")
    if prompt is not None:
        out.prompt_logprobs = np.asarray([math.nan if v is None else v for v in prompt], dtype=np.float32).tobytes()
    out.prompt_cache_hit_tokens = int(result.get("prompt_cache_hit_tokens") or 0)
    return out.SerializeToString()
