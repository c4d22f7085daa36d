"""``python -m asymstore.fsck LOCATION [--deep] [--repair] [--json]``.

LOCATION is any tier location a store takes: a directory (``LocalTier``,
``NVMeTier``, ``host_tier(path=...)``, a multi-rank root), or a URI
(``file:///path``, ``s3://bucket/prefix?endpoint_override=...``,
``hdfs://namenode:port/path``). ``--repair`` implies ``--deep``: it acts on
everything a deep check finds, flipped bytes included.

Exit status: 0 when every version verifies and LATEST is right (after
``--repair``, when the repaired root does), 1 when problems were found,
2 on a usage error (bad arguments, LOCATION not a tier root), when
``--repair`` finds a live writer holding the root, or when it refused to
touch a multi-rank version whose shards it cannot see from here
(``unreachable``; the reasons go to stderr). ``--node-local PATH...`` checks
(and repairs) only the shards one node of a multi-rank job holds under PATH.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from asymstore.errors import RootLockedError
from asymstore.fsck import FsckReport, check, repair


def _progress_factory(enabled: bool) -> Callable[[int], Callable[[int], None]] | None:
    if not enabled:
        return None

    def make(total: int) -> Callable[[int], None]:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="verifying", file=sys.stderr, leave=False)

        def update(n: int) -> None:
            bar.update(n)

        return update

    return make


def _print_text(report: FsckReport) -> None:
    print(f"root: {report.root}{'  (deep)' if report.deep else ''}")
    for e in report.entries:
        step = "-" if e.step is None else str(e.step)
        print(f"  {e.status:<11} step {step:>8}  {e.name}  {e.nbytes} B")
        for p in e.problems:
            print(f"      problem: {p}")
    print(f"LATEST: {report.latest}" + (f"  problem: {report.latest_problem}" if report.latest_problem else ""))
    print(f"newest restorable: {report.newest_restorable}")
    if report.layout is not None:
        record = "recorded" if report.layout_record is not None else "not recorded"
        print(f"layout: {report.layout} ({record})")
    for p in report.layout_problems:
        print(f"  layout problem: {p}")
    for a in report.repaired:
        print(f"repaired: {a}")
    print("verdict: " + ("OK" if report.ok else f"{len(report.problems)} problem(s)"))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checker; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m asymstore.fsck", description=__doc__.splitlines()[0])
    parser.add_argument("root", metavar="LOCATION", help="a tier's directory, or a file://, s3:// or hdfs:// URI")
    parser.add_argument("--deep", action="store_true", help="verify every checksum (reads all data)")
    parser.add_argument("--repair", action="store_true", help="(implies --deep) remove partial/orphaned data, "
                        "quarantine corrupt versions, fix LATEST; never touches a committed version that verifies")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (schema in docs/guides/fsck.md)")
    parser.add_argument("--node-local", nargs="+", default=[], metavar="PATH",
                        help="multi-rank root: check only the shards this node holds under these paths")
    args = parser.parse_args(argv)
    args.deep = args.deep or args.repair
    progress = _progress_factory(args.deep and not args.json and sys.stderr.isatty())
    try:
        report = check(args.root, deep=args.deep, progress=progress, node_local=args.node_local)
    except (FileNotFoundError, ValueError, OSError) as exc:
        print(f"fsck: {exc}", file=sys.stderr)
        return 2
    refused: list[str] = []
    if args.repair and not report.ok:
        refused = list(getattr(report, "refused", []))
        try:
            actions = repair(report)
        except RootLockedError as exc:
            print(f"fsck: not repairing: {exc}", file=sys.stderr)
            return 2
        report = check(args.root, deep=args.deep, progress=progress, node_local=args.node_local)
        report.repaired = actions
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        _print_text(report)
    for line in refused:
        print(f"fsck: refused: {line}", file=sys.stderr)
    if refused:
        return 2
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
