"""``gpuguard doctor``: a unit's effective settings and its own history in, findings out (pure).

The incident gpuguard repairs starts with a unit configuration that makes it likely: a stop
timeout shorter than the server's real drain, a kill mode that leaves workers behind, a restart
policy that reloads a model hundreds of times, two servers on one GPU. This module judges each
against what the journal recorded about the unit (systemd's trusted PID-1 messages only, on the
journal's per-boot monotonic clock) and answers with evidence and the exact drop-in lines that
fix it. It never applies anything: the operator copies the printed drop-in.

Every string that came from the unit or its processes (names, paths, environment values) is
escaped where it is rendered (``_show``), never here in the facts.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Final

from gpuguard.core.escaping import escape
from gpuguard.core.events import EventKind, UnitEvent, decode_message, is_trusted, parse_entry
from gpuguard.core.mig import UNJUDGED, indices_text
from gpuguard.core.startfailure import named_holders

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from gpuguard.core.unitconfig import UnitConfig

SCHEMA_VERSION: Final = 1
FIX_FILE_NAME: Final = "zz-gpuguard-doctor.conf"
"""The suggested drop-in's name: it sorts after gpuguard-gate.conf and override.conf, so its
values win over both (systemd applies drop-ins in file-name order, the last one wins)."""
SAFE_KILL_MODES: Final = frozenset({"control-group", "mixed"})
RESTARTING: Final = frozenset({"always", "on-failure", "on-abnormal", "on-abort", "on-watchdog"})
DRAIN_MARGIN: Final = 1.5
"""TimeoutStopSec= is the observed p99 drain times this."""
UNBOUNDED_FACTOR: Final = 4.0
"""With no stop that drained in time, the suggestion is the timeout that killed it times this…"""
DRAIN_BUDGET_S: Final = 120.0
"""… and at least this: a drain budget for a server whose drain was never seen to end."""
SUGGESTED_BURST: Final = 5
ASSUMED_LOAD_S: Final = 60.0
"""A failing run's length when the journal shows none: a small model's load."""
MIN_RESTART_S: Final = 10.0
"""A RestartSec= below this restarts before a killed run's GPU memory is reliably free."""
GATE_MARGIN_S: Final = 60.0
"""TimeoutStartSec= must leave the gate this much beyond its own timeout."""
_MAX_NAMES: Final = 10  # survivor names shown per finding
_NAME_CHARS: Final = 64
_VALUE_CHARS: Final = 200
_SECONDS = re.compile(r"\d{1,7}(?:\.\d{1,6})?")
_SURVIVOR = re.compile(
    r"Unit process (?P<pid>\d{1,10}) \((?P<comm>.{0,64})\) remains running after unit stopped"
)


