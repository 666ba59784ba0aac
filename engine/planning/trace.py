"""Mooncake-format request traces: loading and validation.

A trace is JSON lines, one request per line, sorted by arrival::

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int, ...]}

``hash_ids`` are prefix-chained block ids (512 tokens per block in the Mooncake
release): an equal id means an equal block *and* an equal prefix, so a replay can
count prefix hits without ever seeing a token. The last id covers the partial tail,
hence ``len(hash_ids) == ceil(input_length / block_tokens)``.

A capacity plan built on a malformed trace is silently wrong, so every line is
checked up front and the first fault raises :class:`TraceError` naming the file and
line: an operator fixes the file instead of debugging a hit rate.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import ConfigError

__all__ = [
    "BLOCK_TOKENS",
    "TraceError",
    "TraceRequest",
    "block_token_counts",
    "load_trace",
    "parse_trace",
]

BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in the Mooncake FAST'25 traces."""

_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ConfigError):
    """A trace file is empty or one of its lines is malformed.

    A :class:`~kvstore.errors.ConfigError` (code ``config``): the trace is operator
    input, like a config file. ``line`` is 1-based, or 0 for whole-file faults.
    """

    def __init__(self, source: str, line: int, problem: str) -> None:
        where = f"{source}:{line}" if line else source
        super().__init__(f"{where}: {problem}")
        self.source = source
        self.line = line
        self.problem = problem


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One validated trace request. ``index`` is its position among the requests;
    ``line`` its 1-based line in the source, kept so later errors can point back."""

    index: int
    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def arrival_s(self) -> float:
        """Arrival time in seconds from the trace's clock origin."""
        return self.timestamp_ms / 1000.0


def block_token_counts(
    input_length: int, blocks: int, block_tokens: int = BLOCK_TOKENS
) -> list[int]:
    """Tokens covered by each block: full blocks, then the partial tail.

    The README's hit counting weighs a hit on the tail block by the tokens it holds,
    not by a full block; every token-weighted figure in the replay goes through here.
    """
    counts = [block_tokens] * blocks
    if blocks:
        counts[-1] = input_length - (blocks - 1) * block_tokens
    return counts


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_record(rec: object, block_tokens: int) -> str | None:
    """Return what is wrong with one decoded line, or None when it is valid."""
    if not isinstance(rec, dict):
        return f"expected a JSON object, got {type(rec).__name__}"
    missing = [f for f in _FIELDS if f not in rec]
    if missing:
        return f"missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
    ts, n_in, n_out, ids = (rec[f] for f in _FIELDS)
    if not _is_number(ts) or ts < 0:
        return f"timestamp must be a non-negative number of ms, got {ts!r}"
    if not _is_int(n_in) or n_in <= 0:
        return f"input_length must be a positive integer, got {n_in!r}"
    if not _is_int(n_out) or n_out < 0:
        return f"output_length must be a non-negative integer, got {n_out!r}"
    if not isinstance(ids, list) or not all(_is_int(h) for h in ids):
        return "hash_ids must be a list of integers"
    want = -(-n_in // block_tokens)
    if len(ids) != want:
        return (
            f"hash_ids has {len(ids)} ids but input_length {n_in} needs "
            f"ceil({n_in}/{block_tokens}) = {want}"
        )
    return None


def parse_trace(
    lines: Iterable[str],
    *,
    source: str = "<trace>",
    limit: int | None = None,
    block_tokens: int = BLOCK_TOKENS,
) -> list[TraceRequest]:
    """Validate and decode trace lines; blank lines are skipped but still counted.

    ``limit`` stops after that many requests (a prefix of the trace, still checked
    line by line). Raises :class:`TraceError` on the first bad line, or when no
    request is found at all.
    """
    out: list[TraceRequest] = []
    prev_ts = -math.inf
    prev_line = 0
    for lineno, raw in enumerate(lines, start=1):
        if limit is not None and len(out) >= limit:
            break
        text = raw.strip()
        if not text:
            continue
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(source, lineno, f"not valid JSON ({exc.msg})") from None
        problem = _check_record(rec, block_tokens)
        if problem:
            raise TraceError(source, lineno, problem)
        ts = rec["timestamp"]
        if ts < prev_ts:
            raise TraceError(
                source,
                lineno,
                f"timestamp {ts} ms is earlier than {prev_ts} ms on line {prev_line}: "
                "the trace must be sorted by timestamp",
            )
        prev_ts, prev_line = ts, lineno
        out.append(
            TraceRequest(
                len(out),
                lineno,
                ts,
                rec["input_length"],
                rec["output_length"],
                tuple(rec["hash_ids"]),
            )
        )
    if not out:
        raise TraceError(source, 0, "the trace is empty: no request lines found")
    return out


def load_trace(
    path: str | Path, *, limit: int | None = None, block_tokens: int = BLOCK_TOKENS
) -> list[TraceRequest]:
    """Load and validate a Mooncake-format trace file (see :func:`parse_trace`)."""
    p = Path(path)
    try:
        with p.open(encoding="utf-8") as fh:
            return parse_trace(fh, source=str(p), limit=limit, block_tokens=block_tokens)
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(str(p), 0, f"cannot read the trace ({exc})") from exc
