"""Generate the committed gRPC stubs in ``orchard/v1`` from ``proto/orchard/v1/*.proto``.

Run ``make proto`` (or ``python -m orchard.protogen``) after editing the .proto; the test
suite regenerates into a temporary folder and fails if the committed stubs are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
PROTO_FILES = ["orchard/v1/orchard.proto"]
GENERATED = ["orchard/v1/orchard_pb2.py", "orchard/v1/orchard_pb2.pyi", "orchard/v1/orchard_pb2_grpc.py"]


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *[str(PROTO_ROOT / f) for f in PROTO_FILES]]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO)
    print("generated:", ", ".join(GENERATED))
