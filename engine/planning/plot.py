"""The ``kvstore plan --plot`` picture: hit rate against KV capacity per node.

Apart from plan.py so the replay/report logic and the matplotlib drawing stay in
rooms of their own; the report dict built by plan.py is the only interface.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from kvstore.errors import StorageError

__all__ = ["plot_sweep", "si"]


def si(x: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}{unit}"
    return f"{x:.3g}{unit}"


_MODES = (
    ("pooled", "tab:orange", "s", "one pooled cache"),
    ("per-node", "tab:blue", "o", "per-node caches"),
)


def plot_sweep(path: Path, report: dict[str, Any]) -> None:
    """Hit rate against capacity per node: a line per mode for all tiers, a dashed one
    for the DRAM part (the shaded gap is what SSD adds), the plan and the bound marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dram, ssd = report["dram_blocks_per_node"], report["ssd_blocks_per_node"]
    tiered = dram is not None and ssd != 0  # an SSD tier that the sweep scales or keeps
    bound = 100 * report["prefix_reuse_bound"]
    fig, ax = plt.subplots(figsize=(9, 5.6), dpi=120)
    handles, top = _draw_modes(ax, report, tiered)
    handles += _key_extras(tiered, dram is None)
    _mark_limits(ax, report, bound)
    ratio = _draw_axes(ax, report, max(top, bound))
    ax.legend(handles=handles, loc="lower right", fontsize=8, framealpha=0.95)
    ax.set_title(
        f"{report['requests']:,} requests, {report['nodes']} prefill nodes, {report['policy']} "
        f"eviction, {report['scheduler']} scheduler, {ratio}",
        fontsize=9, color="0.25", pad=28 if tiered and ssd else 8,
    )  # fmt: skip
    fig.suptitle(
        f"How much prefill the KV cache saves: {Path(report['trace']).name}",
        fontsize=12, fontweight="bold",
    )  # fmt: skip
    fig.tight_layout()
    _atomic_savefig(fig, path)
    plt.close(fig)


def _draw_modes(ax: Any, report: dict[str, Any], tiered: bool) -> tuple[list[Any], float]:
    """A line per mode (its DRAM part dashed, the SSD gap shaded), the plan starred;
    returns the legend handles and the highest hit rate drawn."""
    from matplotlib.lines import Line2D

    handles: list[Any] = []
    top = 0.0
    for mode, colour, marker, label in _MODES:
        pts = [p for p in report["sweep"] if p["mode"] == mode]
        if not pts:
            continue
        xs = [p["tokens_per_node"] for p in pts]
        total = [100 * p["hit_rate"] for p in pts]
        top = max(top, *total)
        ax.plot(xs, total, color=colour, marker=marker, lw=2.2, ms=5, zorder=3)
        handles.append(Line2D([], [], color=colour, marker=marker, lw=2.2, label=label))
        if tiered:
            in_dram = [100 * p["dram_hit_rate"] for p in pts]
            ax.plot(xs, in_dram, color=colour, ls="--", lw=1.3, zorder=3)
            ax.fill_between(xs, in_dram, total, color=colour, alpha=0.14, lw=0, zorder=2)
        for p in pts:
            if p["planned"]:
                _mark_plan(ax, p, colour, marker, tiered, mode == "pooled")
        planned = report["results"].get(mode)
        if report["dram_blocks_per_node"] is None and planned is not None:
            # unlimited DRAM: the plan is off the axis
            ax.axhline(100 * planned["hit_rate"], color=colour, ls=(0, (1, 2)), lw=1.5)
    return handles, top


