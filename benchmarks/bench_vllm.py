"""vLLM with the kvstore connector: TTFT of a long prompt, and load time per block.

Questions answered, each with its anchor measured in the same run:
- TTFT of a long prompt served from a store hit vs recomputed by the same vLLM build
  with no connector (anchor). Also shown: TTFT of the first, missing request through
  the connector (compute + save), i.e. what a producer pays.
- Load time per block (a 32-token block of every layer, copied into vLLM's paged KV)
  through kvstore (``kvstore serve``, same host: shared memory) vs vLLM's own example
  connector (``ExampleConnector``: safetensors files per layer on local disk), timed
  inside each engine around ``start_load_kv``. Save time per block likewise.

The model is SmolLM2-135M's geometry (30 layers, 3 KV heads, head dim 64) with random
weights, bf16, so prefill time is realistic for its size without downloading anything.
Each of ``--runs`` rounds takes a fresh prompt: the anchor computes it, each connector
computes and saves it (a miss), then ``--hits`` times each connector drops vLLM's local
prefix cache and serves it again from its store, the two interleaved so that both see
the same load on this shared machine. Reported: medians (TTFT per request, load and
save time per block per call). Runs in .venv-vllm (``make bench-vllm``):

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--runs 3] [--hits 3] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)

from engine.vllm_connector import KVStoreConnector, KVStoreConnectorMetadata

MODULE = "benchmarks.bench_vllm"


class Timings:
    """Per call ``(seconds, blocks)`` of loads and saves, read through the ``stats`` op."""

    def __init__(self) -> None:
        self.loads: list[tuple[float, int]] = []
        self.saves: list[tuple[float, int]] = []
        self.phases: dict[str, float] = {}  # total seconds per step of a copy, where known

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def _timed(obj: Any, name: str, phases: dict[str, float]) -> None:
    """Wrap ``obj.name`` so the seconds spent in it add up in ``phases[name]``."""
    fn = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0

    setattr(obj, name, wrapper)


class TimedKVStoreConnector(KVStoreConnector):
    """KVStoreConnector with its loads and saves timed, and their phases."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timings = Timings()
        self.phases = self.timings.phases
        for name in ("get_into", "put"):
            _timed(self.store, name, self.phases)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        assert self._paged is not None
        for name in ("gather", "scatter"):
            _timed(self._paged, name, self.phases)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        before = self.stats.loaded_blocks
        t0 = time.perf_counter()
        super().start_load_kv(forward_context, **kwargs)
        if meta.loads:
            self.timings.loads.append((time.perf_counter() - t0, self.stats.loaded_blocks - before))

    def wait_for_save(self) -> None:
        before = self.stats.saved_blocks
        t0 = time.perf_counter()
        super().wait_for_save()
        if self.stats.saved_blocks > before:
            self.timings.saves.append((time.perf_counter() - t0, self.stats.saved_blocks - before))


class TimedExampleConnector(ExampleConnector):
    """vLLM's ExampleConnector with its loads and saves timed (it saves per layer)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timings = Timings()
        self._save_s = 0.0  # this step's save_kv_layer time, over all layers

    def _blocks(self, is_store: bool) -> int:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleConnectorMetadata)
        tokens = sum(len(r.slot_mapping) for r in meta.requests if r.is_store == is_store)
        return tokens // self._block_size

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        super().start_load_kv(forward_context, **kwargs)
        if n := self._blocks(is_store=False):
            self.timings.loads.append((time.perf_counter() - t0, n))

    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        super().save_kv_layer(*args, **kwargs)
        if self._blocks(is_store=True):
            self._save_s += time.perf_counter() - t0

    def wait_for_save(self) -> None:
        super().wait_for_save()
        if n := self._blocks(is_store=True):
            self.timings.saves.append((self._save_s, n))
        self._save_s = 0.0


def _engines(root: Path, store_address: str, token: str) -> dict[str, Any]:
    from tests.support.vllm_fixtures import SMOL, EngineProcess, EngineSpec, write_tiny_llama

    model = str(write_tiny_llama(root / "smol", save_dtype="bfloat16", **SMOL))
    common: dict[str, Any] = dict(model=model, dtype="bfloat16", module_path=MODULE)
    specs = {
        "anchor": EngineSpec(**common),
        "kvstore": EngineSpec(
            **common, role="kv_both", connector="TimedKVStoreConnector", policy="recompute",
            extra={"endpoint": store_address, "token": token, "model_id": "smol-random"},
        ),
        "example": EngineSpec(
            **common, role="kv_both", connector="TimedExampleConnector",
            extra={"shared_storage_path": str(root / "example-files")},
        ),
    }  # fmt: skip
    engines = {n: EngineProcess(s, root, n, hold=True) for n, s in specs.items()}
    engines["anchor"].wait_ready()  # fills vLLM's model-info cache for the other two
    for e in engines.values():
        e.wait_ready()
    return engines


def _ttft(engine: Any, p: list[int]) -> tuple[float, int, list[int]]:
    out = engine.generate([p], 1)[0]
    return float(out["wall_s"]), int(out["cached"]), list(out["tokens"])


def run(runs: int, tokens: int, hits: int) -> dict[str, Any]:
    """Both engines' numbers, in a temporary directory removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        return _run_in(Path(tmp), runs, tokens, hits)


