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

With ``--store-faults ROUNDS`` it runs tests/test_story_faults.py's story on an S3 API
server behind the fault proxy for that many rounds and writes its figures: requests
faulted by kind, calls that failed (each naming the store), ticks that recovered,
messages lost, indexed twice, effects applied twice.

    python bench/reliability.py [--kills 500] [--per-campaign 50] [--concurrency 300]
    python bench/reliability.py --kills 0 --store-faults 12
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
    "store-faults": ("<!-- store-faults:begin -->", "<!-- store-faults:end -->"),
}


def campaign(root: Path, seed: int, kills: int) -> dict:
    wh = root / f"campaign-{seed}"
    shutil.rmtree(wh, ignore_errors=True)
    clock = FakeClock()
    broker = Broker.init(wh, clock=clock)
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
    broker = Broker.init(wh, clock=clock)
    try:
        return run_concurrently(broker, clock, wh, seconds=seconds)
    finally:
        broker.close()


def store_faults(root: Path, rounds: int, seed: int) -> dict:
    """The story of tests/test_story_faults.py, longer: an S3 API server (moto) and the fault
    proxy started here, ``rounds`` rounds with faults (the second half with SIGKILLed
    ticks), then the faults stop and the loop catches up; the figures of both."""
    from conftest import S3_BUCKET
    from s3_emulator import s3_behind_proxy
    from support.store_faultload import RATES, StoreFaultLoad

    from deltamq import BrokerConfig

    started = time.monotonic()
    with s3_behind_proxy(root) as (options, faults):
        location = f"s3://{S3_BUCKET}/store-faults-{seed}/wh"
        clock = FakeClock()
        broker = Broker.init(location, clock=clock, config=BrokerConfig(storage_options=options))
        try:
            load = StoreFaultLoad(broker, clock, location, faults, S3_BUCKET, seed=seed)
            load.setup()
            faults.set(rates=RATES, seed=seed, reset_counters=True)
            for r in range(rounds):
                load.round(r, kill=r >= rounds // 2)
            during = faults.state()
            faults.off()
            drain_ticks = load.drain()
            quality = broker.check_quality()
            assert quality.success, [(f.suite, f.expectation) for f in quality.failures]
        finally:
            broker.close()
    f, s = load.figures, load.store
    return {
        "seed": seed,
        "rounds": rounds,
        "rates": RATES,
        "requests": during["requests"],
        "faulted": during["faulted"],
        "failed_calls": s.failed_calls,
        "failed_ticks": s.failed_ticks,
        "ticks_recovered": s.ticks_recovered,
        "failed_sends": s.failed_sends,
        "errors": s.errors[:20],
        "store_faults_retried": broker.engine.stats.store_faults_retried,
        "kills": f.kills,
        "messages": f.messages,
        "consumed": f.consumed,
        "sink_entries": s.sink_entries,
        "lost": f.lost,
        "indexed_twice": f.duplicate_offsets + f.duplicate_copies,
        "applied_twice": s.sink_twice,
        "unaccounted": f.unaccounted,
        "drain_ticks": drain_ticks,
        "quality": "passed",
        "wall_s": round(time.monotonic() - started),
    }


def store_faults_markdown(f: dict, name: str) -> str:
    faulted = ", ".join(f"{k} {v}" for k, v in f["faulted"].items())
    consumed = " / ".join(str(f["consumed"][g]) for g in ("push", "seq", "puller"))
    rows = [
        ("rounds (the second half with a SIGKILLed tick) / ticks killed", f"{f['rounds']} / {f['kills']}"),
        ("requests through the proxy while faults were on", f"{f['requests']:,}"),
        ("requests faulted, by kind", faulted),
        ("commit attempts re-run after a store fault (in-process broker)", f"{f['store_faults_retried']}"),
        ("calls that failed, each naming the store and the cause", f"{f['failed_calls']}"),
        ("ticks that failed and recovered when run again", f"{f['failed_ticks']} / {f['ticks_recovered']}"),
        ("sends that failed (their messages allowed, never required)", f"{f['failed_sends']}"),
        ("messages sent / consumed push, orderly, pull", f"{f['messages']:,} / {consumed}"),
        ("ticks to catch up once the faults stopped", f"{f['drain_ticks']}"),
        ("messages lost", f"**{f['lost']}**"),
        ("indexed twice (offsets or copies)", f"**{f['indexed_twice']}**"),
        ("effects applied twice in the sink", f"**{f['applied_twice']}** of {f['sink_entries']} entries"),
        ("data-quality suite", f["quality"]),
        ("wall time", f"{f['wall_s']} s"),
    ]
    lines = [
        f"`python bench/reliability.py --kills 0 --store-faults {f['rounds']}` — `bench/results/{name}`",
        "",
        "| figure | value |",
        "|---|---:|",
    ]
    return "\n".join(lines + [f"| {a} | {b} |" for a, b in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=500)
    ap.add_argument("--per-campaign", type=int, default=50)
    ap.add_argument("--seed", type=int, default=100, help="seed of the first campaign")
    ap.add_argument("--root", default="/tmp/deltamq-reliability")
    ap.add_argument("--concurrency", type=float, default=0, metavar="SECONDS")
    ap.add_argument(
        "--store-faults", type=int, default=0, metavar="ROUNDS", help="the story on S3 behind the fault proxy"
    )
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
    if args.store_faults:
        result["store_faults"] = store_faults(root, args.store_faults, args.seed)
        out.write_text(json.dumps(result, indent=2) + "\n")
        write_doc("store-faults", store_faults_markdown(result["store_faults"], out.name))
    print(f"wrote {out} and {DOC}")


if __name__ == "__main__":
    main()
