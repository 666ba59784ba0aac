"""Real vLLM engines for the connector tests and benchmark (run inside .venv-vllm).

Each engine lives in its own child process (``python -m tests.support.vllm_fixtures ENGINE_JSON``)
because vLLM's in-process engine keeps process-global state (its distributed groups and
the KV connector), so two engines cannot share a process; a producer and a consumer in
separate processes is also what disaggregated serving looks like. The parent talks to a
child over its stdin/stdout, one JSON object per line; the child's logs go to a file.

The children follow what was measured on these machines: in-process engines
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor) start in seconds instead of
~17 s; ``enforce_eager``; a block size that is a multiple of 32 (the CPU backend's
rule); loopback only; caches inside the test's temp dir; a 1 GiB KV space. The model is
a tiny random Llama with an offline WordLevel tokenizer, written with save_pretrained.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import random
import select
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.support.waiting import wait_until

__all__ = [
    "OTHER_ISA",
    "SMOL",
    "TINY",
    "WIDE",
    "EngineProcess",
    "EngineSpec",
    "engine_env",
    "prompt",
    "start_engines",
    "stop_engines",
    "usable_blocks",
    "write_tiny_llama",
]

BLOCK = 32
START_TIMEOUT = 240.0
OTHER_ISA = "other"  # EngineSpec.attn_isa: a kernel the other engines do not run


TINY = dict(layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=512)
# SmolLM2-135M's geometry (random weights): big enough for prefill time to matter.
SMOL = dict(layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=8192)
# KV heavy enough for its transfer to matter (2 MiB per 32-token bf16 block), small
# enough to prefill on 2 cores: 16 layers, 8 KV heads of 128.
WIDE = dict(layers=16, heads=8, kv_heads=8, head_dim=128, intermediate=2048, vocab=8192)


def write_tiny_llama(
    path: Path,
    *,
    seed: int = 0,
    save_dtype: str = "float32",
    sliding_window: int | None = None,
    **geometry: int,
) -> Path:
    """A random-weight Llama (``TINY`` unless overridden) and its offline tokenizer;
    with ``sliding_window``, a Mistral of the same geometry whose attention sees that
    many tokens back.

    Head dim 32 is the smallest the CPU attention backend takes. ``initializer_range``
    0.1 keeps greedy output varied and prompt-sensitive, so equal tokens mean equal KV.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        PreTrainedTokenizerFast,
    )

    if (path / "config.json").exists():
        return path
    g = {**TINY, **geometry}
    config_cls, model_cls = LlamaConfig, LlamaForCausalLM
    window: dict[str, Any] = {}
    if sliding_window is not None:
        config_cls, model_cls = MistralConfig, MistralForCausalLM
        window["sliding_window"] = sliding_window
    cfg = config_cls(
        **window,
        vocab_size=g["vocab"],
        hidden_size=g["heads"] * g["head_dim"],
        intermediate_size=g["intermediate"],
        num_hidden_layers=g["layers"],
        num_attention_heads=g["heads"],
        num_key_value_heads=g["kv_heads"],
        head_dim=g["head_dim"],
        max_position_embeddings=4096,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model_cls(cfg).to(getattr(torch, save_dtype)).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t3"
    ).save_pretrained(path)
    return path


