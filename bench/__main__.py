"""Run the benchmark suite: `python -m bench` (full, about 11 minutes on 2
cores), `python -m bench --quick` (every benchmark at tiny sizes, about two
minutes, most of it valgrind starting Python; checks the harness, says
nothing about speed), `python -m bench --instructions` (the request path
counted by callgrind, merged into the published results) and
`python -m bench --report` (write docs/performance.md from
bench/results/latest.json without measuring anything). `--peers` adds the
peers side by side (idemkit, Powertools; `pip install -e '.[bench]'`)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from . import (
    asgi,
    contention,
    cycle,
    group_commit,
    growth,
    inflight,
    instructions,
    memory,
    middleware,
    mysql,
    peers,
    postgres,
    renewal,
    report,
    sweep,
)
from .common import LATEST, PAGE, Context, filesystem_of, machine_info

# Order matters: sweep drains the 10^6-row file that growth built.
BENCHMARKS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "cycle": cycle.run,
    "middleware": middleware.run,
    "contention": contention.run,
    "growth": growth.run,
    "sweep": sweep.run,
    "memory": memory.run,
    "postgres": postgres.run,
    "mysql": mysql.run,
    "asgi": asgi.run,
    "group_commit": group_commit.run,
    "instructions": instructions.run,
    # Optional: runs only with --peers (or --only peers), since it needs the peers installed.
    "peers": peers.run,
    # ASGI + PostgreSQL with 1, 10 and 50 requests in flight, beside idemkit when installed.
    "inflight": inflight.run,
    # A lease renewal tick against ledger size on every engine (also: python -m bench.renewal).
    "renewal": renewal.run,
}
OPTIONAL = {"peers", "inflight", "renewal"}


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that the harness works, nothing else")
    p.add_argument("--report", action="store_true", help="only write the performance page (--page) from --out")
    p.add_argument(
        "--instructions",
        action="store_true",
        help="only the instruction counts (valgrind callgrind), merged into --out and rendered into --page",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the other benchmarks already in --out and replace only those run now (each keeps its own stamp)",
    )
    p.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    p.add_argument(
        "--peers",
        action="store_true",
        help="also run the peers side by side (idemkit, Powertools; pip install -e '.[bench]'), "
        "in addition to whatever --only selects",
    )
    p.add_argument(
        "--dir",
        default=os.environ.get("IDEMCTL_BENCH_DIR"),
        help="where the database files go (default: a new directory under the system temp dir); "
        "must be the file system the ledger would live on",
    )
    p.add_argument(
        "--out", default=None, help=f"results JSON (default: {os.path.relpath(LATEST)}; --quick: inside --dir)"
    )
    p.add_argument("--page", default=PAGE, help=f"page that --report writes (default: {os.path.relpath(PAGE)})")
    p.add_argument("--conditions", default="", help="free text about the run's conditions, stored with the results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    out_path = args.out or LATEST
    if args.report:
        with open(out_path, encoding="utf-8") as f:
            results: dict[str, Any] = json.load(f)  # what a run wrote: the results' JSON object
        report.write_page(args.page, results)
        print(f"rendered {os.path.relpath(out_path)} into {os.path.relpath(args.page)}")
        return 0

    only = {n.strip() for n in args.only.split(",") if n.strip()}
    if args.instructions:
        only, args.merge = only | {"instructions"}, True
    unknown = only - set(BENCHMARKS)
    if unknown:
        print(
            f"unknown benchmark(s): {', '.join(sorted(unknown))}; choose from {', '.join(BENCHMARKS)}", file=sys.stderr
        )
        return 2
    created = args.dir is None
    workdir = tempfile.mkdtemp(prefix="idemctl-bench-") if created else args.dir
    os.makedirs(workdir, exist_ok=True)
    if args.quick and args.out is None:
        out_path = os.path.join(workdir, "quick.json")

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)

    fs = filesystem_of(workdir)
    if fs["type"] in ("tmpfs", "ramfs", "overlay") and not args.quick:
        log(f"WARNING: {workdir} is on {fs['type']}: fsync costs nothing there, figures will not match a disk")
    ctx = Context(workdir=workdir, quick=args.quick, log=log)
    results = {
        "quick": args.quick,
        "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(workdir),
        "conditions": args.conditions,
        "benchmarks": {},
    }
    failed = []
    t_all = time.perf_counter()
    selected = [
        name
        for name in BENCHMARKS
        if (name in only if only else name not in OPTIONAL) or (args.peers and name == "peers")
    ]
    for name in selected:
        fn = BENCHMARKS[name]
        t0 = time.perf_counter()
        log(f"[{name}] start")
        try:
            res = fn(ctx)
        except Exception as exc:  # one broken benchmark must not hide the others' results
            traceback.print_exc()
            res = {"error": f"{type(exc).__name__}: {exc}"}
            failed.append(name)
        res["elapsed_s"] = round(time.perf_counter() - t0, 1)
        if args.merge:
            # Measured apart from the run the rest of the file holds: the page says when and where.
            res["measured"] = {
                "started_utc": datetime.fromtimestamp(time.time() - res["elapsed_s"], UTC).isoformat(
                    timespec="seconds"
                ),
                "commit": results["machine"]["commit"],
                "loadavg": os.getloadavg(),
                "conditions": args.conditions,
            }
        results["benchmarks"][name] = res
        log(f"[{name}] {'FAILED' if name in failed else 'done'} in {res['elapsed_s']} s")
    results["finished_utc"] = datetime.now(UTC).isoformat(timespec="seconds")
    results["elapsed_s"] = round(time.perf_counter() - t_all, 1)
    results["machine"]["loadavg_end"] = os.getloadavg()
    if args.merge and os.path.exists(out_path):
        with open(out_path, encoding="utf-8") as f:
            published: dict[str, Any] = json.load(f)
        published["benchmarks"].update(results["benchmarks"])
        results = published
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, sort_keys=False)
        f.write("\n")
    print(report.render(results))
    if args.merge and not args.quick:
        report.write_page(args.page, results)
    log(f"results written to {out_path} ({round(time.perf_counter() - t_all, 1)} s in all)")
    if created and not args.quick:
        shutil.rmtree(workdir, ignore_errors=True)
    elif created:
        for entry in os.listdir(workdir):
            if entry != "quick.json":
                with_suppress_remove(os.path.join(workdir, entry))
    if failed:
        log(f"FAILED: {', '.join(failed)}")
        return 1
    return 0


def with_suppress_remove(path: str) -> None:
    try:
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
