"""KV into and out of GPU memory through the served store, each row against its anchor in
the same run (issue 31's table). Needs a CUDA device; without one it says so and exits 0.

Rows (median of ``--runs``; every figure is GB/s of payload unless it says otherwise):

- same-host ``batch_get_into`` of 480 x 512 KiB bf16 blocks (a 7,680-token prefix of a
  1B Llama: 16 layers, 8 KV heads of 64, 16-token blocks) into views of one CUDA tensor,
  through a ``kvstore serve`` on this host, against one pinned H2D copy of the same bytes
  (target >= 0.8);
- the same batch over TCP, against the same TCP batch into host memory (target >= 0.9);
- ``put`` from CUDA tensors through the same server (DRAM top tier), 1/4/16 MiB, against
  a pinned D2H copy of the same bytes (target >= 0.5);
- node-level HBM and DRAM copies (benchmarks/gpu_node.py) and the TTFT of a prefill
  worker whose prefix is in the served store against recomputing it
  (benchmarks/gpu_ttft.py), where those modules are present.

Every fetched block is compared with what was put, once per run, outside the timing:
a wrong byte fails the benchmark.

Usage: python benchmarks/bench_gpu.py [--runs 5] [--out FILE.md] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_node
from bench_service import TOKEN, kvstore_server

from kvstore import StoreClient

MiB = 1 << 20
PREFIX_BLOCKS = 480
BLOCK_SHAPE = (16, 2, 8, 16, 64)  # [layers, 2, kv_heads, block_tokens, head_dim]: 512 KiB
PUT_SIZES = (1 * MiB, 4 * MiB, 16 * MiB)
PUT_BYTES = 128 * MiB  # moved per put measurement
Rows = list[dict[str, Any]]


DEVICE = "cuda"  # --device cpu: the same code on CPU tensors, a smoke run with no GPU


def _pinned(t: Any) -> Any:
    return t.pin_memory() if DEVICE == "cuda" else t


def median_rate(nbytes: int, fn: Callable[[], Any], runs: int) -> float:
    """GB/s: the median over ``runs`` synchronized calls, after one untimed warm-up."""
    return gpu_node.median_gbps(nbytes, fn, DEVICE, runs)


@contextmanager
def client(address: str, transport: str) -> Iterator[StoreClient]:
    with StoreClient.connect(address, token=TOKEN, transport=transport) as c:
        yield c


def _blocks(n: int) -> tuple[list[bytes], Any]:
    """``n`` distinct keys and one CUDA bf16 tensor holding their blocks, one per row."""
    import torch

    keys = [_key(f"prefix-{i}") for i in range(n)]
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    src = torch.randn((n, *BLOCK_SHAPE), generator=gen, device=DEVICE, dtype=torch.float32)
    return keys, src.to(torch.bfloat16)


def prefix_rows(address: str, runs: int) -> list[dict[str, Any]]:
    """Rows 1 and 2: the prefix into CUDA over shm and TCP, with their anchors."""
    import torch

    keys, src = _blocks(PREFIX_BLOCKS)
    nbytes = src.numel() * src.element_size()
    with client(address, "auto") as c:
        assert all(r is True or r is False for r in c.batch_put(keys, list(src.cpu()))), "put"
    dst = torch.empty_like(src)
    host = torch.empty_like(src, device="cpu")
    pinned = _pinned(src.cpu())
    outs = list(dst)
    rows = []
    h2d = median_rate(nbytes, lambda: dst.copy_(pinned, non_blocking=True), runs)
    for transport in ("shm", "tcp"):
        with client(address, transport) as c:

            def into_cuda(c: StoreClient = c) -> None:
                assert all(r is True for r in c.batch_get_into(keys, outs)), "a block missed"

            def into_host(c: StoreClient = c) -> None:
                assert all(r is True for r in c.batch_get_into(keys, list(host)))

            dst.zero_()
            ours = median_rate(nbytes, into_cuda, runs)
            assert torch.equal(dst, src), f"{transport}: wrong bytes landed in CUDA"
            if transport == "shm":
                rows.append(
                    _row(
                        f"shm batch_get_into {DEVICE}, 480 x 512 KiB", ours, "pinned H2D", h2d, 0.8
                    )
                )
            else:
                anchor = median_rate(nbytes, into_host, runs)
                rows.append(
                    _row(
                        f"tcp batch_get_into {DEVICE}, 480 x 512 KiB",
                        ours,
                        "tcp into host",
                        anchor,
                        0.9,
                    )
                )
    return rows


def put_rows(address: str, runs: int) -> list[dict[str, Any]]:
    """Row 3: puts from CUDA tensors, against a pinned D2H copy of the same bytes: same
    host (the D2H lands in the node's segment) and over TCP (pipelined through pinned
    staging)."""
    rows = []
    for transport in ("auto", "tcp"):
        with client(address, transport) as c:
            rows += [_put_row(c, size, runs, transport) for size in PUT_SIZES]
    return rows


def _put_row(c: StoreClient, size: int, runs: int, transport: str) -> dict[str, Any]:
    import torch

    n = PUT_BYTES // size
    src = torch.randint(0, 255, (n, size), dtype=torch.uint8, device=DEVICE)
    pinned = _pinned(torch.empty((n, size), dtype=torch.uint8))
    rounds = iter(range(1 << 30))

    def put() -> None:
        r = next(rounds)
        keys = [_key(f"put-{size}-{r}-{i}") for i in range(n)]
        assert all(x is True for x in c.batch_put(keys, list(src))), "a put failed"
        c.remove(keys)

    ours = median_rate(n * size, put, runs)
    d2h = median_rate(n * size, lambda: pinned.copy_(src, non_blocking=True), runs)
    what = f"{transport} batch_put from {DEVICE}, {size // MiB} MiB"
    return _row(what, ours, "pinned D2H", d2h, 0.5)


def _key(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


def _row(what: str, ours: float, anchor_name: str, anchor: float, target: float) -> dict[str, Any]:
    """A row of rates (higher is better): the ratio is ours / anchor."""
    ratio = ours / anchor if anchor else 0.0
    return {
        "measure": what,
        "ours": f"{ours:.2f} GB/s",
        "anchor": anchor_name,
        "anchor_value": f"{anchor:.2f} GB/s",
        "ratio": round(ratio, 3),
        "target": target,
        "met": ratio >= target,
    }


def ttft_rows(address: str, runs: int) -> list[dict[str, Any]]:
    """TTFT of a prefill worker (the code ``kvstore worker --device cuda`` runs) whose
    7,680-token prefix is in the served store, against recomputing the whole 8,192-token
    prompt, same run (benchmarks/gpu_ttft.py); its decode tokens must be its own. A
    second row: the same with the prefix loaded in 4 parts beside the forward."""
    import gpu_ttft

    kwargs: dict[str, Any] = {"runs": runs, "client_kwargs": {"token": TOKEN}}
    if DEVICE == "cpu":  # a smoke run: the 1B geometry takes minutes a prompt on a CPU
        kwargs.update(geometry=gpu_ttft.TINY, prompt_tokens=256, cached_tokens=240)
    res = gpu_ttft.measure_ttft(DEVICE, address, layer_parts=4, **kwargs)
    assert res.tokens_equal, "the decode worker's tokens are not its prefill's continuation"
    what = f"TTFT, {res.prompt_tokens} tokens, {res.cached_tokens} cached (served, {DEVICE})"
    rows = []
    for label, ttft in (("", res.cached_ttft_s), (", loaded beside", res.layered_ttft_s)):
        assert ttft is not None
        row = _row(what + label, 1 / ttft, "recompute", 1 / res.recompute_ttft_s, 4.0)
        row.update(ours=f"{ttft * 1e3:.1f} ms", anchor_value=f"{res.recompute_ttft_s * 1e3:.1f} ms")
        rows.append(row)
    return rows


def node_rows(runs: int, measure: Callable[..., list[Any]]) -> list[dict[str, Any]]:
    """Node-level copies against device copies: ``measure`` is benchmarks/gpu_node.py's
    ``hbm_rows`` or ``dram_rows`` (one group each, so one failing keeps the other)."""
    found = measure(repeats=runs, smoke_cpu=DEVICE == "cpu")
    rows = []
    for r in found:
        what = f"node {r.measure}, {r.block_mib:g} MiB" + (f" ({r.note})" if r.note else "")
        target = 0.5 if "put" in r.measure else 0.8  # issue 31: puts >= 0.5, reads >= 0.8
        rows.append(_row(what, r.ours_gbps, r.anchor, r.anchor_gbps, target))
    return rows


def report(rows: list[dict[str, Any]], device: str, *, head: bool = True) -> str:
    """Markdown rows of the table (with its title and header when ``head``)."""
    lines = []
    if head:
        lines = [f"bench_gpu on {device}", "", "| measure | ours | anchor | ratio | target | met |"]
        lines.append("|---|---|---|---|---|---|")
    for r in rows:
        if r.get("missing"):
            lines.append(f"| {r['measure']} | MISSING | | | | |")
            continue
        anchor = f"{r['anchor']} {r['anchor_value']}"
        lines.append(
            f"| {r['measure']} | {r['ours']} | {anchor} | {r['ratio']} | "
            f">= {r['target']} | {'yes' if r['met'] else 'NO'} |"
        )
    return "\n".join(lines)


def group(name: str, measure: Callable[[], Rows]) -> Rows:
    """A group's rows, or one MISSING row naming it when it failed (its traceback on
    stderr): a wrong byte or a dead server costs that group, not the groups after it."""
    try:
        return measure()
    except Exception:
        traceback.print_exc()
        print(f"bench_gpu: the {name} rows failed; going on", file=sys.stderr, flush=True)
        return [{"measure": f"{name} (failed: see the log)", "missing": True, "failed": True}]


def served(
    dram: str,
    groups: list[tuple[str, Callable[[str, int], Rows]]],
    runs: int,
    done: Callable[[Rows], None],
) -> None:
    """``groups`` measured against one ``kvstore serve`` of ``dram``, each on its own
    (:func:`group`); those left unmeasured because the server did not start are
    MISSING rows."""
    left = list(groups)
    try:
        with kvstore_server(dram) as facts:
            address = f"127.0.0.1:{facts['port']}"
            while left:
                name, measure = left.pop(0)
                done(group(name, lambda: measure(address, runs)))  # noqa: B023 (called now)
    except Exception:
        traceback.print_exc()
    for name, _ in left:
        done([{"measure": f"{name} (no server: see the log)", "missing": True, "failed": True}])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, help="append the Markdown table here")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    import torch

    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device; nothing measured")
        return 0
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke run)"
    rows: list[dict[str, Any]] = []

    def done(new: list[dict[str, Any]]) -> None:
        """Each group's rows as soon as they are measured: a run cut short by its time
        limit still leaves what it measured, in the log and in ``--out``."""
        rows.extend(new)
        if not args.json:
            print(report(new, device, head=len(rows) == len(new)), flush=True)
        if args.out:
            with args.out.open("a") as fh:
                fh.write(report(new, device, head=len(rows) == len(new)) + "\n")

    runs = args.runs
    served("2GiB", [("prefix", prefix_rows), ("puts", put_rows)], runs, done)
    # a fresh node: the prefix is all it holds
    served("1GiB", [("TTFT", ttft_rows)], runs, done)
    done(group("node HBM", lambda: node_rows(runs, gpu_node.hbm_rows)))
    done(group("node DRAM", lambda: node_rows(runs, gpu_node.dram_rows)))
    if args.json:
        print(json.dumps(rows, indent=1), flush=True)
    return 1 if any(r.get("failed") for r in rows) else 0  # every group ran; some failed


if __name__ == "__main__":
    sys.exit(main())
