"""Can one tenant starve another by dribbling puts? (issue 17, attack 3)

Against a real ``kvstore serve`` on 127.0.0.1 (4 MiB DRAM, 256 MiB SSD, default
deadlines: io_timeout_s 30, put_grace_s 5, put_floor_bytes 1 MiB/s), tenant A keeps
``--dribblers`` raw data connections open, each authenticated and in the middle of a
PUT of one 256 KiB block whose payload comes at 1 byte a second (6 MiB claimed in all,
more than DRAM); a connection the server cuts is opened again at once, as an attacker
would. Meanwhile tenant B puts a new 256 KiB block every 0.5 s with the SDK. The tokens
file gives A ``reservations = 4, dram = "2MiB"`` (a server without quotas ignores it;
``--no-quotas`` leaves it out, to see what stall expiry alone does).

Printed: B's puts stored out of tried (and the errors of the rest), and how long the
server let A's connections hold their puts, in two groups: cut in under 20 s (a
reservation expired: put_grace_s + nbytes / put_floor_bytes) and cut later (a put that
was refused and only keeps its connection until the frame's io_timeout_s, or, without
stall expiry, a reservation held that long).

    python benchmarks/bench_dribble.py [--seconds 40] [--no-quotas]
    # the same attack on another checkout's server (its kvstore comes first on the path
    # of the server process, since ``python -m`` puts the working directory first):
    cd /path/to/old/checkout && python /path/to/this/benchmarks/bench_dribble.py
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore import Namespace, StoreClient, prefix_keys
from kvstore._proto import store_pb2 as pb
from kvstore.blocks import checksum, describe
from kvstore.errors import KVStoreError
from kvstore.wire.codec import meta_of
from kvstore.wire.frames import HEADER, MAGIC, PROTOCOL, FrameSocket, Op
from tests.support.server_process import ALPHA, BRAVO, ServerProcess, base_flags, write_tokens

MODEL, LAYOUT = "m", "float32:L1:H1:D128:B256"
VALUE = np.ones((1, 2, 1, 256, 128), dtype=np.float32)  # 256 KiB
QUOTAS = '\n[quotas.alpha]\nreservations = 4\ndram = "2MiB"\n'


class Dribbler:
    """One of A's connections: HELLO, then a PUT whose payload comes a byte a second;
    reopened when the server cuts it. Records how long each one lived."""

    def __init__(self, port: int, keys: list[bytes]) -> None:
        self.port = port
        self.keys = keys
        self.lifetimes: list[float] = []
        self.sock: socket.socket | None = None
        self.started = 0.0

    def open(self) -> None:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        fs = FrameSocket(sock, max_meta=1 << 20)
        fs.set_timeout(10)
        fs.send(Op.HELLO, pb.Hello(token=ALPHA.token, protocol=PROTOCOL).SerializeToString())
        _, meta_len, _ = fs.recv_header()
        fs.recv_bytes(meta_len)
        item = pb.PutItem(key=self.keys.pop(), meta=meta_of(describe(VALUE)))
        item.checksum = checksum(VALUE)
        req = pb.PutRequest(scope=pb.Scope(model=MODEL, layout=LAYOUT), items=[item])
        meta = req.SerializeToString()
        sock.sendall(HEADER.pack(MAGIC, Op.PUT, 0, len(meta), VALUE.nbytes) + meta)
        sock.setblocking(False)
        self.sock, self.started = sock, time.monotonic()

    def tick(self) -> None:
        """Send one byte; notice a cut (EOF or reset) and reopen."""
        assert self.sock is not None
        cut = False
        try:
            while True:
                if self.sock.recv(1 << 16) == b"":
                    cut = True
                    break
        except BlockingIOError:
            pass
        except OSError:
            cut = True
        if not cut:
            try:
                self.sock.send(b"\x01")
            except BlockingIOError:
                pass
            except OSError:
                cut = True
        if cut:
            self.lifetimes.append(time.monotonic() - self.started)
            self.sock.close()
            self.open()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


def attack(server: ServerProcess, seconds: float, dribblers: int) -> None:
    a_ns, b_ns = Namespace(MODEL, LAYOUT, ALPHA.tenant), Namespace(MODEL, LAYOUT, BRAVO.tenant)
    a_keys = list(prefix_keys(list(range(4000 * 256)), 256, a_ns))
    b_keys = list(prefix_keys(list(range(400 * 256)), 256, b_ns))
    drib = [Dribbler(server.data_port, a_keys) for _ in range(dribblers)]
    for d in drib:
        d.open()
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(1.0):
            for d in drib:
                d.tick()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(1.0)  # A's puts are in
    ok, errors = 0, Counter[str]()
    tried = 0
    with StoreClient.connect(
        server.address, token=BRAVO.token, namespace=b_ns, transport="tcp", timeout_s=5
    ) as b:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            tried += 1
            try:
                ok += bool(b.put(b_keys[tried], VALUE))
            except KVStoreError as exc:
                errors[f"{exc.code}: {str(exc)[:70]}"] += 1
            time.sleep(0.5)
    stop.set()
    t.join(10)
    for d in drib:
        d.close()
    lives = [x for d in drib for x in d.lifetimes]
    short = [x for x in lives if x < 20]
    long_ = [x for x in lives if x >= 20]
    print(f"B's puts stored: {ok}/{tried} over {seconds:.0f} s; errors: {dict(errors)}")
    for name, group in (("cut < 20 s", short), ("cut >= 20 s", long_)):
        if group:
            print(
                f"A's connections {name}: {len(group)}, lived median "
                f"{statistics.median(group):.1f} s, max {max(group):.1f} s"
            )
        else:
            print(f"A's connections {name}: none")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--dribblers", type=int, default=24)
    ap.add_argument("--no-quotas", action="store_true", help="leave A without a quota")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wd = Path(tmp)
        tokens = write_tokens(wd / "quota-tokens.toml")  # base_flags writes tokens.toml
        if not args.no_quotas:
            tokens.write_text(tokens.read_text() + QUOTAS)
        flags = {**base_flags(wd), "tokens_file": tokens, "dram_bytes": "4MiB"}
        server = ServerProcess(wd, flags).start()
        print(f"server: kvstore from {os.getcwd()}, pid {server.pid}")
        try:
            attack(server, args.seconds, args.dribblers)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
