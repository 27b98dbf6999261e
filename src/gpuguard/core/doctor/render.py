"""doctor's findings as text, as the versioned JSON document, or as the fixing drop-in.

Findings carry foreign text escaped already; each renderer escapes every line again, so one
line stays one line whatever a future finding forgets. The drop-in is printed, never written:
the operator saves it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from gpuguard.core.doctor.findings import VALUE_CHARS, show, worst
from gpuguard.core.escaping import escape
from gpuguard.core.levels import Level

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from gpuguard.core.doctor.findings import Finding

SCHEMA_VERSION: Final = 1
FIX_FILE_NAME: Final = "zz-gpuguard-doctor.conf"
"""The suggested drop-in's name: it sorts after gpuguard-gate.conf and override.conf, so its
values win over both (systemd applies drop-ins in file-name order, the last one wins)."""


def render_text(results: Mapping[str, Sequence[Finding]]) -> str:
    """Findings grouped by unit and severity, worst first, evidence indented under each."""
    lines: list[str] = []
    for unit, findings in results.items():
        lines.append(f"{show(unit, VALUE_CHARS)}: {worst(findings).name}")
        for finding in findings:
            lines.append(f"  {finding.severity.name:<8} {finding.title}")
            lines.extend(f"           {item}" for item in finding.evidence)
            lines.extend(f"           fix: {line}" for line in finding.fix)
            if finding.advice:
                lines.append(f"           do: {finding.advice}")
    # Findings carry escaped foreign text already; this pass guarantees one line per line
    # whatever a future finding forgets (escaping escaped text changes nothing harmful).
    return "\n".join(escape(line) for line in lines) + "\n"


def render_json(results: Mapping[str, Sequence[Finding]]) -> dict[str, object]:
    """The versioned JSON document of ``doctor --json``."""
    overall = worst(f for findings in results.values() for f in findings)
    return {
        "schema": "gpuguard.doctor",
        "version": SCHEMA_VERSION,
        "level": overall.name,
        "exit_code": int(overall),
        "units": [
            {
                "unit": unit,
                "level": worst(findings).name,
                "findings": [
                    {
                        "code": f.code,
                        "severity": f.severity.name,
                        "title": f.title,
                        "evidence": list(f.evidence),
                        "fix": {"section": f.section, "lines": list(f.fix)} if f.fix else None,
                        "advice": f.advice,
                    }
                    for f in findings
                ],
            }
            for unit, findings in results.items()
        ],
    }


def render_fix(unit: str, findings: Sequence[Finding]) -> str:
    """A complete drop-in with every fix line, commented; printed, never written by gpuguard."""
    shown = show(unit, VALUE_CHARS)
    lines = [
        f"# gpuguard doctor: suggested drop-in for {shown}",
        f"# Save as /etc/systemd/system/{shown}.d/{FIX_FILE_NAME}, then run",
        "# `systemctl daemon-reload`; it takes effect at the next stop and start.",
        "# Its name sorts after gpuguard-gate.conf and override.conf, so these values win.",
    ]
    advice = [f for f in findings if f.advice and f.severity is not Level.OK]
    lines.extend(f"# Also ({finding.code}): {finding.advice}" for finding in advice)
    for section in ("Unit", "Service"):
        chosen = [f for f in findings if f.fix and f.section == section]
        if not chosen:
            continue
        lines.append(f"[{section}]")
        for finding in chosen:
            lines.append(f"# {finding.code}: {finding.title}")
            lines.extend(finding.fix)
    if not any(f.fix for f in findings):
        lines.append("# Nothing to change in the unit's settings.")
    return "\n".join(escape(line) for line in lines) + "\n"