class Severity(IntEnum):
    """Monitoring-plugin levels; the worst finding's value is the exit status."""

    OK = 0
    WARNING = 1
    CRITICAL = 2
    UNKNOWN = 3


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing to change (or know), why, and the drop-in lines that change it.

    ``fix`` lines belong to ``section`` (``Service`` or ``Unit``); ``advice`` is what no drop-in
    line can do (install the gate, change a path's owner).
    """

    code: str
    severity: Severity
    title: str
    evidence: tuple[str, ...] = ()
    fix: tuple[str, ...] = ()
    section: str = "Service"
    advice: str | None = None


@dataclass(frozen=True, slots=True)
class Stop:
    """One stop of the unit: how long from "Stopping" until the main process exited.

    ``killed``: systemd's stop timeout fired (SIGKILL); ``drain_s`` is then only a lower bound.
    """

    invocation_id: str | None
    drain_s: float
    killed: bool


@dataclass(frozen=True, slots=True)
class History:
    """What the journal says about the unit's recent runs (trusted PID-1 entries only)."""

    entries: int = 0
    stops: tuple[Stop, ...] = ()
    load_times_s: tuple[float, ...] = ()
    """"Starting" → "Started" of one run: the gate's wait plus, for Type=notify, the model load."""
    failed_runs_s: tuple[float, ...] = ()
    """"Started" → main process exit of runs that failed without being stopped."""
    survivors: tuple[tuple[int, str], ...] = ()
    """Distinct (PID, name) of processes that stayed after a stop or were left over at a start."""
    swept: tuple[tuple[tuple[int, ...], str], ...] = ()
    """The daemon's sweeps of an ended run's survivors (its PIDs, its summary): the workers that
    left the unit's cgroup, which systemd never names, are seen only here."""
    restarts: int = 0
    start_limit_hits: int = 0
    named: tuple[int, ...] = ()
    """PIDs the unit's out-of-memory lines name as holding GPU memory (the server's word) that
    systemd never saw in the cgroup: a worker that left it, as ``explain`` counts them."""


@dataclass(frozen=True, slots=True)
class PathFact:
    """One file-system object on the way to a path the unit uses, as ``lstat`` saw it."""

    path: str
    uid: int
    gid: int
    mode: int
    is_dir: bool


@dataclass(frozen=True, slots=True)
class UnitFacts:
    """Everything doctor judges one unit on; the adapter gathers it, nothing here does I/O.

    ``paths`` maps each PATH/LD_LIBRARY_PATH entry and EnvironmentFile= to the ``lstat`` of it
    and each of its existing ancestors (the object first, ``/`` last; missing ones left out).
    """

    config: UnitConfig
    history: History
    environment: dict[str, str]
    """Environment= with every readable EnvironmentFile= applied (files win, as in systemd)."""
    gpus: tuple[int | str, ...] | None
    """The unit's ``gpus`` from gpuguard's configuration."""
    user_uid: int | None
    paths: Mapping[str, tuple[PathFact, ...]] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    """What could not be gathered (systemctl or journalctl failed, an unreadable file)."""
    use: GpuUseFacts | None = None
    """The GPUs the unit's live processes hold against its GPU set; None: NVML could not say."""


@dataclass(frozen=True, slots=True)
class GpuUseFacts:
    """NVML indices: the unit's GPU set as gpuguard resolves it, and what its processes hold."""

    set_indices: frozenset[int] | None
    """None: all GPUs (no config, no CUDA_VISIBLE_DEVICES)."""
    held: frozenset[int]
    gpu_count: int


@dataclass(frozen=True, slots=True)
class HostFacts:
    """What is true of the host rather than one unit."""

    gate_timeout_s: float
    nvidia_devices: bool
    persistenced_running: bool
    persistence_off: tuple[int, ...] | None = None
    """GPUs whose persistence mode NVML reports disabled; None: NVML did not say."""
    mig_on: tuple[int, ...] = ()
    """GPUs with MIG mode on (core/mig.py): gpuguard does not judge them."""


# -- history ------------------------------------------------------------------------------


def build_history(entries: Iterable[Mapping[str, object]], unit: str) -> History:
    """Stops, load times, failed runs and survivors from ``journalctl -o json`` entries.

    Only entries PID 1 wrote count (``events.is_trusted``); runs are matched by INVOCATION_ID
    within one boot, times are the per-boot monotonic stamps (a wall clock that steps cannot
    stretch a drain).
    """
    events: list[UnitEvent] = []
    survivors: list[tuple[int, str]] = []
    swept: list[tuple[tuple[int, ...], str]] = []
    named: dict[int, None] = {}
    count = 0
    for entry in entries:
        count += 1
        if (sweep := _daemon_sweep(entry, unit)) is not None:
            swept.append(sweep)
            continue
        event = parse_entry(entry, unit)
        if event is not None and event.kind is EventKind.GPU_OOM_OUTPUT:
            named.update(dict.fromkeys(named_holders(event.message)))
        elif event is not None:
            events.append(event)
            if event.kind is EventKind.LEFT_OVER_PROCESS and event.pid is not None:
                survivors.append((event.pid, event.comm or ""))
        elif is_trusted(entry, unit):
            text = decode_message(entry.get("MESSAGE"), limit=512) or ""
            if match := _SURVIVOR.search(text):
                survivors.append((int(match["pid"]), match["comm"]))
    return History(
        entries=count,
        stops=tuple(_stops(events)),
        load_times_s=tuple(_between(events, EventKind.STARTING, EventKind.STARTED)),
        failed_runs_s=tuple(_failed_runs(events)),
        survivors=tuple(dict.fromkeys(survivors)),  # one left-over is logged once per step
        swept=tuple(swept),
        restarts=sum(e.kind is EventKind.RESTART_SCHEDULED for e in events),
        start_limit_hits=sum(e.kind is EventKind.START_LIMIT_HIT for e in events),
        named=tuple(pid for pid in named if pid not in {p for p, _ in survivors}),
    )


DAEMON_UNIT: Final = "gpuguard.service"
SWEEP_EVENT: Final = "survivors of an ended run"


def _daemon_sweep(entry: Mapping[str, object], unit: str) -> tuple[tuple[int, ...], str] | None:
    """The daemon's "survivors of an ended run" line about ``unit``, else None.

    Only from gpuguard.service as root (journald's fields): the unit's output can print the same
    JSON.
    """
    if entry.get("_SYSTEMD_UNIT") != DAEMON_UNIT or entry.get("_UID") != "0":
        return None
    text = decode_message(entry.get("MESSAGE"), limit=64 * 1024)
    if not text or not text.startswith("{"):
        return None
    try:
        line = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(line, dict) or line.get("event") != SWEEP_EVENT or line.get("unit") != unit:
        return None
    raw = line.get("pids")
    pids = tuple(p for p in raw if isinstance(p, int))[:100] if isinstance(raw, list) else ()
    return pids, _show(str(line.get("summary", "")), 300)


def _run_key(event: UnitEvent) -> tuple[str | None, str | None]:
    return (event.boot_id, event.invocation_id)


_STOP_ENDS: Final = frozenset(
    {EventKind.MAIN_EXITED, EventKind.DEACTIVATED, EventKind.FAILED, EventKind.STOPPED}
)


def _stops(events: Sequence[UnitEvent]) -> list[Stop]:
    """Each "Stopping" to the main process's exit, else to the end of the run.

    systemd logs "Main process exited" only when the exit is a failure (a clean exit is a debug
    message), so a clean drain ends at "Deactivated successfully": later by the ExecStopPost=
    time, which TimeoutStopSec= covers too. A process that never exits ends at "Stopped".
    """
    open_stops: dict[tuple[str | None, str | None], tuple[float, bool]] = {}
    stops: list[Stop] = []
    for event in events:
        key = _run_key(event)
        if event.kind is EventKind.STOPPING and event.invocation_id:
            open_stops[key] = (event.monotonic_s, False)
        elif key in open_stops:
            begun, killed = open_stops[key]
            if event.kind is EventKind.STOP_TIMED_OUT:
                open_stops[key] = (begun, True)
            elif event.kind in _STOP_ENDS:
                killed = killed or event.signal == "KILL"
                stops.append(Stop(event.invocation_id, max(0.0, event.monotonic_s - begun), killed))
                del open_stops[key]
    return stops


def _between(events: Sequence[UnitEvent], first: EventKind, then: EventKind) -> list[float]:
    begun: dict[tuple[str | None, str | None], float] = {}
    found: list[float] = []
    for event in events:
        key = _run_key(event)
        if event.kind is first and event.invocation_id:
            begun[key] = event.monotonic_s
        elif event.kind is then and key in begun:
            found.append(max(0.0, event.monotonic_s - begun.pop(key)))
    return found


def _failed_runs(events: Sequence[UnitEvent]) -> list[float]:
    """From "Started" to a failing main exit, for runs nobody asked to stop: what a loop repeats."""
    started: dict[tuple[str | None, str | None], float] = {}
    found: list[float] = []
    for event in events:
        key = _run_key(event)
        if event.kind is EventKind.STARTED and event.invocation_id:
            started[key] = event.monotonic_s
        elif event.kind is EventKind.STOPPING:
            started.pop(key, None)
        elif event.kind is EventKind.MAIN_EXITED and key in started:
            begun = started.pop(key)
            if event.exit_code != "exited" or event.exit_status != 0:
                found.append(max(0.0, event.monotonic_s - begun))
    return found


# -- judging ------------------------------------------------------------------------------


def diagnose(
    facts: UnitFacts, others: Mapping[str, UnitFacts], host: HostFacts
) -> tuple[Finding, ...]:
    """Every finding about one unit; ``others`` are the other watched units (GPU overlaps)."""
    config = facts.config
    if facts.problems and config.load_state is None:
        return (
            Finding(
                "unknown",
                Severity.UNKNOWN,
                f"cannot judge {config.unit}",
                tuple(facts.problems),
            ),
        )
    if config.load_state == "not-found":
        return (
            Finding(
                "not-found",
                Severity.UNKNOWN,
                f"systemd has no unit {config.unit} (LoadState=not-found; a typo?)",
            ),
        )
    findings = [
        *_problems(facts),
        _stop_timeout(facts),
        *_kill_mode(facts),
        *_restart_policy(facts, host),
        *_gate(facts, host),
        *_gpu_set(facts, others),
        *_gpu_use(facts),
        *_writable_paths(facts),
        *_persistenced(host),
        *_mig(host),
    ]
    return tuple(sorted(findings, key=lambda f: -f.severity))


def worst(findings: Iterable[Finding]) -> Severity:
    """The exit status: the worst severity (UNKNOWN counts as worse than CRITICAL)."""
    return max((f.severity for f in findings), default=Severity.OK)


def _problems(facts: UnitFacts) -> list[Finding]:
    if not facts.problems:
        return []
    return [
        Finding(
            "incomplete",
            Severity.UNKNOWN,
            "some facts could not be gathered; findings below may be incomplete",
            facts.problems,
        )
    ]


def _stop_timeout(facts: UnitFacts) -> Finding:
    """Observed drains versus TimeoutStopSec=: what a stop costs when systemd cuts it short."""
    stops = facts.history.stops
    timeout = facts.config.timeout_stop_s
    shown = "infinity" if timeout is None else _span(timeout)
    if not stops:
        return Finding(
            "stop-timeout",
            Severity.OK,
            f"TimeoutStopSec={shown}; no stop in the journal to compare it with",
        )
    clean = sorted(s.drain_s for s in stops if not s.killed)
    killed = [s for s in stops if s.killed]
    evidence = [f"{len(stops)} stops observed, {len(killed)} ended in SIGKILL"]
    if clean:
        evidence.append(
            f"drain times (Stopping → main process exit or clean end): min {_span(clean[0])}, "
            f"median {_span(statistics.median(clean))}, p99 {_span(_p99(clean))}, "
            f"max {_span(clean[-1])}"
        )
    if killed:
        evidence.append(
            f"killed stops had drained at least {_span(max(s.drain_s for s in killed))} "
            "when SIGKILL came"
        )
    # SIGKILL comes at the timeout: a stop killed sooner than today's timeout was killed under an
    # earlier, shorter one (a fix already applied), and says nothing against today's setting.
    killed_now = [s for s in killed if timeout is not None and s.drain_s >= timeout - 0.5]
    if len(killed_now) < len(killed):
        evidence.append(
            f"{len(killed) - len(killed_now)} of the killed stops were cut sooner than today's "
            f"TimeoutStopSec={shown}: under an earlier, shorter setting"
        )
    suggested = _suggested_stop_timeout(clean, [s.drain_s for s in killed])
    too_short = timeout is not None and suggested > timeout
    if killed_now:
        severity = Severity.CRITICAL
        title = (
            f"TimeoutStopSec={shown} cut {len(killed_now)} of {len(stops)} stops short (SIGKILL)"
            + ("" if clean else "; the drain has no observed upper bound")
        )
    elif too_short:
        severity = Severity.WARNING
        title = (
            f"TimeoutStopSec={shown} leaves less than {DRAIN_MARGIN}x the p99 drain"
            if clean
            else f"TimeoutStopSec={shown}: the drain has no observed upper bound"
        )
    else:
        return Finding(
            "stop-timeout",
            Severity.OK,
            f"TimeoutStopSec={shown} covers every observed drain",
            tuple(evidence),
        )
    basis = (
        f"p99 drain x {DRAIN_MARGIN}"
        if clean and _round_up(_p99(clean) * DRAIN_MARGIN) >= suggested
        else f"no stop drained within the timeout: {UNBOUNDED_FACTOR:g}x the longest "
        f"killed drain, at least {_span(DRAIN_BUDGET_S)}; a guess, run doctor again after the "
        "next stops"
    )
    return Finding(
        "stop-timeout",
        severity,
        title,
        tuple(evidence),
        (f"# {basis}", f"TimeoutStopSec={_span(suggested)}"),
    )


def _suggested_stop_timeout(clean: Sequence[float], killed: Sequence[float]) -> float:
    by_clean = _round_up(_p99(clean) * DRAIN_MARGIN) if clean else 0.0
    by_killed = max(_round_up(max(killed) * UNBOUNDED_FACTOR), DRAIN_BUDGET_S) if killed else 0.0
    if clean and (not killed or by_clean > max(killed)):
        return by_clean
    return max(by_clean, by_killed)


def _kill_mode(facts: UnitFacts) -> list[Finding]:
    found: list[Finding] = []
    mode = facts.config.kill_mode
    if mode is not None and mode not in SAFE_KILL_MODES:
        found.append(
            Finding(
                "kill-mode",
                Severity.CRITICAL,
                f"KillMode={mode}: a stop leaves the server's workers running, holding GPU memory",
                (f"effective KillMode={mode}",),
                (
                    "# SIGTERM to the main process, SIGKILL to whatever is left in the cgroup",
                    "KillMode=mixed",
                ),
            )
        )
    found.extend(_survivors(facts))
    return found


def _survivors(facts: UnitFacts) -> list[Finding]:
    """Processes that outlived a stop of the unit, each PID once (as ``explain`` counts them).

    systemd's word, the daemon's sweeps, and the holders the server's out-of-memory lines name
    outside the cgroup.
    """
    history, unit, mode = facts.history, facts.config.unit, facts.config.kill_mode
    pids = {pid for pid, _ in history.survivors} | {p for ps, _ in history.swept for p in ps}
    pids |= set(history.named)
    if not history.survivors and not history.swept and not history.named:
        return []
    evidence: list[str] = []
    if history.survivors:
        names = sorted({_show(comm, _NAME_CHARS) for _, comm in history.survivors})
        listed = ", ".join(names[:_MAX_NAMES]) + (" …" if len(names) > _MAX_NAMES else "")
        evidence.append(f"names: {listed}")
    evidence += [f"gpuguard's daemon: {summary}" for _, summary in history.swept[-_MAX_NAMES:]]
    shown = sorted(pids)
    evidence.append(
        "PIDs: "
        + ", ".join(map(str, shown[:_MAX_NAMES]))
        + (" …" if len(shown) > _MAX_NAMES else "")
    )
    if history.named:
        listed = ", ".join(str(pid) for pid in history.named[:_MAX_NAMES])
        evidence.append(
            f"the server's out-of-memory lines name PID {listed} as holding GPU memory (its "
            "word); systemd never saw it in the unit's cgroup"
        )
    prevent = (
        "install the gate: its ExecStopPost= reap and its check before each start"
        if mode in SAFE_KILL_MODES
        else "KillMode=mixed or control-group, and the gate's ExecStopPost= reap"
    )
    count = len(pids) or len(history.swept)
    return [
        Finding(
            "survivors",
            Severity.WARNING,
            f"{count} processes survived a stop or were left over at a start",
            tuple(evidence),
            advice=(
                f"{prevent}; to see what holds the GPUs now: `gpuguard status`, then "
                f"`gpuguard reap --unit {_show(unit, 300)} --dry-run` and, after checking the "
                f"plan, `gpuguard reap --unit {_show(unit, 300)}` (workers that left the unit's "
                "cgroup with no provenance need `--scope patterns`, after checking them)"
            ),
        )
    ]


def _restart_policy(facts: UnitFacts, host: HostFacts) -> list[Finding]:
    """What a restart loop costs per hour, and whether systemd's start limit ever ends it."""
    config = facts.config
    history = facts.history
    if config.restart not in RESTARTING:
        return [Finding("restart", Severity.OK, f"Restart={config.restart or 'no'}")]
    restart_s = config.restart_s or 0.0
    runs = [*history.failed_runs_s, *history.load_times_s]
    run_s = statistics.median(runs) if runs else None
    evidence = [
        (
            f"Restart={config.restart}, RestartSec={_span(restart_s)}, "
            f"StartLimitIntervalSec={_span_or_off(config.start_limit_interval_s)}, "
            f"StartLimitBurst={config.start_limit_burst}"
        ),
        (
            f"{history.restarts} automatic restarts and {history.start_limit_hits} start-limit "
            "hits in the journal"
        ),
    ]
    if run_s is None:
        run_s = ASSUMED_LOAD_S
        evidence.append(
            f"no load time or failed run in the journal: a model load of {_span(run_s)} assumed"
        )
    else:
        evidence.append(f"a failing run (load until exit) takes {_span(run_s)} (median)")
    cycles = [restart_s + run_s]
    if _gate_installed(config):
        cycles.append(restart_s + _gate_timeout(config, host))
        evidence.append(
            f"a refusing gate repeats every {_span(cycles[-1])} (gate timeout + RestartSec)"
        )
    unstopped = [c for c in cycles if not _start_limit_ends(config, c)]
    if not unstopped:
        return [
            Finding("restart", Severity.OK, "the start limit ends a restart loop", tuple(evidence))
        ]
    cycle = max(unstopped)
    per_hour = 3600 / max(cycle, 1.0)
    cost = f", {_span(per_hour * run_s)} of model loads"
    # Sized for the RestartSec= suggested below too, so both fixes together still end the loop.
    longest = max(cycles) - restart_s + max(restart_s, MIN_RESTART_S)
    interval = _round_up(SUGGESTED_BURST * longest * 1.2)
    return [
        Finding(
            "restart",
            Severity.WARNING,
            f"a restart loop never hits the start limit: {per_hour:.0f} starts per hour{cost}",
            tuple(evidence),
            (
                (
                    f"# at most {SUGGESTED_BURST} starts in {_span(interval)}, then the unit "
                    "fails and waits for an operator"
                ),
                f"StartLimitIntervalSec={_span(interval)}",
                f"StartLimitBurst={SUGGESTED_BURST}",
            ),
            section="Unit",
        ),
        *(
            [
                Finding(
                    "restart-sec",
                    Severity.WARNING,
                    f"RestartSec={_span(restart_s)} restarts at once; give the GPUs time to free",
                    fix=(f"RestartSec={_span(MIN_RESTART_S)}",),
                )
            ]
            if restart_s < MIN_RESTART_S
            else []
        ),
    ]


def _start_limit_ends(config: UnitConfig, cycle_s: float) -> bool:
    """Whether ``burst`` starts ``cycle_s`` apart fall within the start-limit interval."""
    interval = config.start_limit_interval_s
    burst = config.start_limit_burst
    if not burst or interval == 0:
        return False  # StartLimitBurst=0 or StartLimitIntervalSec=0: no start limit at all
    return interval is None or burst * cycle_s <= interval


def _gate_installed(config: UnitConfig) -> bool:
    if any(path.endswith("/gpuguard-gate.conf") for path in config.drop_in_paths):
        return True
    return any(any("gpuguard" in word for word in argv[:2]) for argv in config.exec_start_pre)


def _gate_timeout(config: UnitConfig, host: HostFacts) -> float:
    """The gate's ``--timeout`` on its ExecStartPre= line, else gate_timeout_s of the config."""
    for argv in config.exec_start_pre:
        if any("gpuguard" in word for word in argv[:2]) and "--timeout" in argv:
            at = argv.index("--timeout") + 1
            if at < len(argv) and _SECONDS.fullmatch(argv[at]):
                return float(argv[at])
    return host.gate_timeout_s


def _gate(facts: UnitFacts, host: HostFacts) -> list[Finding]:
    config = facts.config
    if not _gate_installed(config):
        return [
            Finding(
                "gate",
                Severity.WARNING,
                "the gate is not installed: a start can meet the last run's GPU memory",
                advice=f"gpuguard install-gate --unit {_show(config.unit, _VALUE_CHARS)}",
            )
        ]
    start = config.timeout_start_s
    gate_timeout = _gate_timeout(config, host)
    needed = gate_timeout + GATE_MARGIN_S
    if start is not None and start < needed:
        return [
            Finding(
                "gate-timeout",
                Severity.WARNING,
                f"TimeoutStartSec={_span(start)} kills the gate before its own timeout "
                f"({_span(gate_timeout)}) can explain the refusal",
                fix=(f"TimeoutStartSec={_span(_round_up(needed))}",),
            )
        ]
    return [Finding("gate", Severity.OK, "the gate is installed")]


def _gpu_set(facts: UnitFacts, others: Mapping[str, UnitFacts]) -> list[Finding]:
    mine = _gpus(facts)
    unit = facts.config.unit
    found: list[Finding] = []
    if mine is None:
        found.append(
            Finding(
                "gpu-set",
                Severity.WARNING if others else Severity.OK,
                "no GPU set: neither gpus in gpuguard's configuration nor CUDA_VISIBLE_DEVICES; "
                "the unit may use every GPU",
                fix=("# the GPUs this server uses, e.g.", 'Environment="CUDA_VISIBLE_DEVICES=0,1"')
                if others
                else (),
            )
        )
    for name, other in sorted(others.items()):
        theirs = _gpus(other)
        shared = (
            "all"
            if mine is None or theirs is None
            else _show(",".join(sorted(mine & theirs)), _VALUE_CHARS)
        )
        if shared:
            found.append(
                Finding(
                    "gpu-overlap",
                    Severity.WARNING,
                    f"shares GPUs ({shared}) with {_show(name, _VALUE_CHARS)}",
                    (
                        f"{_show(unit, _VALUE_CHARS)}: {_describe_gpus(mine)}",
                        f"{_show(name, _VALUE_CHARS)}: {_describe_gpus(theirs)}",
                    ),
                    advice="give each unit disjoint CUDA_VISIBLE_DEVICES (and gpus in the config)",
                )
            )
    return found


def _gpu_use(facts: UnitFacts) -> list[Finding]:
    """The GPU set against what the unit's processes hold now (NVML and /proc)."""
    use = facts.use
    if use is None or not use.held:
        return []
    held = ",".join(str(i) for i in sorted(use.held))
    fix = ("# the GPUs this server's processes hold", f'Environment="CUDA_VISIBLE_DEVICES={held}"')
    if use.set_indices is not None and not use.held <= use.set_indices:
        outside = ",".join(str(i) for i in sorted(use.held - use.set_indices))
        listed = ",".join(str(i) for i in sorted(use.set_indices)) or "none"
        return [
            Finding(
                "gpu-use",
                Severity.WARNING,
                f"its processes hold GPUs {outside} outside its GPU set ({listed})",
                (f"held now: GPUs {held}",),
                advice="the gate and recoveries look only at the set: make it name every GPU "
                "the server uses",
                fix=fix,
            )
        ]
    if use.set_indices is None and len(use.held) < use.gpu_count:
        return [
            Finding(
                "gpu-use",
                Severity.OK,
                f"its processes hold GPUs {held} of {use.gpu_count}, but its GPU set is all GPUs",
                advice="name them, so its gate never waits for another server's GPUs",
                fix=fix,
            )
        ]
    return [Finding("gpu-use", Severity.OK, f"its processes hold GPUs {held}, all in its set")]


def _gpus(facts: UnitFacts) -> frozenset[str] | None:
    """The unit's GPUs as tokens (indices or UUIDs); None: all of them."""
    if facts.gpus is not None:
        return frozenset(str(g) for g in facts.gpus)
    visible = facts.environment.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    return frozenset(t.strip() for t in visible[:_VALUE_CHARS].split(",") if t.strip())


def _describe_gpus(gpus: frozenset[str] | None) -> str:
    if gpus is None:
        return "all GPUs"
    return "GPUs " + _show(",".join(sorted(gpus)), _VALUE_CHARS)


def _writable_paths(facts: UnitFacts) -> list[Finding]:
    """Paths in PATH, LD_LIBRARY_PATH and EnvironmentFile= that the service user can change.

    Anything root runs for the unit in its environment (an ExecStartPre=+ line, a helper that
    sources its environment file) then runs or reads what that user chose.
    """
    uid = facts.user_uid
    if uid is None or uid == 0:
        return []
    found: list[Finding] = []
    for path, chain in sorted(facts.paths.items()):
        culprit = next((fact for fact in chain if _writable_by(fact, uid)), None)
        if culprit is None:
            continue
        why = "owned by the service user" if culprit.uid == uid else "group/other-writable"
        found.append(
            Finding(
                "writable-path",
                Severity.WARNING,
                f"{_show(path, _VALUE_CHARS)} can be changed by the service user "
                f"({_show(facts.config.user or '', _NAME_CHARS)})",
                (f"{_show(culprit.path, _VALUE_CHARS)}: {why}, mode {culprit.mode & 0o7777:04o}",),
                advice="make it root-owned and not group/other-writable, or drop it from the "
                "unit's environment",
            )
        )
    return found


def _writable_by(fact: PathFact, uid: int) -> bool:
    if fact.uid == uid:
        return True
    sticky = fact.is_dir and fact.mode & 0o1000
    return bool(fact.mode & 0o022) and not sticky


def _mig(host: HostFacts) -> list[Finding]:
    """MIG mode on: what gpuguard cannot judge there, so the operator does not rely on it."""
    if not host.mig_on:
        return []
    listed = indices_text(host.mig_on)
    return [
        Finding(
            "mig",
            Severity.WARNING,
            f"MIG mode is on on GPU {listed}: {UNJUDGED}; the gate and the daemon neither wait "
            "on nor reap from it, and a unit's GPU set leaves it out",
            (f"nvmlDeviceGetMigMode: current mode enabled on GPU {listed}",),
            advice="check its instances with `nvidia-smi mig -lgi`; stale processes there "
            "must be found and stopped by hand",
        )
    ]


def _persistenced(host: HostFacts) -> list[Finding]:
    """Persistence mode as NVML reports it, else whether its daemon runs."""
    daemon = f"nvidia-persistenced is {'' if host.persistenced_running else 'not '}running"
    advice = "systemctl enable --now nvidia-persistenced"
    if host.persistence_off:
        listed = ",".join(str(i) for i in host.persistence_off)
        return [
            Finding(
                "persistenced",
                Severity.WARNING,
                f"persistence mode is off on GPUs {listed}: the driver tears them down between "
                "runs, slowing every start, and idle memory readings are less stable",
                (daemon,),
                advice=advice,
            )
        ]
    if host.persistence_off is not None:
        return [Finding("persistenced", Severity.OK, "persistence mode is on on every GPU")]
    if not host.nvidia_devices:
        return []
    if host.persistenced_running:
        return [Finding("persistenced", Severity.OK, daemon)]
    return [
        Finding(
            "persistenced",
            Severity.WARNING,
            f"{daemon}: the driver tears GPUs down between runs, "
            "slowing every start, and idle memory readings are less stable",
            advice=advice,
        )
    ]


# -- rendering ----------------------------------------------------------------------------


def render_text(results: Mapping[str, Sequence[Finding]]) -> str:
    """Findings grouped by unit and severity, worst first, evidence indented under each."""
    lines: list[str] = []
    for unit, findings in results.items():
        lines.append(f"{_show(unit, _VALUE_CHARS)}: {worst(findings).name}")
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
    shown = _show(unit, _VALUE_CHARS)
    lines = [
        f"# gpuguard doctor: suggested drop-in for {shown}",
        f"# Save as /etc/systemd/system/{shown}.d/{FIX_FILE_NAME}, then run",
        "# `systemctl daemon-reload`; it takes effect at the next stop and start.",
        "# Its name sorts after gpuguard-gate.conf and override.conf, so these values win.",
    ]
    advice = [f for f in findings if f.advice and f.severity is not Severity.OK]
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


def _show(text: str, limit: int) -> str:
    """Foreign text on one line, escaped, cut to ``limit`` characters (with a marker)."""
    return escape(text, limit)


def _p99(values: Sequence[float]) -> float:
    """The 99th percentile (nearest rank) of sorted ``values``."""
    return values[max(0, math.ceil(0.99 * len(values)) - 1)]


def _round_up(seconds: float) -> float:
    """Up to a round value: 5 s steps below a minute, 30 s below 10 min, then whole minutes."""
    if seconds <= 60:
        step = 5.0
    elif seconds <= 600:
        step = 30.0
    else:
        step = 60.0
    return max(step, math.ceil(seconds / step) * step)


def _span(seconds: float) -> str:
    """Seconds as systemd writes a time span: "90s" → "1min 30s", "0.1" → "100ms"."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [
        f"{hours}h" if hours else "",
        f"{minutes}min" if minutes else "",
        f"{secs}s" if secs else "",
    ]
    return " ".join(p for p in parts if p) or "0"


def _span_or_off(seconds: float | None) -> str:
    return "infinity" if seconds is None else _span(seconds)
