"""vLLM with the kvstore connector: TTFT with layer-wise loads, whole-block loads and
recompute, the transfer hidden behind compute, and load time per block.

Questions answered, each with its anchor measured in the same run:
- TTFT of a long prompt whose head (75% by default) is in the store, served by a
  consumer loading layer by layer beside the forward (the connector's default), by one
  loading whole blocks before it (``layerwise: false``), and recomputed by the same vLLM
  build with no connector (anchor).
- What a saver pays for the head's miss: its TTFT saving whole blocks after the forward
  and saving layer by layer beside it (``layerwise_save``), against the head's compute
  alone; the share of the save hidden is (whole-save TTFT - layer-wise TTFT) / the
  whole-block save time, timed inside the engine around ``wait_for_save``.
- The share of the transfer hidden behind compute: (whole-block TTFT - layer-wise
  TTFT) / the whole-block load time of the head, timed inside the engine around
  ``start_load_kv`` (target: at least half).
- Load and save time per block through kvstore vs vLLM's own example connector
  (``ExampleConnector``: safetensors files per layer on local disk), timed inside each
  engine (whole-block mode, where a load ends in ``start_load_kv``).

The model is a random-weight bf16 Llama written to disk: by default 16 layers, 8 KV
heads of 128 (2 MiB per 32-token block), ``--geometry smol`` for SmolLM2-135M's. The
store is a ``kvstore serve`` on loopback reached over TCP (``--transport``). Each of
``--runs`` rounds takes a fresh prompt: the anchor computes it, the savers compute its
head (a miss, saved), then ``--hits`` times each loader drops vLLM's local prefix cache
and serves the prompt from its store, all interleaved so that they see the same load on
this shared machine. Reported: medians. Runs in .venv-vllm (``make bench-vllm``):

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--runs 3] [--hits 3] [--tokens 3072]

``--compute-cores N`` binds every engine's forward to N cores, leaving the others to the
connector's load and save threads: how vLLM deploys a CPU engine with a KV connector.
"""

from __future__ import annotations

import argparse
import json
import os
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

from engine.vllm.connector import KVStoreConnector
from engine.vllm.scheduler_side import KVStoreConnectorMetadata

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
        for name in ("load", "save"):
            _timed(self.store, name, self.phases)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        assert self.paged is not None
        for name in ("gather", "scatter"):
            _timed(self.paged, name, self.phases)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        t0 = time.perf_counter()
        super().start_load_kv(forward_context, **kwargs)  # whole blocks: done on return
        if meta.loads:  # blocks asked for (counted as loaded after the step, when settled)
            n = sum(len(t.keys) for t in meta.loads)
            self.timings.loads.append((time.perf_counter() - t0, n))

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


GEOMETRIES = ("wide", "smol")


def _engines(
    root: Path, store_address: str, token: str, geometry: str, transport: str
) -> dict[str, Any]:
    from tests.support.vllm_fixtures import SMOL, WIDE, EngineSpec, start_engines, write_tiny_llama

    g = {"wide": WIDE, "smol": SMOL}[geometry]
    model = str(write_tiny_llama(root / geometry, save_dtype="bfloat16", **g))
    common: dict[str, Any] = dict(model=model, dtype="bfloat16", module_path=MODULE)
    store = {"endpoint": store_address, "token": token, "model_id": f"{geometry}-random",
             "transport": transport}  # fmt: skip
    specs = {
        "anchor": EngineSpec(**common),
        # The saver: computes each prompt's head and stores it (its saves timed).
        "kvstore": EngineSpec(
            **common, role="kv_producer", connector="TimedKVStoreConnector",
            extra={**store, "layerwise": False, "layerwise_save": False},
        ),
        # The same saves layer by layer beside the forward, under another model id (the
        # store would skip blocks it holds already, and nothing would move).
        "lw_saver": EngineSpec(
            **common, role="kv_producer", connector="TimedKVStoreConnector",
            extra={**store, "model_id": f"{geometry}-random-lw", "layerwise_save": True},
        ),
        # Two loaders of the same blocks, neither saving: whole blocks before the
        # forward (timed per block: start_load_kv returns when they are in the pages),
        # and layer by layer beside it.
        "whole": EngineSpec(
            **common, role="kv_consumer", connector="TimedKVStoreConnector", policy="recompute",
            extra={**store, "layerwise": False},
        ),
        "layerwise": EngineSpec(
            **{**common, "module_path": "engine.vllm.connector"}, role="kv_consumer",
            connector="KVStoreConnector", policy="recompute", extra={**store, "layerwise": True},
        ),
        "example": EngineSpec(
            **common, role="kv_both", connector="TimedExampleConnector",
            extra={"shared_storage_path": str(root / "example-files")},
        ),
    }  # fmt: skip
    return start_engines(specs, root, "anchor")


