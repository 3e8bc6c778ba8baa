"""The split-job contract (DeepcoService.SplitRun), both ends of it in one place.

A split plan runs as one job per participant. The device builds each participant's request here
(`job_request`) and the server reads who gathers the last level from it (`gatherer`). Two conventions
live only here:

- *gather*: ``gather_to`` is 0 when the device gathers the bands of the last level (and runs the tail),
  else 1 + the index of the participant that gathers them and runs ``tail_model``;
- *rows*: ``Rows`` carry NCHW tensors, so an output of lower rank (a classifier's ``(1, classes)``) travels
  padded with trailing 1s (`to_rows`) and is cut back to its rank on arrival (`from_rows`); the gathering
  participant returns every output of the model, by name (`named_rows`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from google.protobuf.message import Message

from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire.rows import encode_rows
from deepco.wire.tensors import datatype_of

Interval = tuple[int, int]
# a level's tensors (deepco.planning.scales): name -> {"owned": band, "crop": crop, "window": window per participant}
LevelTables = Mapping[str, Mapping[str, Sequence]]
Part = tuple[Interval, Interval, int]  # one run of a segment: output rows, window, crop
ROWS_RANK = 4  # Rows carry NCHW


def gather_field(tail: int | None) -> int:
    """``gather_to`` for a job whose last level is gathered by participant ``tail`` (None: the device)."""
    return 0 if tail is None else tail + 1


def gatherer(gather_to: int, participants: int) -> int | None:
    """The participant that gathers the last level (None: the device); ValueError when ``gather_to`` names no
    participant of ``participants``."""
    if gather_to == 0:
        return None
    if not 0 < gather_to <= participants:
        raise ValueError(f"gather_to {gather_to} is not 1 + an index of the {participants} peers")
    return gather_to - 1


def to_rows(output: np.ndarray) -> np.ndarray:
    """``output`` as the NCHW tensor a ``Rows`` message carries (trailing 1s up to rank 4)."""
    if output.ndim > ROWS_RANK:
        raise ValueError(f"an output of rank {output.ndim} does not travel as NCHW rows")
    return output.reshape(*output.shape, *([1] * (ROWS_RANK - output.ndim)))


def rows_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The NCHW shape an output of ``shape`` travels as."""
    return (*shape, *([1] * (ROWS_RANK - len(shape))))


def from_rows(array: np.ndarray, rank: int) -> np.ndarray:
    """An output that travelled as NCHW rows, back at its own ``rank``."""
    return array.reshape(array.shape[:rank])


def named_rows(outputs: Mapping[str, np.ndarray], into) -> None:
    """A gathering participant's outputs into ``into`` (``SplitResult.outputs``): each as NCHW rows (`to_rows`)
    under its name, in the model's order, encoded in place. ValueError for an output of rank over 4 (before
    any is added)."""
    rows = {name: to_rows(array) for name, array in outputs.items()}
    for name, array in rows.items():
        encode_rows(array, 0, into=into.add(name=name).rows)


def job_request(job_id: str, index: int, *, image: np.ndarray, **tables) -> dpb.SplitRequest:
    """Participant ``index``'s request of job ``job_id``: its `job_skeleton` (``tables``) with the job id and its
    window of level 0 from ``image``, the whole frame (1xCxHxW); a streamed window (``rest``) carries the rows
    above its rest."""
    request = job_skeleton(index, **tables)
    request.job_id = job_id
    a, b = input_rows(tables["windows"], index, tables.get("rest"))
    encode_rows(image[:, :, a:b, :], a, into=request.input)  # the window's rows copied once, into the request
    return request


def job_skeleton(index: int, *, segment_models: Sequence[str], peers: Sequence[str],
                 bands: Sequence[Sequence[Interval]], windows: Sequence[Sequence[Interval]],
                 crops: Sequence[Sequence[int]], exchange_timeout: float, lookahead: bool,
                 tail: int | None, tail_model: str, tensors: Sequence[LevelTables] = (),
                 parts: Sequence[Sequence[Sequence[Part]]] = (), rest: Interval | None = None) -> dpb.SplitRequest:
    """Participant ``index``'s request without a job id and without its rows: what every frame of a plan sends
    it alike. ``bands``, ``windows`` and ``crops`` are per level (level 0 the image), then per participant;
    ``tail_model`` goes only to the participant that gathers.
    ``tensors``: per level, its tensors' tables when levels have several (a plan across scales: bands and
    windows are then image rows).
    ``parts``: per level and participant, its segment's runs (deepco.planning.overlap); only the participant's
    own travel, the others' lists are left empty.
    ``rest``: the rows of the participant's window that follow the request (`rest_message`), where its window
    is streamed."""
    levels = []
    for j in range(len(bands)):
        level = dpb.SplitLevel(owned=[dpb.RowRange(start=a, stop=b) for a, b in bands[j]])
        if j:
            level.window.extend(dpb.RowRange(start=a, stop=b) for a, b in windows[j])
            level.crop.extend(crops[j])
            if j < len(parts) and any(parts[j]):
                for i in range(len(bands[j])):
                    mine = level.parts.add()
                    for (a, b), (lo, hi), crop in (parts[j][i] if i == index else ()):
                        mine.part.add(rows=dpb.RowRange(start=a, stop=b), window=dpb.RowRange(start=lo, stop=hi),
                                      crop=crop)
        levels.append(level)
    for level, tables in zip(levels, tensors, strict=False):
        for name, t in tables.items():
            level.tensors.add(name=name, owned=[dpb.RowRange(start=a, stop=b) for a, b in t["owned"]],
                              crop=list(t["crop"]), window=[dpb.RowRange(start=a, stop=b) for a, b in t["window"]])
    request = dpb.SplitRequest(segment_models=list(segment_models), server_index=index,
                               peers=list(peers), levels=levels, exchange_timeout_seconds=exchange_timeout,
                               lookahead=lookahead, gather_to=gather_field(tail),
                               tail_model=tail_model if tail == index else "")
    if rest is not None:
        request.input_rest.start, request.input_rest.stop = rest
    return request


