"""What every frame handler of the data socket shares: the connection it serves,
decoding a request's metadata and answering a request that failed as a whole."""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

from google.protobuf.message import DecodeError, Message

from kvstore._proto import store_pb2 as pb
from kvstore.errors import KVStoreError
from kvstore.server.gateway import Gateway
from kvstore.tenants import Principal
from kvstore.wire.codec import status_of
from kvstore.wire.frames import FrameSocket, Op, ProtocolError
from kvstore.wire.ucx import UcxFrames

__all__ = ["Connection", "parse", "put_result", "send_error"]


class Connection(Protocol):
    """The authenticated connection a frame handler serves (session.py's Session)."""

    gw: Gateway
    fs: FrameSocket | UcxFrames
    id: int  # the connection's id: the owner of the leases granted on it
    path: str  # where its payloads travel: tcp, or ucx once moved
    copying_s: float  # how long its client needs before its next request

    @property
    def principal(self) -> Principal: ...


def parse(cls: type[Message], meta: bytes) -> Any:
    """``meta`` decoded as a ``cls``; ProtocolError (the stream is lost) when it is not."""
    msg = cls()
    try:
        msg.ParseFromString(meta)
    except DecodeError as exc:
        raise ProtocolError(f"undecodable {cls.__name__} metadata: {exc}") from None
    return msg


def send_error(fs: FrameSocket | UcxFrames, exc: KVStoreError) -> None:
    """Answer with an ERROR frame, if the connection still takes one."""
    with contextlib.suppress(KVStoreError):
        fs.send(Op.ERROR, status_of(exc).SerializeToString())


def put_result(r: bool | KVStoreError, out: pb.PutResult) -> None:
    """One write item's result into its reply slot."""
    if isinstance(r, KVStoreError):
        out.error.CopyFrom(status_of(r))
    else:
        out.stored = r
