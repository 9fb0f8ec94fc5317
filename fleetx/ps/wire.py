"""The parameter-server wire format: frame layout, message kinds, dtypes, encode and decode.

The byte-level format is specified in ``docs/parameter_server.md``; the constants below are
that specification in code. A frame on the wire is::

    header (32 bytes, little-endian, HEADER)
    nbufs descriptors (16 bytes each, DESCRIPTOR): dtype code, byte count
    meta: meta_len bytes of UTF-8 JSON (an object; the small control fields)
    nbufs raw buffers, back to back, in descriptor order (ids, rows, gradients...)

Nothing on the wire is pickled: the meta block is JSON and the payload is raw little-endian
arrays, so a peer can never make us execute code. Moving frames over sockets (deadlines,
heartbeats, queues) is :mod:`fleetx.ps.transport`'s; this module only turns a
:class:`Message` into bytes and checks the bytes that come back.
"""
from __future__ import annotations

import enum
import json
import struct
from typing import Mapping, Optional, Sequence

import numpy as np

from fleetx.ps.errors import PeerLostError, ProtocolError

__all__ = [
    "WIRE_MAGIC", "WIRE_VERSION", "HEADER", "DESCRIPTOR", "FLAG_REPLY", "FLAG_ERROR",
    "MAX_META_BYTES", "MAX_BUFFERS", "DEFAULT_MAX_FRAME_BYTES", "Kind", "DTYPES", "DTYPE_CODES",
    "Message", "encode_frame", "parse_header", "read_descriptors",
]

WIRE_MAGIC = b"FXPS"
WIRE_VERSION = 1
#: magic(4s) version(B) kind(B) flags(H) request id(Q) nbufs(I) meta_len(I) payload bytes(Q)
HEADER = struct.Struct("<4sBBHQIIQ")
#: dtype code(B), 7 pad bytes, byte count(Q)
DESCRIPTOR = struct.Struct("<B7xQ")
FLAG_REPLY = 0x1  # the frame answers the request with the same id
FLAG_ERROR = 0x2  # a reply whose meta carries {"error": class name, "message": text}
MAX_META_BYTES = 1 << 20  # a larger meta block means a corrupt or hostile frame
MAX_BUFFERS = 1 << 16
#: Largest frame (payload bytes) a peer may announce; checked on the header, before anything is
#: allocated. 1 GiB holds a dense table of 256 M float32 values per server in one INIT or PUSH,
#: far beyond a CTR model's dense part, while a corrupt header (up to 16 EiB) is refused at once.
DEFAULT_MAX_FRAME_BYTES = 1 << 30

assert HEADER.size == 32 and DESCRIPTOR.size == 16


class Kind(enum.IntEnum):
    """Message kinds. Requests carry the kind; the reply repeats it with FLAG_REPLY set."""

    HEARTBEAT = 1  # no reply; any frame proves liveness, this one is sent when idle
    HELLO = 2      # worker -> server: {"rank", "pid", "host", "fingerprint"}
    BYE = 3        # worker -> server: the worker stops cleanly
    PULL = 4       # read rows of sparse tables and/or dense slices
    PUSH = 5       # gradients (or GEO deltas) for sparse tables and/or dense slices
    INIT = 6       # worker 0 assigns initial values (ignored where the server loaded a save)
    SET_LR = 7     # change the learning rate of one or every table's rule
    BARRIER = 8    # answered once every live worker has entered the same barrier
    SAVE = 9       # each server writes its shards to a folder
    STATS = 10     # rows, bytes and request counts of a server
    SHRINK = 20    # end of a pass: decay show/click, delete rows unseen or scoring too low
    # 30-39: inference and heter workers (docs/ps_inference.md, docs/heter.md)
    INFER = 30           # worker -> server: it turned to inference; its writes are refused
    HETER_HELLO = 31     # trainer -> heter worker: {"rank", "pid", "host", "fingerprint", "mode"}
    HETER_FORWARD = 32   # trainer -> heter worker: a section's inputs; reply: its outputs
    HETER_BACKWARD = 33  # trainer -> heter worker: the outputs' gradients; reply: the inputs'
    HETER_STEP = 34      # trainer -> heter worker: the trainer's optimizer step is done
    HETER_BYE = 35       # trainer -> heter worker: the trainer stops or turns to inference
    HETER_FLUSH = 36     # trainer -> heter worker: answered once its queued steps reached the servers


#: wire dtype code -> numpy dtype string (always little-endian)
DTYPES: Mapping[int, str] = {1: "<i8", 2: "<f4", 3: "<f8", 4: "|u1", 5: "<i4"}
DTYPE_CODES: Mapping[str, int] = {v: k for k, v in DTYPES.items()}