def input_rows(windows: Sequence[Sequence[Interval]], index: int, rest: Interval | None = None) -> Interval:
    """The rows of the image participant ``index``'s request carries: its window of level 0, or where the
    window is streamed, the rows above its ``rest``."""
    a, b = windows[0][index]
    return (a, b) if rest is None else (a, rest[0])


def request_bytes(skeleton: bytes, job_id: str, image: np.ndarray, rows: Interval) -> bytes:
    """`job_request` as wire bytes from the participant's serialized `job_skeleton`: the job id and the rows
    [a, b) of ``image`` (1xCxHxW) appended as further occurrences of their fields, which a parser
    merges (protobuf's rule for a message concatenated to another; SplitRequest's ``input`` is a message, so its
    two occurrences merge into one). The rows are copied once, straight from the frame into the bytes gRPC sends,
    where building the message copied them into it, counting its size serialized it, and gRPC serialized it
    again: three copies of a window on a camera's fraction of a core."""
    head = dpb.SplitRequest(job_id=job_id)
    return _with_rows(skeleton, head, head.input, _INPUT, image, rows)


def rest_bytes(job_id: str, index: int, image: np.ndarray, rest: Interval) -> bytes:
    """`rest_message` as wire bytes, its rows copied once from the frame (as `request_bytes`' are)."""
    head = dpb.RowsMessage(job_id=job_id, sender=index, level=0)
    return _with_rows(b"", head, head.rows, _ROWS, image, rest)


def _with_rows(prefix: bytes, head: Message, header: dpb.Rows, field: int, image: np.ndarray, rows: Interval) -> bytes:
    """``prefix``, then ``head`` serialized with ``header`` (its Rows field number ``field``) describing rows
    [a, b) of ``image``, then the rows' data as a second occurrence of that field, which a parser merges into the
    first: one copy of the rows, into the bytes returned."""
    a, b = rows
    if image.ndim != 4 or image.shape[0] != 1:
        raise ValueError(f"split rows are taken from a 1xCxHxW frame, got shape {list(image.shape)}")
    # each channel's rows one run of little-endian bytes, as the protocol's raw contents are (a copy only if not)
    image = np.ascontiguousarray(image, dtype=image.dtype.newbyteorder("<"))
    header.datatype = datatype_of(image.dtype)
    header.shape[:] = (1, image.shape[1], b - a, image.shape[3])
    header.start = a
    planes = [memoryview(image[0, c, a:b, :]).cast("B") for c in range(image.shape[1])]  # one run of rows each
    nbytes = sum(p.nbytes for p in planes)
    data = _key(_ROWS_DATA) + _varint(nbytes)
    framed = _key(field) + _varint(len(data) + nbytes) + data
    return b"".join([prefix, head.SerializeToString(), framed, *planes])


_INPUT = dpb.SplitRequest.DESCRIPTOR.fields_by_name["input"].number
_ROWS = dpb.RowsMessage.DESCRIPTOR.fields_by_name["rows"].number
_ROWS_DATA = dpb.Rows.DESCRIPTOR.fields_by_name["data"].number
_LENGTH_DELIMITED = 2  # protobuf's wire type of bytes and messages


def _varint(n: int) -> bytes:
    """``n`` as a protobuf varint: seven bits a byte, low bits first, the high bit set on all but the last."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(field: int) -> bytes:
    """The key of a length-delimited field: its number and wire type, as a varint."""
    return _varint(field << 3 | _LENGTH_DELIMITED)


def rest_message(job_id: str, index: int, image: np.ndarray, rest: Interval) -> dpb.RowsMessage:
    """The rows ``rest`` of the image that follow participant ``index``'s request of job ``job_id`` (its window
    streamed: SplitRequest.input_rest), as the device sends them on a SplitExchange stream."""
    message = dpb.RowsMessage(job_id=job_id, sender=index, level=0)
    encode_rows(image[:, :, rest[0]:rest[1], :], rest[0], into=message.rows)
    return message
