"""Reliability run: the fault-injection workload of tests/test_faults.py at scale.

Campaigns of ``--per-campaign`` kills, each on a fresh warehouse with its own seed:
rounds of a mixed workload (normal, delayed, timer, failing, orderly, transactional,
pull-consumed) whose tick subprocess is SIGKILLed at a crash point or a random time,
re-run and checked (conservation, no duplicate offsets, no copy written twice, every
message accounted for); then the clock runs on until everything is consumed and
nothing may be missing. Stops at the first failed check (a bug: the figures say where).
Writes bench/results/reliability-<timestamp>.json and the figures in docs/reliability.md.

    python bench/reliability.py [--kills 500] [--per-campaign 50]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))
os.environ.setdefault("RUST_LOG", "error")

from faultload import FaultLoad  # noqa: E402

from deltamq import Broker, FakeClock  # noqa: E402

DOC = HERE.parent / "docs" / "reliability.md"
BEGIN, END = "<!-- reliability:begin -->", "<!-- reliability:end -->"


def campaign(root: Path, seed: int, kills: int) -> dict:
    wh = root / f"campaign-{seed}"
    shutil.rmtree(wh, ignore_errors=True)
    clock = FakeClock()
    broker = Broker.open(wh, clock=clock)
    load = FaultLoad(broker, clock, wh, seed=seed)
    load.setup()
    error = None
    try:
        r = 0
        while load.figures.kills < kills:
            if r >= 3 * kills:
                raise AssertionError(f"only {load.figures.kills} kills in {r} rounds")
            load.round(r)
            r += 1
        load.drain()
    except Exception as e:  # noqa: BLE001 - a failed check or a failed tick: recorded, the run stops
        error = "".join(traceback.format_exception_only(type(e), e)).strip()[:2000]
    broker.close()
    if error is None:
        shutil.rmtree(wh, ignore_errors=True)  # a failed campaign's warehouse is kept to look at
    return {"seed": seed, "error": error, "warehouse": str(wh) if error else None, **asdict(load.figures)}


def totals(campaigns: list[dict]) -> dict:
    keys = (
        "rounds",
        "kills",
        "kills_at_points",
        "kills_at_random",
        "messages",
        "transactions",
        "lost",
        "duplicate_copies",
        "duplicate_offsets",
        "unaccounted",
        "conflicts_retried",
        "seconds",
    )
    out = {k: sum(c[k] for c in campaigns) for k in keys}
    out["consumed"] = {g: sum(c["consumed"].get(g, 0) for c in campaigns) for g in ("push", "seq", "puller")}
    out["failed_campaigns"] = sum(1 for c in campaigns if c["error"])
    return out


def markdown(result: dict, name: str) -> str:
    t = result["totals"]
    lines = [
        f"`python bench/reliability.py --kills {result['args']['kills']}` — {result['at'][:10]}, "
        f"`bench/results/{name}`, {len(result['campaigns'])} campaigns, {t['seconds'] / 60:.0f} min",
        "",
        "| figure | value |",
        "|---|---:|",
        f"| ticks killed | **{t['kills']:,}** ({t['kills_at_points']} at a crash point, "
        f"{t['kills_at_random']} at a random time) |",
        f"| rounds (a tick killed or not, re-run, checked) | {t['rounds']:,} |",
        f"| messages sent | {t['messages']:,} (of them {t['transactions']:,} transactional) |",
        f"| consumed: push / orderly / pull group | {t['consumed']['push']:,} / {t['consumed']['seq']:,} "
        f"/ {t['consumed']['puller']:,} |",
        f"| lost | **{t['lost']}** |",
        f"| copies written twice (promoted, retried) | **{t['duplicate_copies']}** |",
        f"| queue offsets used twice | **{t['duplicate_offsets']}** |",
        f"| messages in no state (accounting) | **{t['unaccounted']}** |",
        f"| commit conflicts retried (checking process) | {t['conflicts_retried']} |",
        f"| failed campaigns | {t['failed_campaigns']} |",
    ]
    for c in result["campaigns"]:
        if c["error"]:
            lines.append(
                f"\nCampaign seed {c['seed']} failed: `{c['error'][:300]}` (warehouse {c['warehouse']})"
            )
    return "\n".join(lines)


def write_doc(result: dict, name: str) -> None:
    text = DOC.read_text() if DOC.exists() else f"# Reliability\n\n{BEGIN}\n{END}\n"
    block = f"{BEGIN}\n{markdown(result, name)}\n{END}"
    DOC.write_text(text[: text.index(BEGIN)] + block + text[text.index(END) + len(END) :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=500)
    ap.add_argument("--per-campaign", type=int, default=50)
    ap.add_argument("--seed", type=int, default=100, help="seed of the first campaign")
    ap.add_argument("--root", default="/tmp/deltamq-reliability")
    args = ap.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = HERE / "results" / f"reliability-{stamp}.json"
    result = {
        "bench": "reliability",
        "at": datetime.now(UTC).isoformat(),
        "args": vars(args),
        "campaigns": [],
    }
    started = time.monotonic()
    seed = args.seed
    while sum(c["kills"] for c in result["campaigns"]) < args.kills:
        left = args.kills - sum(c["kills"] for c in result["campaigns"])
        c = campaign(root, seed, min(args.per_campaign, left))
        result["campaigns"].append(c)
        result["totals"] = totals(result["campaigns"])
        result["wall_s"] = round(time.monotonic() - started)
        out.write_text(json.dumps(result, indent=2) + "\n")
        write_doc(result, out.name)
        print(
            json.dumps({k: c[k] for k in ("seed", "kills", "rounds", "messages", "lost", "error")}),
            flush=True,
        )
        if c["error"]:
            break
        seed += 1
    print(f"wrote {out} and {DOC}")


if __name__ == "__main__":
    main()
