"""The router pairs prefill and decode workers by KV codec (engine/serving/pairing.py
through placement.py's Placer): a split request's two workers always store the same
codec, a request only mismatched workers could serve is a CodecMismatch naming them,
and a worker record's codec agrees with its namespace's layout."""

from __future__ import annotations

import logging

import pytest

from engine.planning.scheduler import Refusal
from engine.registry import WorkerLoad, WorkerRecord
from engine.serving.pairing import CodecMismatch, UnpairedLog, describe_codecs, unpaired
from engine.serving.placement import Placer, PrefixView, Route
from kvstore.errors import DirectoryError

LAYOUT = "bfloat16:L2:H2:D16:B16:R0"
LONG = list(range(1, 601))  # past the short-prompt cut: a split request
SHORT = list(range(1, 41))


def worker(wid: str, role: str, codec: str = "none", running: int = 0) -> WorkerRecord:
    layout = LAYOUT if codec == "none" else f"{LAYOUT}:C{codec}"
    return WorkerRecord(
        worker_id=wid,
        role=role,
        model="tiny",
        address=f"http://127.0.0.1/{wid}",
        namespace={"model": "tiny", "layout": layout, "tenant": "default"},
        store_node="n0",
        kv_codec=codec,
        load=WorkerLoad(running=running, free_kv_tokens=8192, kv_capacity_tokens=8192),
    )


def place(workers: list[WorkerRecord], ids: list[int] = LONG) -> Route | Refusal:
    return Placer(PrefixView(None)).place(workers, ids, 8)


def test_a_split_request_pairs_workers_of_one_codec() -> None:
    # d0 (none) is idle and sorts first; d1 (int8) is busier: only d1 can read p0's KV
    ws = [worker("p0", "prefill", "int8"), worker("d0", "decode")]
    ws.append(worker("d1", "decode", "int8", running=3))
    for _ in range(3):
        route = place(ws)
        assert isinstance(route, Route), route
        assert route.prefill is not None and route.prefill.worker_id == "p0"
        assert route.decode.worker_id == "d1"


def test_two_pools_each_pair_within_themselves() -> None:
    ws = [
        worker("p0", "prefill", "int8"),
        worker("d0", "decode", "int8"),
        worker("p1", "prefill"),
        worker("d1", "decode"),
    ]
    seen = set()
    for busy in ("p0", "p1"):  # load one pool's prefill worker: the other pool wins
        placer = Placer(PrefixView(None))
        placer.out.add(busy, prefill_s=60.0)
        route = placer.place(ws, LONG, 8)
        assert isinstance(route, Route) and route.prefill is not None
        assert route.prefill.kv_codec == route.decode.kv_codec
        seen.add(route.prefill.worker_id)
    assert seen == {"p0", "p1"}


def test_mismatched_workers_refuse_a_long_prompt_and_name_the_codecs() -> None:
    ws = [worker("p0", "prefill", "int8"), worker("d0", "decode", "none")]
    got = place(ws)
    assert isinstance(got, CodecMismatch)
    assert "p0 (int8)" in got.reason and "d0 (none)" in got.reason
    # a short prompt needs no handoff: the decode worker serves it whole
    short = place(ws, SHORT)
    assert isinstance(short, Route) and short.prefill is None and short.decode.worker_id == "d0"


def test_decode_workers_alone_serve_long_prompts_whatever_their_codec() -> None:
    route = place([worker("d0", "decode", "int8"), worker("d1", "decode", "fp8", 2)])
    assert isinstance(route, Route) and route.prefill is None
    assert route.decode.worker_id == "d0"


def test_an_overload_is_still_a_429_refusal_not_a_mismatch() -> None:
    ws = [worker("p0", "prefill", "int8"), worker("d0", "decode", "int8")]
    placer = Placer(PrefixView(None), slo_s=0.001)
    placer.out.add("p0", prefill_s=60.0)
    got = placer.place(ws, LONG, 8)
    assert isinstance(got, Refusal) and not isinstance(got, CodecMismatch)


def test_describe_and_unpaired() -> None:
    ws = [worker("p0", "prefill", "int8"), worker("d0", "decode", "int8"), worker("d1", "decode")]
    assert [w.worker_id for w in unpaired(ws)] == ["d1"]
    assert describe_codecs(ws) == {
        "kv_codec": "mixed",
        "kv_codecs": {"int8": ["d0", "p0"], "none": ["d1"]},
        "unpaired": ["d1"],
    }
    assert describe_codecs(ws[:2])["kv_codec"] == "int8"
    assert unpaired([worker("d0", "decode"), worker("d1", "decode", "int8")]) == []


def test_unpaired_workers_are_logged_once_per_registration(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = UnpairedLog()
    ws = [worker("p0", "prefill", "int8"), worker("d0", "decode", "none")]
    with caplog.at_level(logging.WARNING, logger="engine.serving.pairing"):
        log.check(ws)
        log.check(ws)  # a load update: nothing new to say
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert any("p0" in m and "int8" in m for m in lines)
    assert any("d0" in m and "codec none" in m for m in lines)


def test_a_record_whose_codec_disagrees_with_its_layout_is_malformed() -> None:
    good = worker("p0", "prefill", "int8")
    assert WorkerRecord.from_json(good.to_json()) == good
    bad = good.to_json().replace(b'"kv_codec":"int8"', b'"kv_codec":"none"')
    with pytest.raises(DirectoryError, match="malformed"):
        WorkerRecord.from_json(bad)
    old = worker("p1", "prefill").to_json().replace(b',"kv_codec":"none"', b"")
    assert WorkerRecord.from_json(old).kv_codec == "none"  # a record from before the field
    with pytest.raises(DirectoryError):
        WorkerRecord.from_json(good.to_json().replace(b'"kv_codec":"int8"', b'"kv_codec":"Int8"'))
