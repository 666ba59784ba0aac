"""Generate kvstore/_proto/ from proto/kvstore/v1/store.proto (``make proto``).

One command, reproducible: ``python scripts/gen_proto.py [--out DIR]``. protoc names
modules after the proto path (``kvstore.v1.store_pb2``); the files are moved flat into
``kvstore/_proto`` and the one absolute import between them is made package-relative, so
the package works wherever it is installed. The descriptor keeps the unique file name
``kvstore/v1/store.proto`` (never ``rpc.proto``, which aetcd registers).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO = "kvstore/v1/store.proto"
OUT = ROOT / "kvstore" / "_proto"
GENERATED = ("store_pb2.py", "store_pb2.pyi", "store_pb2_grpc.py")


def generate(out: Path) -> list[Path]:
    """Run protoc into a temp dir, fix imports, write the files into ``out``."""
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO_ROOT / PROTO),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        written = []
        for name in GENERATED:
            text = (Path(tmp) / "kvstore" / "v1" / name).read_text()
            text = re.sub(r"^from kvstore\.v1 import ", "from . import ", text, flags=re.M)
            dst = out / name
            dst.write_text(text)
            written.append(dst)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="output package directory")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out.parent) if args.out == OUT else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
