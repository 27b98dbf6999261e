"""Print the stored end-to-end scenario results: each timeline, then the table.

    .venv/bin/python tests/e2e/report.py                  # every stored scenario
    .venv/bin/python tests/e2e/report.py --scenarios a,b,c --no-timelines

Results are written by tests/e2e/test_incident.py to $GPUGUARD_E2E_CACHE/results/ (default
/var/cache/gpuguard-e2e/results/), one JSON file per release and scenario; `make demo` runs
scenarios (a)-(c) and then this. See docs/e2e.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Run as a script: make tests/ importable, where the harness lives as `e2e.*`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fakenvml"))

from e2e.measure import load_results, render_report, results_dir


def main(argv: list[str] | None = None) -> int:
    """Print the report; exit 1 when there is nothing to print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", help="comma-separated letters, e.g. a,b,c (default: all)")
    parser.add_argument(
        "--releases",
        default=os.environ.get("GPUGUARD_E2E_RELEASES", "bookworm"),
        help="comma-separated releases (default: $GPUGUARD_E2E_RELEASES or bookworm; 'all')",
    )
    parser.add_argument("--no-timelines", action="store_true", help="only the table")
    args = parser.parse_args(argv)
    wanted = args.scenarios.split(",") if args.scenarios else None
    releases = None if args.releases == "all" else set(args.releases.split(","))
    results = [r for r in load_results(wanted) if releases is None or r.get("release") in releases]
    if not results:
        sys.stderr.write(f"no scenario results in {results_dir()} (run `make demo` as root)\n")
        return 1
    lines = render_report(results, timelines=not args.no_timelines)
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
