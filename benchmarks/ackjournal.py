"""What journaling an acknowledged upload costs an aggregator (``orchard.server.ackjournal``).

Per upload: :meth:`AckJournal.acked` (one JSON line, one ``write``, no fsync), against,
in the same run, an append of the same line followed by ``fsync`` (what a journal
durable across a host crash would pay per acknowledgement).

    python benchmarks/ackjournal.py --uploads 20000 --json benchmarks/results/ackjournal.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def measure(uploads: int, fsync_uploads: int) -> dict[str, float | int]:
    from orchard.files import open_append
    from orchard.messages import DroppedUpload
    from orchard.server.ackjournal import AckJournal

    up = DroppedUpload("run-0123456789ab", 12, 0, "client-000042", "t-0123456789abcdef0123")
    with tempfile.TemporaryDirectory(prefix="orchard-acks-") as d:
        j = AckJournal(Path(d) / "acks")
        t = time.perf_counter()
        for _ in range(uploads):
            j.acked("round", up.run_id, up.round, up.attempt, up)
        per_ack = (time.perf_counter() - t) / uploads
        j.forwarded("round")
        j.close()
        line = json.dumps({"a": [up.run_id, up.round, up.attempt, up.node_id, up.task_id]},
                          separators=(",", ":")) + "\n"
        with open_append(Path(d) / "synced.acks") as f:
            t = time.perf_counter()
            for _ in range(fsync_uploads):
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            per_synced = (time.perf_counter() - t) / fsync_uploads
    return {"uploads": uploads, "ack_us": round(per_ack * 1e6, 2), "fsynced_uploads": fsync_uploads,
            "ack_fsync_us": round(per_synced * 1e6, 2), "fsync_over_ack": round(per_synced / per_ack, 1),
            "load_average": round(os.getloadavg()[0], 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--uploads", type=int, default=20000)
    ap.add_argument("--fsync-uploads", type=int, default=500)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    out = measure(args.uploads, args.fsync_uploads)
    print(f"{'journal one acknowledged upload':<36}{out['ack_us']:>10.2f} µs")
    print(f"{'  the same, fsynced':<36}{out['ack_fsync_us']:>10.2f} µs  ({out['fsync_over_ack']}x)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