def _prompt(seed: int, tokens: int) -> list[int]:
    """Random token ids (one generator for the whole prompt: a fresh one per token would
    repeat its first draw, and a prompt of one token repeated is no benchmark). The seed
    goes in as text: ``Random(-1)`` is ``Random(1)``, and warm-up and run 1 would share
    their prompt."""
    rng = random.Random(f"bench-vllm/{seed}")  # an int seed is used by its magnitude
    return [rng.randrange(4, 8192) for _ in range(tokens)]


def _ttft(engine: Any, p: list[int]) -> tuple[float, int, list[int]]:
    out = engine.generate([p], 1)[0]
    return float(out["wall_s"]), int(out["cached"]), list(out["tokens"])


def run(
    runs: int, tokens: int, hits: int, cached: float, geometry: str, transport: str
) -> dict[str, Any]:
    """Every engine's numbers, in a temporary directory removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        return _run_in(Path(tmp), runs, tokens, hits, cached, geometry, transport)


HITS = (("whole", "hit"), ("layerwise", "lw_hit"), ("example", "ex_hit"))


def _run_in(
    root: Path,
    runs: int,
    tokens: int,
    hits: int,
    share: float,
    geometry: str,
    transport: str,
) -> dict[str, Any]:
    from tests.support.server_process import ALPHA, ServerProcess, base_flags
    from tests.support.vllm_fixtures import SMOL, WIDE, stop_engines

    (root / "store").mkdir()
    flags = {**base_flags(root / "store"), "dram_bytes": "3GiB"}
    store = ServerProcess(root / "store", flags).start()
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:  # --compute-cores: the store is off them
        _pin_process(store.pid, os.sched_getaffinity(0) - _team_cores())
    engines: dict[str, Any] = {}
    rows: dict[str, list[float]] = {
        k: []
        for k in ("anchor", "anchor_head", "miss", "lw_miss", "ex_miss", "hit", "lw_hit", "ex_hit")
    }
    cached: dict[str, list[int]] = {hit: [] for _, hit in HITS}
    try:
        engines = _engines(root, store.address, ALPHA.token, geometry, transport)
        warm = _prompt(-1, tokens)
        for e in engines.values():  # first-call costs (allocator, kernels) out of the rounds
            e.generate([warm], 1)
        head = int(tokens * share)
        for r in range(runs):
            p = _prompt(r, tokens)
            anchor = engines["anchor"]
            anchor.reset()
            t, _, _ = _ttft(anchor, p)  # recompute: the whole prompt in one pass
            rows["anchor"].append(t)
            # The tokens a store hit must give: the head computed alone, then the rest
            # against its KV (the same split as a load; in bf16, one pass over all of p
            # may round to another greedy token, with every loaded byte right).
            anchor.reset()
            t, _, _ = _ttft(anchor, p[:head])  # the head's compute, nothing saved
            rows["anchor_head"].append(t)
            _, _, ref = _ttft(anchor, p)
            # computes and saves the head, whole blocks and layer by layer, in turns
            savers = [("kvstore", "miss"), ("lw_saver", "lw_miss")]
            for name, row in savers if r % 2 == 0 else savers[::-1]:
                t, _, _ = _ttft(engines[name], p[:head])
                rows[row].append(t)
            # vLLM's example connector finds a prompt by its own tokens only: it saves p
            t, _, _ = _ttft(engines["example"], p)
            rows["ex_miss"].append(t)
            for _ in range(hits):  # interleaved, so all see the same machine load
                for name, hit in HITS:
                    engines[name].reset()
                    t, n, out = _ttft(engines[name], p)
                    rows[hit].append(t)
                    cached[hit].append(n)
                    if name != "example":  # it loads the whole prompt: another split
                        assert out == ref, f"{name}: tokens differ from the anchor's"
        stats = {n: engines[n].stats()["worker"] for n in engines if n != "anchor"}
    finally:
        stop_engines(engines)
        store.stop()

    def per_block_ms(calls: list[tuple[float, int]]) -> float:
        return 1e3 * statistics.median(sec / n for sec, n in calls if n) if calls else 0.0

    def phases_ms(st: dict[str, Any], loads: bool) -> dict[str, float]:
        n = max(1, sum(b for _, b in st["loads" if loads else "saves"]))
        keep = ("load", "scatter") if loads else ("gather", "save")
        return {k: 1e3 * v / n for k, v in st["phases"].items() if k in keep}

    per_block: dict[str, dict[str, Any]] = {
        "kvstore": {
            "load_ms": per_block_ms(stats["whole"]["loads"]),
            "save_ms": per_block_ms(stats["kvstore"]["saves"]),
            "load_s_per_request": statistics.median(s for s, n in stats["whole"]["loads"] if n)
            if stats["whole"]["loads"] else 0.0,
            "phases_mean_ms": {**phases_ms(stats["whole"], True),
                               **phases_ms(stats["kvstore"], False)},
        },
        "example": {
            "load_ms": per_block_ms(stats["example"]["loads"]),
            "save_ms": per_block_ms(stats["example"]["saves"]),
        },
    }  # fmt: skip
    g = {"wide": WIDE, "smol": SMOL}[geometry]
    ttft = {k: statistics.median(v) for k, v in rows.items()}
    load_s = per_block["kvstore"]["load_s_per_request"]
    saves = {n: [sec for sec, b in stats[n]["saves"] if b] for n in ("kvstore", "lw_saver")}
    save_s = statistics.median(saves["kvstore"]) if saves["kvstore"] else 0.0
    lw_left = statistics.median(saves["lw_saver"]) if saves["lw_saver"] else 0.0
    return {"tokens": tokens, "cached_share": share, "runs": runs, "hits_per_run": hits,
            "geometry": {"name": geometry, **g}, "transport": transport,
            "compute_cores": os.environ.get("OMP_NUM_THREADS", "all"),
            "ttft_s": ttft, "cached_tokens": cached, "per_block": per_block,
            "layerwise_loads": stats["layerwise"]["layerwise_loads"],
            "loader_counters": {n: {k: stats[n][k] for k in ("loaded_blocks", "failed_blocks",
                                                            "hit_tokens", "lookups")}
                                for n in ("whole", "layerwise")},
            "saver_counters": {n: {k: stats[n][k] for k in ("saved_blocks", "present_blocks",
                                                            "store_errors", "skipped_calls")}
                               for n in ("kvstore", "lw_saver")},
            "layer_wait_s_per_step": stats["layerwise"]["layer_wait_us"] / 1e6
            / max(1, stats["layerwise"]["layerwise_loads"]),
            "hidden_share": (ttft["hit"] - ttft["lw_hit"]) / load_s if load_s else 0.0,
            "save_s_per_request": save_s, "lw_save_left_s_per_request": lw_left,
            "layerwise_saves": stats["lw_saver"]["layerwise_saves"],
            "save_layer_s_per_step": stats["lw_saver"]["save_layer_us"] / 1e6
            / max(1, stats["lw_saver"]["layerwise_saves"]),
            "save_hidden_share": (ttft["miss"] - ttft["lw_miss"]) / save_s if save_s else 0.0,
            "block_bytes": g["layers"] * 2 * g["kv_heads"] * 32 * g["head_dim"] * 2}  # fmt: skip


def _print(res: dict[str, Any]) -> None:
    t, pb, g = res["ttft_s"], res["per_block"], res["geometry"]
    kib = res["block_bytes"] / 1024
    print(f"vLLM {res['tokens']}-token prompt, {res['cached_share']:.0%} of it stored; "
          f"random bf16 Llama, {g['layers']} layers x {g['kv_heads']} KV heads x "
          f"{g['head_dim']}, CPU; store over {res['transport']}; medians of {res['runs']} "
          f"runs ({res['hits_per_run']} hits each, interleaved); block = 32 tokens = "
          f"{kib:.0f} KiB; the forward on {res['compute_cores']} cores")  # fmt: skip
    print(f"{'TTFT':52} {'seconds':>9} {'vs recompute':>13}")
    c = {k: "/".join(str(n) for n in sorted(set(v))) for k, v in res["cached_tokens"].items()}
    lines = [
        ("recompute (no connector)", t["anchor"]),
        (f"kvstore, layer-wise loads ({c['lw_hit']} tokens loaded)", t["lw_hit"]),
        (f"kvstore, whole-block loads ({c['hit']} tokens loaded)", t["hit"]),
        (f"vLLM ExampleConnector ({c['ex_hit']} tokens loaded)", t["ex_hit"]),
        ("compute of the head alone (no connector)", t["anchor_head"]),
        ("kvstore miss of the head, whole-block saves", t["miss"]),
        ("kvstore miss of the head, layer-wise saves", t["lw_miss"]),
        ("ExampleConnector miss (compute + save, whole prompt)", t["ex_miss"]),
    ]
    for label, v in lines:
        print(f"{label:52} {v:9.3f} {t['anchor'] / v:12.2f}x")
    load = pb["kvstore"]["load_s_per_request"]
    print(f"whole-block load of the stored head: {load:.3f} s; layer-wise loads save "
          f"{t['hit'] - t['lw_hit']:.3f} s of TTFT: {res['hidden_share']:.0%} of the transfer "
          f"hidden behind compute ({res['layerwise_loads']} layer-wise steps; the forward "
          f"waited {res['layer_wait_s_per_step']:.3f} s a step for layers to land)")  # fmt: skip
    print(f"whole-block save of the head: {res['save_s_per_request']:.3f} s after the forward; "
          f"layer-wise saves left {res['lw_save_left_s_per_request']:.3f} s after it and cut "
          f"the miss's TTFT by {t['miss'] - t['lw_miss']:.3f} s: {res['save_hidden_share']:.0%} "
          f"of the save hidden ({res['layerwise_saves']} layer-wise steps; the forward "
          f"spent {res['save_layer_s_per_step']:.3f} s a step gathering layers)")  # fmt: skip
    sc = res["saver_counters"]
    if sc["kvstore"]["saved_blocks"] != sc["lw_saver"]["saved_blocks"]:
        print("WARNING: the two savers stored different numbers of blocks: their rows "
              "do not compare (see the counters)")  # fmt: skip
    print(
        "savers' counters: whole "
        + ", ".join(f"{k} {v}" for k, v in sc["kvstore"].items())
        + "; layer-wise "
        + ", ".join(f"{k} {v}" for k, v in sc["lw_saver"].items())
    )
    print(f"{'per block':52} {'load ms':>9} {'save ms':>10}")
    for name, label in (("example", "anchor: vLLM ExampleConnector (files)"),
                        ("kvstore", f"kvstore ({res['transport']})")):  # fmt: skip
        print(f"{label:52} {pb[name]['load_ms']:9.3f} {pb[name]['save_ms']:10.3f}")
    phases = ", ".join(f"{k} {v:.3f}" for k, v in pb["kvstore"]["phases_mean_ms"].items())
    print(f"kvstore steps, mean ms per block: {phases}")
    ld = pb["example"]["load_ms"] / max(pb["kvstore"]["load_ms"], 1e-9)
    sv = pb["example"]["save_ms"] / max(pb["kvstore"]["save_ms"], 1e-9)
    print(f"kvstore vs the example connector, per block: loads {ld:.2f}x faster, saves "
          f"{sv:.2f}x faster")  # fmt: skip


def _bind_compute(n: int) -> None:
    """Give the engine children (they inherit this environment) an OpenMP team on the
    first ``n`` cores: the settings vLLM's multiprocess executor makes for a worker
    (vllm/utils/ompmultiprocessing.py), and ``VLLM_CPU_OMP_THREADS_BIND``, from which
    the connector's ``transfer_cpus="auto"`` puts its threads on the other cores."""
    cores = sorted(os.sched_getaffinity(0))
    if not 0 < n < len(cores):
        raise SystemExit(f"--compute-cores {n}: this machine has {len(cores)} cores")
    team = ",".join(str(c) for c in cores[:n])
    os.environ.update(
        OMP_NUM_THREADS=str(n),
        OMP_PLACES="{" + team + "}",
        OMP_PROC_BIND="true",
        VLLM_CPU_OMP_THREADS_BIND=team,
    )


def _team_cores() -> set[int]:
    return {int(c) for c in os.environ["VLLM_CPU_OMP_THREADS_BIND"].split(",")}


def _pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (threads it starts later inherit it): the
    store stands for another host, whose work must not land on the engines' cores."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), cpus)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=3072)
    ap.add_argument("--cached", type=float, default=0.75, help="share of the prompt stored")
    ap.add_argument("--hits", type=int, default=3, help="store hits per run and connector")
    ap.add_argument("--geometry", choices=GEOMETRIES, default="wide")
    ap.add_argument("--transport", choices=("tcp", "auto", "shm"), default="tcp")
    ap.add_argument(
        "--compute-cores",
        type=int,
        default=0,
        help="bind every engine's OpenMP team to this many cores (0: all), as vLLM's "
        "multiprocess executor does, leaving the rest to the connector's transfer threads",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.compute_cores:
        _bind_compute(args.compute_cores)
    res = run(args.runs, args.tokens, args.hits, args.cached, args.geometry, args.transport)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        _print(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