def _run_in(root: Path, runs: int, tokens: int, hits: int) -> dict[str, Any]:
    from tests.support.server_process import ALPHA, ServerProcess, base_flags

    (root / "store").mkdir()
    flags = {**base_flags(root / "store"), "dram_bytes": "2GiB"}
    store = ServerProcess(root / "store", flags).start()
    engines: dict[str, Any] = {}
    rows: dict[str, list[float]] = {k: [] for k in ("anchor", "miss", "hit", "ex_miss", "ex_hit")}
    cached = {"hit": 0, "ex_hit": 0}
    try:
        engines = _engines(root, store.address, ALPHA.token)
        warm = [random.Random(-1).randrange(4, 8192) for _ in range(tokens)]
        for e in engines.values():  # first-call costs (allocator, kernels) out of the rounds
            e.generate([warm], 1)
        pairs = (("kvstore", "miss", "hit"), ("example", "ex_miss", "ex_hit"))
        for r in range(runs):
            p = [random.Random(r).randrange(4, 8192) for _ in range(tokens)]
            t, _, ref = _ttft(engines["anchor"], p)
            rows["anchor"].append(t)
            for name, miss, _ in pairs:
                t, _, out = _ttft(engines[name], p)
                rows[miss].append(t)
                assert out == ref, f"{name}: tokens differ from the anchor"
            for _ in range(hits):  # interleaved, so both see the same machine load
                for name, _, hit in pairs:
                    engines[name].reset()
                    t, cached[hit], out = _ttft(engines[name], p)
                    rows[hit].append(t)
                    assert out == ref, f"{name}: tokens differ from the anchor"
        stats = {n: engines[n].stats()["worker"] for n in ("kvstore", "example")}
    finally:
        for e in engines.values():
            e.quit()
        for e in engines.values():
            e.close()
        store.stop()

    def per_block_ms(calls: list[tuple[float, int]]) -> float:
        return 1e3 * statistics.median(sec / n for sec, n in calls if n) if calls else 0.0

    per_block = {}
    for name, st in stats.items():
        loaded = sum(n for _, n in st["loads"])
        saved = sum(n for _, n in st["saves"])
        per_block[name] = {
            "load_ms": per_block_ms(st["loads"]),
            "save_ms": per_block_ms(st["saves"]),
            "load_calls": len(st["loads"]),
            "phases_mean_ms": {
                k: 1e3 * v / max(1, loaded if k in ("get_into", "scatter") else saved)
                for k, v in st["phases"].items()
            },
        }
    return {"tokens": tokens, "runs": runs, "hits_per_run": hits,
            "ttft_s": {k: statistics.median(v) for k, v in rows.items()},
            "cached_tokens": cached, "per_block": per_block,
            "block_bytes": 30 * 2 * 3 * 32 * 64 * 2}  # fmt: skip


def _print(res: dict[str, Any]) -> None:
    t, pb = res["ttft_s"], res["per_block"]
    kib = res["block_bytes"] / 1024
    print(f"vLLM {res['tokens']}-token prompt, SmolLM2-135M geometry (random bf16), CPU; "
          f"medians of {res['runs']} runs ({res['hits_per_run']} hits each, interleaved); "
          f"block = 32 tokens x 30 layers = {kib:.0f} KiB")  # fmt: skip
    print(f"{'TTFT':44} {'seconds':>9} {'vs anchor':>10}")
    lines = [
        ("anchor: recompute (no connector)", t["anchor"]),
        (f"kvstore hit ({res['cached_tokens']['hit']} tokens loaded)", t["hit"]),
        ("kvstore miss (compute + save)", t["miss"]),
        (f"example connector hit ({res['cached_tokens']['ex_hit']} tokens)", t["ex_hit"]),
        ("example connector miss (compute + save)", t["ex_miss"]),
    ]
    for label, v in lines:
        print(f"{label:44} {v:9.3f} {t['anchor'] / v:9.2f}x")
    print(f"{'per block':44} {'load ms':>9} {'save ms':>10}")
    for name, label in (("example", "anchor: vLLM ExampleConnector (files)"),
                        ("kvstore", "kvstore (shared memory)")):  # fmt: skip
        print(f"{label:44} {pb[name]['load_ms']:9.3f} {pb[name]['save_ms']:10.3f}")
    phases = ", ".join(f"{k} {v:.3f}" for k, v in pb["kvstore"]["phases_mean_ms"].items())
    print(f"kvstore steps, mean ms per block: {phases}")
    load = pb["kvstore"]["load_ms"] / max(pb["example"]["load_ms"], 1e-9)
    save = pb["kvstore"]["save_ms"] / max(pb["example"]["save_ms"], 1e-9)
    print(f"kvstore / example connector, time per block: load {load:.2f}x, save {save:.2f}x "
          "(below 1: kvstore faster)")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hits", type=int, default=3, help="store hits per run and connector")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = run(args.runs, args.tokens, args.hits)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        _print(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