class Message:
    """One frame: a kind, a request id, flags, a small JSON-able ``meta`` dict and raw arrays."""

    __slots__ = ("kind", "req_id", "flags", "meta", "bufs")

    def __init__(self, kind: int, req_id: int = 0, meta: Optional[dict] = None,
                 bufs: Sequence[np.ndarray] = (), flags: int = 0) -> None:
        self.kind, self.req_id, self.flags = Kind(kind), req_id, flags
        self.meta = meta if meta is not None else {}
        self.bufs = list(bufs)

    @property
    def is_reply(self) -> bool:
        return bool(self.flags & FLAG_REPLY)

    @property
    def is_error(self) -> bool:
        return bool(self.flags & FLAG_ERROR)

    def reply(self, meta: Optional[dict] = None, bufs: Sequence[np.ndarray] = ()) -> "Message":
        return Message(self.kind, self.req_id, meta, bufs, FLAG_REPLY)

    def error_reply(self, exc: BaseException) -> "Message":
        meta = {"error": type(exc).__name__, "message": str(exc)}
        if isinstance(exc, PeerLostError):
            meta.update(peer=exc.peer, reason=exc.reason)
        return Message(self.kind, self.req_id, meta, (), FLAG_REPLY | FLAG_ERROR)

    def __repr__(self) -> str:
        return (f"Message({self.kind.name}, req={self.req_id}, flags={self.flags}, "
                f"meta={self.meta}, bufs={[b.shape for b in self.bufs]})")


def encode_frame(msg: Message, max_frame_bytes: int) -> list:
    """The frame as a list of byte views: header+descriptors+meta, then every buffer.

    Raises:
        ProtocolError: a dtype that cannot travel, or a frame larger than the peer accepts.
    """
    meta = json.dumps(msg.meta, separators=(",", ":")).encode()
    arrays = [np.ascontiguousarray(b) for b in msg.bufs]
    total = sum(a.nbytes for a in arrays)
    if total > max_frame_bytes:
        raise ProtocolError(f"a {msg.kind.name} frame of {total} bytes exceeds the limit of "
                            f"{max_frame_bytes} bytes (FLEETX_PS_MAX_FRAME_MB); send less at "
                            "once or raise the limit on every process")
    head = [HEADER.pack(WIRE_MAGIC, WIRE_VERSION, msg.kind, msg.flags, msg.req_id, len(arrays),
                        len(meta), total)]
    for a in arrays:
        code = DTYPE_CODES.get(a.dtype.str)
        if code is None:
            raise ProtocolError(f"dtype {a.dtype} cannot travel; "
                                f"use one of {list(DTYPES.values())}")
        head.append(DESCRIPTOR.pack(code, a.nbytes))
    head.append(meta)
    return [b"".join(head)] + [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays if a.nbytes]


def parse_header(head, max_frame_bytes: int) -> tuple:
    """``(kind, flags, req_id, nbufs, meta_len, total)`` of a frame's 32-byte header.

    Raises:
        ProtocolError: another magic or wire version, too many buffers or meta bytes, or a
            payload above ``max_frame_bytes`` (checked before anything is allocated).
    """
    magic, version, kind, flags, req_id, nbufs, meta_len, total = HEADER.unpack(head)
    if magic != WIRE_MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (not a fleetx.ps peer?)")
    if version != WIRE_VERSION:
        raise ProtocolError(f"wire version {version}, expected {WIRE_VERSION}")
    if nbufs > MAX_BUFFERS or meta_len > MAX_META_BYTES:
        raise ProtocolError(f"frame too large: {nbufs} buffers, {meta_len} meta bytes")
    if total > max_frame_bytes:
        raise ProtocolError(f"a frame announces {total} bytes, more than the limit of "
                            f"{max_frame_bytes} (FLEETX_PS_MAX_FRAME_MB)")
    return kind, flags, req_id, nbufs, meta_len, total


def read_descriptors(rest, nbufs: int, total: int) -> list:
    """``[(dtype, nbytes)]`` of the ``nbufs`` descriptors at the start of ``rest``.

    Raises:
        ProtocolError: an unknown dtype code, a size that is not a whole number of items, or
            sizes that do not add up to the header's ``total``.
    """
    descs = []
    for i in range(nbufs):
        code, nbytes = DESCRIPTOR.unpack_from(rest, i * DESCRIPTOR.size)
        dtype = DTYPES.get(code)
        if dtype is None or nbytes % np.dtype(dtype).itemsize:
            raise ProtocolError(f"buffer {i}: bad dtype code {code} or size {nbytes}")
        descs.append((np.dtype(dtype), nbytes))
    if sum(n for _, n in descs) != total:
        raise ProtocolError("buffer sizes do not add up to the header's payload size")
    return descs
