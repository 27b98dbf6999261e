"""``gpuguard doctor``: gather each unit's facts, judge them, print findings or a fix."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

    from gpuguard.config import Settings


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Audit each unit; print findings, JSON or the fixing drop-in; exit with the worst level."""
    from gpuguard.adapters import doctorio, inventory  # noqa: PLC0415 - see the package doc
    from gpuguard.core import doctor  # noqa: PLC0415 - see the package doc

    units = [args.unit] if args.unit else list(settings.units)
    found = inventory.gather(settings)
    facts = {
        u: doctorio.gather_unit(u, settings, found)
        for u in dict.fromkeys([*units, *settings.units])
    }
    host = doctorio.host_facts(settings, found)
    results = {
        unit: doctor.diagnose(
            facts[unit], {o: f for o, f in facts.items() if o != unit and o in settings.units}, host
        )
        for unit in units
    }
    if args.json:
        sys.stdout.write(json.dumps(doctor.render_json(results), indent=2) + "\n")
    elif args.fix:
        sys.stdout.write("\n".join(doctor.render_fix(u, f) for u, f in results.items()))
    else:
        sys.stdout.write(doctor.render_text(results))
    return int(doctor.worst(f for findings in results.values() for f in findings))
