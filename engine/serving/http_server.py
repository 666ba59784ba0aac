"""The one way the serving commands (``kvstore worker``, ``router``, ``vllm-router``) listen:
bind a socket, serve an ASGI app on it with uvicorn, and print one JSON ready line once
it accepts requests, so a script or ``kvstore up`` can wait for it."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

__all__ = ["bind", "serve_app"]


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (0: a free port), inheritable by children."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve_app(app: Any, sock: socket.socket, ready: dict[str, Any]) -> None:
    """Serve ``app`` on ``sock`` until SIGTERM / SIGINT; print ``ready`` as one JSON line
    once the server has started."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            print(json.dumps(ready), flush=True)
        await task

    asyncio.run(serve())
