"""``gpuguard doctor``: gather each unit's facts, judge them, print findings or a fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuguard.adapters import doctorio, inventory
from gpuguard.commands.context import unknown_unit
from gpuguard.core import doctor

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gpuguard.commands.arguments import DoctorArgs
    from gpuguard.commands.output import Said
    from gpuguard.config import Settings
    from gpuguard.core.doctor import Finding


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """Each audited unit's findings; printed as findings, as JSON, or as the fixing drop-in."""

    findings: Mapping[str, tuple[Finding, ...]]
    fix: bool
    """--fix: the text is the drop-in that fixes the findings."""

    @property
    def exit_status(self) -> int:
        """The worst finding: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN."""
        return int(doctor.worst(f for found in self.findings.values() for f in found))

    @property
    def notices(self) -> tuple[str, ...]:
        """Nothing for standard error: every finding is in the text."""
        return ()

    def to_text(self) -> str:
        """The findings with their evidence, or (--fix) one drop-in per unit."""
        if self.fix:
            return "\n".join(doctor.render_fix(u, f) for u, f in self.findings.items())
        return doctor.render_text(self.findings)

    def to_json(self) -> dict[str, Any]:
        """``doctor --json`` (docs/doctor.md)."""
        return doctor.render_json(self.findings)


def run(settings: Settings, args: DoctorArgs) -> Diagnosis | Said:
    """Audit each unit against its journal; the findings, to print as the options ask."""
    if args.unit:
        unknown = unknown_unit(settings, args.unit, "doctor", force=args.force)
        if unknown is not None:
            return unknown
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
    return Diagnosis(results, fix=args.fix)
