"""The caller's CUDA streams and inference mode, carried to the threads that run parts
of its call.

Why: a copy batch is ordered after the work its caller queued on its *current* CUDA
stream (engine.py, ``begin(after_caller=True)``): a put from a tensor an engine is
still writing on a side stream copies it only once it is written. But a call split
over shards or nodes runs its parts on pool threads (kvstore/client/fanout.py), and an
async client's calls run on its executor (kvstore/client/store.py); a pool thread's
current stream is each device's default stream, not the caller's, and its current
device is device 0. So the caller's state is captured on the calling thread
(:func:`capture`) and each part runs under it (:func:`as_caller`):

- **device and streams**: the caller's current device, entered first with
  ``torch.cuda.device`` (whose exit restores the pool thread's device without making
  it current where it has no context: a stream context's exit alone would set device 0
  current, creating a context there on a cuda:1 worker), then the current stream of
  every device on which the caller made a non-default stream current, and of its own
  device last, so a bare ``"cuda"`` names the same device on the pool thread. Devices
  the caller never touched are not touched here;
- **inference mode**: an engine's forward runs under ``torch.inference_mode()``, and
  the tensors it allocates there (the KV a prefill loads a prefix into) are inference
  tensors, which torch lets only a thread in inference mode update in place. A pool
  thread landing the caller's blocks in them with ``Tensor.copy_`` (every CUDA copy)
  therefore enters inference mode when the caller was in it. (The copies' flat byte
  views escape that check today only because torch 2.13 makes a dtype view of an
  inference tensor, taken outside inference mode, a normal tensor: not a contract.)

Nothing happens, and torch is not imported, in a process that has not imported it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["Caller", "as_caller", "capture", "with_caller"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Caller:
    """What a pool thread must share with the thread whose call it runs a part of."""

    inference: bool
    device: int | None  # the caller's current CUDA device (None: CUDA not started)
    streams: tuple[Any, ...]  # CUDA streams to make current, the caller's device's last


def _streams(torch: Any, here: int) -> tuple[Any, ...]:
    """The caller's current CUDA streams worth carrying (see the module docstring)."""
    others = []
    for i in range(torch.cuda.device_count()):
        if i == here:
            continue
        s = torch.cuda.current_stream(i)  # reads state: no context is made
        if s != torch.cuda.default_stream(i):
            others.append(s)
    return (*others, torch.cuda.current_stream(here))


def capture() -> Caller | None:
    """The calling thread's state to carry, or None when there is none (torch not
    imported, or no CUDA and no inference mode: a part then runs as it is)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    inference = bool(torch.is_inference_mode_enabled())
    if not torch.cuda.is_initialized():
        return Caller(inference, None, ()) if inference else None
    here = torch.cuda.current_device()
    return Caller(inference, here, _streams(torch, here))


@contextlib.contextmanager
def as_caller(caller: Caller | None) -> Iterator[None]:
    """Run the body under ``caller``'s streams and inference mode (from :func:`capture`)."""
    if caller is None:
        yield
        return
    torch = sys.modules["torch"]
    with contextlib.ExitStack() as stack:
        if caller.inference:
            stack.enter_context(torch.inference_mode())
        if caller.device is not None:
            stack.enter_context(torch.cuda.device(caller.device))
        for stream in caller.streams:
            stack.enter_context(torch.cuda.stream(stream))
        yield


def with_caller(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn``, to run on another thread as the thread here and now would."""
    caller = capture()
    if caller is None:
        return fn

    def run() -> T:
        with as_caller(caller):
            return fn()

    return run