def write_tiny_lora(path: Path, model: Path, *, seed: int = 5, rank: int = 8) -> Path:
    """A random LoRA adapter (PEFT's files) on the q and v projections of the model
    :func:`write_tiny_llama` wrote (``TINY`` geometry), strong enough to change its
    greedy answers."""
    import torch
    from safetensors.torch import save_file

    if (path / "adapter_config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    g = TINY
    hidden = g["heads"] * g["head_dim"]
    outs = {"q_proj": hidden, "v_proj": g["kv_heads"] * g["head_dim"]}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for li in range(g["layers"]):
        for name, out in outs.items():
            at = f"base_model.model.model.layers.{li}.self_attn.{name}"
            tensors[f"{at}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.2
            tensors[f"{at}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.2
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "target_modules": sorted(outs), "base_model_name_or_path": str(model)}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def engine_env(root: Path) -> dict[str, str]:
    """The environment of an engine child: loopback, private caches, small KV space."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(
        VLLM_HOST_IP="127.0.0.1",
        VLLM_LOOPBACK_IP="127.0.0.1",
        VLLM_CACHE_ROOT=str(root / "vllm-cache"),
        TORCHINDUCTOR_CACHE_DIR=str(root / "inductor-cache"),
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


@dataclass
class EngineSpec:
    """One engine: the model and dtype, and the connector (``role=None``: none)."""

    model: str
    dtype: str = "float32"
    role: str | None = None  # kv_producer, kv_consumer, kv_both
    connector: str = "KVStoreConnector"
    module_path: str = "engine.vllm.connector"
    extra: dict[str, Any] = field(default_factory=dict)
    policy: str | None = None  # kv_load_failure_policy; None: vLLM's default
    max_model_len: int = 4096
    block_size: int = BLOCK
    max_batched_tokens: int | None = None  # prefill chunk; None: max_model_len
    kv_cache_dtype: str = "auto"  # vLLM's: auto (the model's dtype), fp8, fp8_e5m2
    # The CPU attention kernel (vec, vec16, amx, ...); None: the one vLLM picks for this
    # CPU, or KVSTORE_TEST_VLLM_ISA when set (to run the suite on another kernel);
    # OTHER_ISA: a kernel the engines without one do not run, decided in the child from
    # what vLLM picks there (never a constant that holds on one CPU only).
    attn_isa: str | None = None

    def __post_init__(self) -> None:
        forced = os.environ.get("KVSTORE_TEST_VLLM_ISA") or None  # not seen by children
        if self.attn_isa is None:
            self.attn_isa = forced
        elif self.attn_isa == OTHER_ISA and forced:
            self.attn_isa = other_than(forced)


class EngineProcess:
    """A child process holding one vLLM engine; ``generate`` returns tokens and hits."""

    def __init__(self, spec: EngineSpec, root: Path, name: str, *, hold: bool = False) -> None:
        self.spec = spec
        self.name = name
        self.log = root / f"engine-{name}.log"
        root.mkdir(parents=True, exist_ok=True)
        log = open(self.log, "w")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.vllm_fixtures", json.dumps(asdict(spec))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=engine_env(root),
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        log.close()
        self._lock = threading.Lock()
        self.started = False
        self.released = False
        if not hold:
            self.release()

    def release(self) -> EngineProcess:
        """Let the child build its engine (it imports vLLM while it waits for this)."""
        if not self.released:
            self._send({"op": "start"})
            self.released = True
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> EngineProcess:
        """Block until the engine has started (its first reply)."""
        if not self.started:
            self.release()
            self.ready_info = self._reply(timeout)
            self.started = True
        return self

    def _send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def call(self, op: str, timeout: float = 120.0, **args: Any) -> Any:
        """Send one command and return the child's answer."""
        with self._lock:
            self.wait_ready()
            self._send({"op": op, **args})
            return self._reply(timeout)

    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> list[dict[str, Any]]:
        """Greedy outputs, one ``{"tokens", "cached", "wall_s"}`` per prompt (``wall_s``:
        the whole call, measured in the engine process)."""
        return list(self.call("generate", prompts=prompts, max_tokens=max_tokens))

    def stats(self) -> dict[str, dict[str, int]]:
        """The connector counters of both sides (``scheduler``, ``worker``)."""
        return dict(self.call("stats"))

    def info(self) -> dict[str, dict[str, Any]]:
        """What each connector side runs on: ``namespace`` (model, layout, tenant), and on
        the worker side the attention kernel ``isa`` and the ``page`` order it probed."""
        return dict(self.call("info"))

    def reset(self, within: float = 10.0) -> None:
        """Drop vLLM's local prefix cache, so the next hit can only come from the store.
        vLLM refuses while blocks are still in use (a request just finished): asked
        again until it agrees, within ``within`` seconds."""
        wait_until(lambda: self.call("reset"), "vLLM to reset its prefix cache", within=within)

    def _reply(self, timeout: float) -> Any:
        stdout = self.proc.stdout
        assert stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not select.select([stdout], [], [], 0.2)[0]:
                continue
            line = stdout.readline()
            if not line:
                self.proc.wait(5)
                raise RuntimeError(f"engine {self.name} exited; log:\n{self._tail()}")
            msg = json.loads(line)
            if "error" in msg:
                raise RuntimeError(f"engine {self.name}: {msg['error']}\n{self._tail()}")
            return msg["result"]
        raise TimeoutError(f"engine {self.name} did not answer; log:\n{self._tail()}")

    def _tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def quit(self) -> None:
        """Ask the child to quit (without waiting; see close)."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self._send({"op": "quit"})

    def close(self, timeout: float = 20.0) -> None:
        """Ask the child to quit; kill it (by PID) if it has not within ``timeout``."""
        self.quit()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# -- fault injection (loaded by vLLM through kv_connector_module_path) -------------------


def start_engines(specs: dict[str, EngineSpec], root: Path, first: str) -> dict[str, EngineProcess]:
    """An engine process per spec, started held: ``first`` loads alone (it fills vLLM's
    model-info cache, which the others then read), then the rest together. On a failure
    the ones started are stopped before it is raised."""
    engines = {name: EngineProcess(spec, root, name, hold=True) for name, spec in specs.items()}
    try:
        engines[first].wait_ready()
        for e in engines.values():
            e.release()
        for e in engines.values():
            e.wait_ready()
    except BaseException:
        stop_engines(engines)
        raise
    return engines


def stop_engines(engines: dict[str, EngineProcess]) -> None:
    """Ask every engine to quit, then wait for each."""
    for e in engines.values():
        e.quit()
    for e in engines.values():
        e.close()


def prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids of the tiny vocabulary, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(4, 512) for _ in range(n)]


def usable_blocks(n_tokens: int) -> int:
    """Blocks the store can supply: full blocks, leaving the last token to compute."""
    return (n_tokens - 1) // BLOCK


def __getattr__(name: str) -> Any:
    """``FaultyKVStoreConnector``, built on first use: this module must import without
    vLLM (the main environment imports it), and the connector subclasses a vLLM class."""
    if name == "FaultyKVStoreConnector":
        return _faulty_connector()
    raise AttributeError(name)


@functools.cache
def _faulty_connector() -> type:
    from engine.vllm.connector import KVStoreConnector

    class FaultyKVStoreConnector(KVStoreConnector):
        """KVStoreConnector whose next ``failing_loads`` worker loads raise as if the
        store went away between the scheduler's lookup and the worker's load."""

        failing_loads = 0

        def _open_store(self) -> Any:
            return _LoadFaults(super()._open_store(), self)

    return FaultyKVStoreConnector


class _LoadFaults:
    """A BlockStore wrapper that fails loads while its owner says so."""

    def __init__(self, store: Any, owner: Any) -> None:
        self._store = store
        self._owner = owner

    def batch_get_into(self, keys: Any, outs: Any, *, layers: Any = None) -> list[Any]:
        if self._owner.failing_loads > 0:
            self._owner.failing_loads -= 1
            from kvstore.errors import Unavailable

            raise Unavailable("injected: the store went away")
        return list(self._store.batch_get_into(keys, outs, layers=layers))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


# -- the child -------------------------------------------------------------------------


def _force_attn_isa(isa: str, spec: EngineSpec) -> None:
    """Make vLLM's CPU backend (and the connector, which asks the same function) run
    ``isa``: vLLM has no switch for it, and the choice is made in this process."""
    from vllm.v1.attention.backends import cpu_attn

    if isa == OTHER_ISA:
        isa = _other_isa(cpu_attn._get_attn_isa, spec)
    cpu_attn._get_attn_isa = lambda *args, **kwargs: isa


def _other_isa(pick: Any, spec: EngineSpec) -> str:
    """A kernel other than the one vLLM picks for this geometry on this CPU."""
    import torch

    dtype = getattr(torch, spec.dtype)
    try:
        theirs = pick(dtype, spec.block_size, TINY["head_dim"])
    except TypeError:  # older vLLM: (dtype, block_size)
        theirs = pick(dtype, spec.block_size)
    return other_than(theirs)


def other_than(isa: str) -> str:
    """vec16 (it takes any geometry), or vec when the others run vec16."""
    return "vec" if isa == "vec16" else "vec16"


def _build_llm(spec: EngineSpec) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    if spec.attn_isa is not None:
        _force_attn_isa(spec.attn_isa, spec)

    kv = None
    if spec.role is not None:
        args: dict[str, Any] = dict(
            kv_connector=spec.connector,
            kv_connector_module_path=spec.module_path,
            kv_role=spec.role,
            kv_connector_extra_config=spec.extra,
        )
        if spec.policy is not None:
            args["kv_load_failure_policy"] = spec.policy
        kv = KVTransferConfig(**args)
    return LLM(
        model=spec.model,
        dtype=spec.dtype,
        enforce_eager=True,
        block_size=spec.block_size,
        distributed_executor_backend="uni",
        max_model_len=spec.max_model_len,
        max_num_seqs=16,
        max_num_batched_tokens=spec.max_batched_tokens or spec.max_model_len,
        enable_prefix_caching=True,
        kv_transfer_config=kv,
        kv_cache_dtype=spec.kv_cache_dtype,
        seed=0,
    )


def _connectors(llm: Any) -> dict[str, Any]:
    """The scheduler- and worker-side connector objects of an in-process engine."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    out: dict[str, Any] = {}
    core = getattr(llm.llm_engine, "engine_core", None)
    core = getattr(core, "engine_core", core)
    sched = getattr(getattr(core, "scheduler", None), "connector", None)
    if sched is not None:
        out["scheduler"] = sched
    if has_kv_transfer_group():
        out["worker"] = get_kv_transfer_group()
    return out


def _counters(connector: Any) -> dict[str, Any]:
    """A connector's ``stats`` and (benchmark) ``timings``, as one dict."""
    out: dict[str, Any] = {}
    for attr in ("stats", "timings"):
        obj = getattr(connector, attr, None)
        if obj is not None:
            out.update(obj.as_dict())
    return out


def _info(llm: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for side, c in _connectors(llm).items():
        ns = c.namespace
        facts: dict[str, Any] = {"namespace": [ns.model, ns.layout, ns.tenant]}
        paged = getattr(c, "paged", None)
        if paged is not None:
            facts["page"] = paged.page.name
            facts["isa"] = paged.page.name.split(":")[0]
        out[side] = facts
    return out


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            detokenize=False)  # fmt: skip
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)  # fmt: skip
    wall = time.perf_counter() - t0
    return [{"tokens": list(o.outputs[0].token_ids), "cached": int(o.num_cached_tokens or 0),
             "wall_s": wall} for o in outs]  # fmt: skip


def _serve(spec: EngineSpec) -> None:
    # The protocol keeps the original stdout; everything else printed (vLLM logs to
    # stdout) goes to stderr, which the parent sends to the log file.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def send(**msg: Any) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    t0 = time.perf_counter()
    # The slow part of a start (vllm's own imports are lazy), done while the parent holds us.
    import vllm.entrypoints.llm
    import vllm.v1.engine.core  # noqa: F401

    if spec.role is not None:
        importlib.import_module(spec.module_path)

    t1 = time.perf_counter()
    if json.loads(sys.stdin.readline() or "{}").get("op") != "start":
        return
    t2 = time.perf_counter()
    llm = _build_llm(spec)
    send(result={"import_s": t1 - t0, "held_s": t2 - t1, "build_s": time.perf_counter() - t2})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "quit":
                break
            if op == "generate":
                send(result=_generate(llm, cmd["prompts"], cmd["max_tokens"]))
            elif op == "fail_loads":
                _connectors(llm)["worker"].failing_loads = int(cmd["n"])
                send(result=True)
            elif op == "info":
                send(result=_info(llm))
            elif op == "reset":
                send(result=bool(llm.reset_prefix_cache()))
            elif op == "stats":
                conns = _connectors(llm)
                send(result={side: _counters(c) for side, c in conns.items()})
            else:
                send(error=f"unknown op {op!r}")
        except Exception as exc:  # report to the parent, keep serving
            send(error=f"{type(exc).__name__}: {exc}")
    for c in _connectors(llm).values():
        c.shutdown()


if __name__ == "__main__":
    _serve(EngineSpec(**json.loads(sys.argv[1])))
    sys.stderr.flush()
    # The engine holds no state worth a clean teardown, which takes seconds (gloo,
    # torch threads); a test child exits at once.
    os._exit(0)
