"""Trace loading: valid lines decode, and every kind of bad line is named by number."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from engine.planning.trace import TraceError, block_token_counts, load_trace, parse_trace
from kvstore.errors import ConfigError

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "conversation_trace.jsonl"


def line(ts: float = 0, n_in: int = 600, n_out: int = 10, ids: list[object] | None = None) -> str:
    ids = ids if ids is not None else list(range(-(-n_in // 512)))
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out,
                       "hash_ids": ids})  # fmt: skip


def test_parse_valid_lines() -> None:
    reqs = parse_trace([line(0, 600, ids=[1, 2]), "", line(5, 512, ids=[1])])
    assert [r.line for r in reqs] == [1, 3]
    assert [r.index for r in reqs] == [0, 1]
    assert reqs[0].hash_ids == (1, 2) and reqs[0].input_length == 600
    assert reqs[1].arrival_s == pytest.approx(0.005)


def test_limit_takes_a_prefix() -> None:
    reqs = parse_trace([line(i) for i in range(10)], limit=3)
    assert len(reqs) == 3


def test_block_token_counts_partial_tail() -> None:
    assert block_token_counts(1100, 3) == [512, 512, 76]
    assert block_token_counts(1024, 2) == [512, 512]


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ('{"timestamp": 1, "input_length": 10, "hash_ids": [1]}', "missing field output_length"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (line(n_in=1100, ids=[1, 2]), "hash_ids has 2 ids but input_length 1100 needs"),
        (line(n_in=0, ids=[]), "input_length must be a positive integer"),
        (line(n_in=600, ids=[1, "x"]), "hash_ids must be a list of integers"),
        (line(ts=-1), "timestamp must be a non-negative"),
        (line(n_out=-2), "output_length must be a non-negative integer"),
    ],
)
def test_bad_line_is_named(bad: str, words: str) -> None:
    with pytest.raises(TraceError) as info:
        parse_trace([line(0), line(1), bad], source="t.jsonl")
    assert info.value.line == 3
    assert str(info.value).startswith("t.jsonl:3: ")
    assert words in str(info.value)


def test_unsorted_timestamps_name_both_lines() -> None:
    with pytest.raises(
        TraceError, match=r"t.jsonl:3: timestamp 5 ms is earlier than 9 ms on line 2"
    ):
        parse_trace([line(1), line(9), line(5)], source="t.jsonl")


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path: Path, content: str) -> None:
    p = tmp_path / "empty.jsonl"
    p.write_text(content)
    with pytest.raises(TraceError, match="empty") as info:
        load_trace(p)
    assert isinstance(info.value, ConfigError)  # one exception tree: callers catch ConfigError


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "nope.jsonl")


def test_load_from_file_names_the_path(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join([line(0), line(1), '{"timestamp": 2}']) + "\n")
    with pytest.raises(TraceError, match=rf"{p}:3: missing fields input_length"):
        load_trace(p)


@pytest.mark.skipif(not TRACE.exists(), reason=f"conversation trace not found at {TRACE}")
def test_conversation_trace_loads() -> None:
    reqs = load_trace(TRACE)
    assert len(reqs) == 12031
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in itertools.pairwise(reqs))
