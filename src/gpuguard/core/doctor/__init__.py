"""``gpuguard doctor``: a unit's effective settings and its own history in, findings out (pure).

The incident gpuguard repairs starts with a unit configuration that makes it likely: a stop
timeout shorter than the server's real drain, a kill mode that leaves workers behind, a restart
policy that reloads a model hundreds of times, two servers on one GPU. The package judges each
against what the journal recorded about the unit (``journal``: systemd's trusted PID-1 messages
only, on the journal's per-boot monotonic clock) in ``checks`` and ``hostchecks``, and answers
with evidence and the exact drop-in lines that fix it (``render``). It never applies anything:
the operator copies the printed drop-in. Foreign strings are escaped where they are rendered.
"""

from gpuguard.core.doctor.checks import diagnose
from gpuguard.core.doctor.facts import (
    AuditedUnit,
    GateWaits,
    GpuUseFacts,
    History,
    HostFacts,
    LearnedStarts,
    PathFact,
    Stop,
)
from gpuguard.core.doctor.findings import Finding, worst
from gpuguard.core.doctor.journal import DAEMON_UNIT, SWEEP_EVENT, build_history
from gpuguard.core.doctor.render import (
    FIX_FILE_NAME,
    SCHEMA_VERSION,
    render_fix,
    render_json,
    render_text,
)
from gpuguard.core.levels import Level

__all__ = [
    "DAEMON_UNIT",
    "FIX_FILE_NAME",
    "SCHEMA_VERSION",
    "SWEEP_EVENT",
    "AuditedUnit",
    "Finding",
    "GateWaits",
    "GpuUseFacts",
    "History",
    "HostFacts",
    "LearnedStarts",
    "Level",
    "PathFact",
    "Stop",
    "build_history",
    "diagnose",
    "render_fix",
    "render_json",
    "render_text",
    "worst",
]