def _key_extras(tiered: bool, unlimited_dram: bool) -> list[Any]:
    """Legend entries for the DRAM/SSD split and for how the plan is marked."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    out: list[Any] = []
    if tiered:
        out += [
            Line2D([], [], color="0.3", ls="--", lw=1.3, label="of which from DRAM"),
            Patch(color="0.3", alpha=0.25, lw=0, label="from SSD (the gap)"),
        ]
    if unlimited_dram:
        out.append(
            Line2D([], [], color="0.1", ls=(0, (1, 2)), lw=1.5, label="planned: unlimited DRAM")
        )
    else:
        out.append(
            Line2D([], [], color="0.1", marker="*", ms=12, lw=0, mfc="white", label="planned")
        )
    return out


def _mark_limits(ax: Any, report: dict[str, Any], bound: float) -> None:
    """The prefix-reuse bound, and the capacity at which the pool holds the whole trace."""
    ax.axhline(bound, color="0.35", ls=":", lw=1.3, zorder=1)
    ax.annotate(
        f"unlimited cache: {bound:.1f}% (the trace's prefix-reuse bound)",
        (0.01, bound), xycoords=("axes fraction", "data"), xytext=(0, 4),
        textcoords="offset points", fontsize=8, color="0.3", va="bottom",
    )  # fmt: skip
    footprint = report["footprint_blocks_per_node"] * report["block_tokens"]
    if report["sweep_axis"] != "dram":
        ax.axvline(footprint, color="0.6", lw=0.8, ls="-.", zorder=1)
        ax.annotate(
            "pool holds the\nwhole trace", (footprint, 1), xycoords=("data", "axes fraction"),
            xytext=(-4, -4), textcoords="offset points", fontsize=7.5, color="0.45", va="top",
            ha="right",
        )  # fmt: skip


def _draw_axes(ax: Any, report: dict[str, Any], top: float) -> str:
    """Scales, ticks and labels of both axes; returns the tiering phrase for the title."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    dram, ssd = report["dram_blocks_per_node"], report["ssd_blocks_per_node"]
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: si(x)))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:.0f}%"))
    ax.set_ylim(0, top * 1.22)
    ax.set_ylabel("prompt tokens served from the KV cache\n(token-weighted prefix hit rate)")
    ax.grid(True, which="major", alpha=0.3)
    ax.grid(True, which="minor", axis="x", alpha=0.1)
    if report["sweep_axis"] == "dram":
        ax.set_xlabel("DRAM per node (tokens, log scale); SSD unlimited")
        return "SSD unlimited"
    if dram is None:
        ax.set_xlabel("DRAM per node (tokens, log scale); planned: unlimited (dotted)")
        return "DRAM only"
    if not ssd:
        ax.set_xlabel("DRAM per node (tokens, log scale); no SSD tier")
        return "no SSD"
    ax.set_xlabel(
        f"KV capacity per node: DRAM + SSD at the planned 1:{ssd / dram:.3g} (tokens, log scale)"
    )
    share = dram / (dram + ssd)
    sec = ax.secondary_xaxis("top", functions=(lambda x: x * share, lambda x: x / share))
    sec.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    sec.xaxis.set_major_formatter(FuncFormatter(lambda x, _: si(x)))
    sec.xaxis.set_minor_formatter(NullFormatter())
    sec.set_xlabel("of which DRAM per node (tokens)", fontsize=8.5, color="0.3")
    sec.tick_params(labelsize=8, colors="0.3")
    return f"DRAM:SSD = 1:{ssd / dram:.3g}"


def _mark_plan(
    ax: Any, p: dict[str, Any], colour: str, marker: str, tiered: bool, above: bool
) -> None:
    """Star the planned point and write its figures beside it."""
    x, y = p["tokens_per_node"], 100 * p["hit_rate"]
    ax.plot([x], [y], marker="*", ms=16, color=colour, mec="0.1", mew=1.0, zorder=5)
    text = f"{p['mode']}: {p['hit_rate']:.1%}"
    if tiered:
        text += f"\n{p['dram_hit_rate']:.1%} DRAM + {p['ssd_hit_rate']:.1%} SSD"
    ax.annotate(
        text, (x, y), xytext=(10, 8 if above else -10), textcoords="offset points",
        fontsize=8.5, color=colour, fontweight="bold", va="bottom" if above else "top",
        bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "none", "alpha": 0.8},
        zorder=6,
    )  # fmt: skip


def _atomic_savefig(fig: Any, path: Path) -> None:
    """Write to a temp file beside ``path``, fsync, rename: never a half-written PNG."""
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        umask = os.umask(0o022)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a plot is as readable as any file
        with os.fdopen(fd, "wb") as fh:
            fig.savefig(fh, format="png")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise StorageError(f"cannot write the plot to {path}: {exc}") from exc
