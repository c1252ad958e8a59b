"""Reliability run: the fault-injection workload of tests/test_faults.py at scale.

Campaigns of ``--per-campaign`` kills, each on a fresh warehouse with its own seed:
rounds of a mixed workload (normal, delayed, timer, failing, orderly, transactional,
pull-consumed) whose tick subprocess is SIGKILLed at a crash point or a random time,
re-run and checked (conservation, no duplicate offsets, no copy written twice, every
message accounted for); then the clock runs on until everything is consumed and
nothing may be missing. Stops at the first failed check (a bug: the figures say where).
Writes bench/results/reliability-<timestamp>.json and the figures in docs/reliability.md.

With ``--concurrency SECONDS`` it also runs tests/test_concurrency.py's four tick runners,
producer and pull client for that long (30x accelerated clock) and writes their figures:
lease hand-overs, commit conflicts retried, the same checks (``--kills 0``: only that).

    python bench/reliability.py [--kills 500] [--per-campaign 50] [--concurrency 300]
    python bench/reliability.py --resume bench/results/reliability-<stamp>.json [...]
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

from support.faultload import FaultLoad  # noqa: E402

from deltamq import Broker, FakeClock  # noqa: E402

DOC = HERE.parent / "docs" / "reliability.md"
MARKERS = {
    "kills": ("<!-- reliability:begin -->", "<!-- reliability:end -->"),
    "concurrency": ("<!-- concurrency:begin -->", "<!-- concurrency:end -->"),
}


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
        f"`bench/results/{name}`, {len(result['campaigns'])} campaigns, {t['seconds'] / 60:.0f} min"
        + "".join(f", resumed {r[:16]}" for r in result.get("resumed", [])),
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


def concurrency_markdown(f: dict, name: str) -> str:
    rows = [
        ("wall time / broker time", f"{f['seconds']:.0f} s / {f['broker_minutes']} min"),
        ("tick runners (processes) / that ticked", f"{f['runners']} / {f['runners_that_ticked']}"),
        (
            "runner lives (each a new holder) / leases abandoned",
            f"{f['runner_lives']} / {f['abandoned_leases']}",
        ),
        ("ticks by the runners", f"{f['ticks']}"),
        ("lease hand-overs", f"**{f['lease_handovers']}**"),
        (
            "commit conflicts retried (all processes)",
            f"**{f['conflicts_retried']}** of {f['commits']} commits",
        ),
        ("jobs failed (fenced: a lease lost mid-tick)", f"{f['failed_jobs']}"),
        ("messages sent", f"{f['messages']:,}"),
        ("ticks to drain the backlog afterwards (10 broker minutes apart)", f"{f['drain_ticks']}"),
        (
            "consumed: push / orderly / pull group",
            " / ".join(f"{f['consumed'].get(g, 0):,}" for g in ("push", "seq", "puller")),
        ),
        (
            "lost / copies twice / in no state",
            f"**{f['lost']} / {f['duplicate_copies']} / {f['unaccounted']}**",
        ),
    ]
    head = f"`python bench/reliability.py --concurrency {f['seconds']:.0f}` — `bench/results/{name}`"
    return "\n".join([head, "", "| figure | value |", "|---|---:|", *(f"| {k} | {v} |" for k, v in rows)])


def write_doc(part: str, body: str) -> None:
    begin, end = MARKERS[part]
    text = DOC.read_text()
    if begin not in text:
        text += f"\n{begin}\n{end}\n"
    DOC.write_text(text[: text.index(begin)] + f"{begin}\n{body}\n{end}" + text[text.index(end) + len(end) :])


def concurrency(root: Path, seconds: float) -> dict:
    from test_concurrency import run_concurrently

    wh = root / "concurrency"
    shutil.rmtree(wh, ignore_errors=True)
    clock = FakeClock()
    broker = Broker.open(wh, clock=clock)
    try:
        return run_concurrently(broker, clock, wh, seconds=seconds)
    finally:
        broker.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=500)
    ap.add_argument("--per-campaign", type=int, default=50)
    ap.add_argument("--seed", type=int, default=100, help="seed of the first campaign")
    ap.add_argument("--root", default="/tmp/deltamq-reliability")
    ap.add_argument("--concurrency", type=float, default=0, metavar="SECONDS")
    ap.add_argument(
        "--resume", type=Path, help="continue the run of this result file (its campaigns count to --kills)"
    )
    args = ap.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = HERE / "results" / f"reliability-{stamp}.json"
    result = {
        "bench": "reliability",
        "at": datetime.now(UTC).isoformat(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "campaigns": [],
    }
    seed, wall_before = args.seed, 0
    if args.resume:  # campaigns are independent (own warehouse and seed): a run may span sessions
        out, result = args.resume, json.loads(args.resume.read_text())
        if any(c["error"] for c in result["campaigns"]):
            raise SystemExit(f"{out} stopped on a failed check; look at it rather than resume it")
        seed = max((c["seed"] for c in result["campaigns"]), default=args.seed - 1) + 1
        wall_before = result.get("wall_s", 0)
        result.setdefault("resumed", []).append(datetime.now(UTC).isoformat())
    started = time.monotonic() - wall_before
    while sum(c["kills"] for c in result["campaigns"]) < args.kills:
        left = args.kills - sum(c["kills"] for c in result["campaigns"])
        c = campaign(root, seed, min(args.per_campaign, left))
        result["campaigns"].append(c)
        result["totals"] = totals(result["campaigns"])
        result["wall_s"] = round(time.monotonic() - started)
        out.write_text(json.dumps(result, indent=2) + "\n")
        write_doc("kills", markdown(result, out.name))
        print(
            json.dumps({k: c[k] for k in ("seed", "kills", "rounds", "messages", "lost", "error")}),
            flush=True,
        )
        if c["error"]:
            break
        seed += 1
    if args.concurrency:
        result["concurrency"] = concurrency(root, args.concurrency)
        out.write_text(json.dumps(result, indent=2) + "\n")
        write_doc("concurrency", concurrency_markdown(result["concurrency"], out.name))
    print(f"wrote {out} and {DOC}")


if __name__ == "__main__":
    main()
