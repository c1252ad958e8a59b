"""One pass of 1M x 1 KiB with the send by ``send_arrow`` (rows in memory) against
``send_dataframe``, alternated, each listener kind: the spread of the one-pass figures
(issue 33). Writes ``bench/results/arrow-pass-<timestamp>.json``. A benchmark, not a test."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from pathlib import Path

import run

HERE = Path(__file__).parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--root", default="/tmp/deltamq-bench-arrow")
    args = ap.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    keys = (
        "send_s",
        "dispatch_s",
        "deliver_s",
        "end_to_end_msgs_per_s",
        "parquet_floor_s",
        "end_to_end_vs_floor",
    )
    runs = []
    for r in range(args.rounds):
        for listener in ("ok", "ok_columnar"):
            for send in ("dataframe", "arrow"):
                e = run.end_to_end(root, args.messages, listener, idle_ticks=0, send=send)
                row = {"round": r, "listener": listener, "send": send, **{k: e[k] for k in keys}}
                row["arrow_read_s"] = e["arrow_read_s"]
                row["parquet_floor_writes_s"] = e["parquet_floor_writes_s"]
                print(json.dumps(row), flush=True)
                runs.append(row)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = {
        "bench": "arrow_pass",
        "at": datetime.now(UTC).isoformat(),
        "messages": args.messages,
        "runs": runs,
    }
    (HERE / "results" / f"arrow-pass-{stamp}.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
