"""doctor's checks of a unit's stop, kill, restart and gate settings against its own history.

Each check compares one setting with what the journal recorded about the unit (drains, kills,
survivors, restart loops) and says what it saw and the drop-in lines that fix it; ``diagnose``
runs them all, with the host checks (``hostchecks``), worst first. What is at risk is a
suggestion the evidence does not back: a number the journal never showed is labelled a guess.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import replace
from typing import TYPE_CHECKING, Final

from gpuguard.core.doctor.enginechecks import (
    engine_drain,
    engine_of,
    engine_read,
    engine_ready,
    exit_zero,
)
from gpuguard.core.doctor.findings import (
    NAME_CHARS,
    VALUE_CHARS,
    Finding,
    p99,
    round_up,
    show,
    span,
    span_or_off,
)
from gpuguard.core.doctor.hostchecks import (
    gpu_set,
    gpu_use,
    health_sandbox,
    mig,
    persistenced,
    writable_paths,
)
from gpuguard.core.doctor.starts import gate_wait, start_timeout
from gpuguard.core.levels import Level
from gpuguard.core.stopbudget import DROP_IN, fit
from gpuguard.core.unitconfig import parse_timespan
from gpuguard.core.unitstate import NOT_FOUND, no_such_unit

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from gpuguard.core.doctor.facts import AuditedUnit, HostFacts
    from gpuguard.core.unitconfig import UnitConfig

SAFE_KILL_MODES: Final = frozenset({"control-group", "mixed"})
RESTARTING: Final = frozenset({"always", "on-failure", "on-abnormal", "on-abort", "on-watchdog"})
DRAIN_MARGIN: Final = 1.5
"""TimeoutStopSec= is the observed p99 drain times this."""
UNBOUNDED_FACTOR: Final = 4.0
"""With no stop that drained in time, the suggestion is the timeout that killed it times this…"""
DRAIN_BUDGET_S: Final = 120.0
"""… and at least this: a drain budget for a server whose drain was never seen to end…"""
DRAIN_CEILING_S: Final = 600.0
"""… and at most this. A server's drain is its requests in flight finishing: one not done in
10 minutes is hung, not draining, and every minute of TimeoutStopSec= is a minute each stop
holds the unit's GPUs and delays its restart (a recovery waits for it). Without a ceiling each
run of ``doctor --fix`` after another killed stop multiplied the guess again (30 s, 2 min,
8 min, 32 min…). Past it the drain itself is the problem: the server's shutdown, not the
timeout. A drain measured to end (p99 x 1.5) is evidence, not a guess, and is not capped."""
SUGGESTED_BURST: Final = 5
ASSUMED_LOAD_S: Final = 60.0
"""A failing run's length when the journal shows none: a small model's load."""
MIN_RESTART_S: Final = 10.0
"""A RestartSec= below this restarts before a killed run's GPU memory is reliably free."""
GATE_MARGIN_S: Final = 60.0
"""TimeoutStartSec= must leave the gate this much beyond its own timeout."""
_MAX_NAMES: Final = 10  # survivor names shown per finding
_SECONDS = re.compile(r"\d{1,7}(?:\.\d{1,6})?")


def diagnose(
    facts: AuditedUnit, others: Mapping[str, AuditedUnit], host: HostFacts
) -> tuple[Finding, ...]:
    """Every finding about one unit; ``others`` are the other watched units (GPU overlaps)."""
    config = facts.config
    if facts.problems and config.load_state is None:
        return (
            Finding(
                "unknown",
                Level.UNKNOWN,
                f"cannot judge {config.unit}",
                tuple(facts.problems),
            ),
        )
    if config.load_state == NOT_FOUND:
        return (Finding("not-found", Level.UNKNOWN, no_such_unit(config.unit)),)
    gate_s = gate_timeout(config, host) if gate_installed(config) else None
    starts = start_timeout(facts, gate_s)
    engine = engine_of(facts)
    findings = [
        *_problems(facts),
        *engine_read(engine),
        _stop_timeout(facts),
        *engine_drain(facts, engine),
        *engine_ready(facts, engine),
        *exit_zero(facts, engine),
        *_kill_mode(facts),
        *_restart_policy(facts, host),
        *_gate(facts, host, proposed=any(f.fix for f in starts)),
        *starts,
        *gate_wait(facts, gate_s),
        *gpu_set(facts, others),
        *gpu_use(facts),
        *writable_paths(facts),
        *persistenced(host),
        *mig(host),
        *health_sandbox(facts, host),
    ]
    return tuple(sorted(_one_stop_timeout(findings), key=lambda f: -f.severity))


def _one_stop_timeout(findings: list[Finding]) -> list[Finding]:
    """One TimeoutStopSec= line in the drop-in: the longest proposal, which covers the others.

    ``stop-timeout`` (the drains measured) and ``engine-drain`` (the drain vLLM was told) may
    both propose one; the shorter one's finding keeps its words and points at the other's line.
    """

    def proposed(finding: Finding) -> float | None:
        for line in finding.fix:
            name, sep, value = line.partition("=")
            if sep and name == "TimeoutStopSec":
                return parse_timespan(value)
        return None

    proposing = [(proposed(f) or 0.0, at) for at, f in enumerate(findings) if proposed(f)]
    if len(proposing) < 2:
        return findings
    _, kept = max(proposing)
    out = list(findings)
    for _, at in proposing:
        if at != kept:
            finding = out[at]
            out[at] = replace(
                finding,
                evidence=(
                    *finding.evidence,
                    f"the {findings[kept].code} fix sets a longer TimeoutStopSec= that covers it",
                ),
                fix=(),
            )
    return out


def _problems(facts: AuditedUnit) -> list[Finding]:
    if not facts.problems:
        return []
    return [
        Finding(
            "incomplete",
            Level.UNKNOWN,
            "some facts could not be gathered; findings below may be incomplete",
            facts.problems,
        )
    ]


def _stop_timeout(facts: AuditedUnit) -> Finding:
    """Observed drains versus TimeoutStopSec=: what a stop costs when systemd cuts it short."""
    stops = facts.history.stops
    timeout = facts.config.timeout_stop_s
    shown = "infinity" if timeout is None else span(timeout)
    if not stops:
        return Finding(
            "stop-timeout",
            Level.OK,
            f"TimeoutStopSec={shown}; no stop in the journal to compare it with",
        )
    clean = sorted(s.drain_s for s in stops if not s.killed)
    killed = [s for s in stops if s.killed]
    evidence = [f"{len(stops)} stops observed, {len(killed)} ended in SIGKILL"]
    if clean:
        evidence.append(
            f"drain times (Stopping → main process exit or clean end): min {span(clean[0])}, "
            f"median {span(statistics.median(clean))}, p99 {span(p99(clean))}, "
            f"max {span(clean[-1])}"
        )
    if killed:
        evidence.append(
            f"killed stops had drained at least {span(max(s.drain_s for s in killed))} "
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
        severity = Level.CRITICAL
        title = (
            f"TimeoutStopSec={shown} cut {len(killed_now)} of {len(stops)} stops short (SIGKILL)"
            + ("" if clean else "; the drain has no observed upper bound")
        )
    elif too_short:
        severity = Level.WARNING
        title = (
            f"TimeoutStopSec={shown} leaves less than {DRAIN_MARGIN}x the p99 drain"
            if clean
            else f"TimeoutStopSec={shown}: the drain has no observed upper bound"
        )
    else:
        return Finding(
            "stop-timeout",
            Level.OK,
            f"TimeoutStopSec={shown} covers every observed drain",
            tuple(evidence),
        )
    basis = (
        f"p99 drain x {DRAIN_MARGIN}"
        if clean and round_up(p99(clean) * DRAIN_MARGIN) >= suggested
        else f"no stop drained within the timeout: {UNBOUNDED_FACTOR:g}x the longest "
        f"killed drain, at least {span(DRAIN_BUDGET_S)}, at most {span(DRAIN_CEILING_S)}; a "
        "guess, run doctor again after the next stops"
    )
    if not too_short:  # killed at or past the ceiling: a longer timeout is not the fix
        return Finding(
            "stop-timeout",
            severity,
            title,
            tuple(evidence),
            advice=(
                f"the drain outlasted TimeoutStopSec={shown}, at or past the "
                f"{span(DRAIN_CEILING_S)} this check proposes at most: the server's shutdown "
                "hangs; fix that (its graceful-shutdown timeout), a longer wait only delays "
                "each restart"
            ),
        )
    return Finding(
        "stop-timeout",
        severity,
        title,
        tuple(evidence),
        (f"# {basis}", f"TimeoutStopSec={span(suggested)}"),
    )


def _suggested_stop_timeout(clean: Sequence[float], killed: Sequence[float]) -> float:
    by_clean = round_up(p99(clean) * DRAIN_MARGIN) if clean else 0.0
    by_killed = (
        min(max(round_up(max(killed) * UNBOUNDED_FACTOR), DRAIN_BUDGET_S), DRAIN_CEILING_S)
        if killed
        else 0.0
    )
    if clean and (not killed or by_clean > max(killed)):
        return by_clean
    return max(by_clean, by_killed)


def _kill_mode(facts: AuditedUnit) -> list[Finding]:
    found: list[Finding] = []
    mode = facts.config.kill_mode
    if mode is not None and mode not in SAFE_KILL_MODES:
        found.append(
            Finding(
                "kill-mode",
                Level.CRITICAL,
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


def _survivors(facts: AuditedUnit) -> list[Finding]:
    """Processes that outlived a stop of the unit, each PID once, counted on trusted word only.

    systemd's word and the daemon's sweeps are counted; the holders the server's out-of-memory
    lines name outside the cgroup are the unit's own word (any of its processes can print such a
    line, naming any PID), so they are listed apart and never counted.
    """
    history, unit, mode = facts.history, facts.config.unit, facts.config.kill_mode
    pids = {pid for pid, _ in history.survivors} | {p for ps, _ in history.swept for p in ps}
    if not history.survivors and not history.swept and not history.named:
        return []
    evidence: list[str] = []
    if history.survivors:
        names = sorted({show(comm, NAME_CHARS) for _, comm in history.survivors})
        listed = ", ".join(names[:_MAX_NAMES]) + (" …" if len(names) > _MAX_NAMES else "")
        evidence.append(f"names: {listed}")
    evidence += [f"gpuguard's daemon: {summary}" for _, summary in history.swept[-_MAX_NAMES:]]
    shown = sorted(pids)
    if shown:
        evidence.append(
            "PIDs: "
            + ", ".join(map(str, shown[:_MAX_NAMES]))
            + (" …" if len(shown) > _MAX_NAMES else "")
        )
    named = [pid for pid in history.named if pid not in pids]
    if named:
        listed = ", ".join(str(pid) for pid in named[:_MAX_NAMES])
        evidence.append(
            f"the server's out-of-memory lines name PID {listed}"
            + (" …" if len(named) > _MAX_NAMES else "")
            + " as holding GPU memory (its word, not counted); systemd never saw it in the "
            "unit's cgroup"
        )
    prevent = (
        "install the gate: its ExecStopPost= reap and its check before each start"
        if mode in SAFE_KILL_MODES
        else "KillMode=mixed or control-group, and the gate's ExecStopPost= reap"
    )
    count = len(pids) or len(history.swept)
    title = (
        f"{count} {'process' if count == 1 else 'processes'} survived a stop or "
        f"{'was' if count == 1 else 'were'} left over at a start"
        if count
        else "the server's out-of-memory lines name a holder outside the unit's cgroup"
    )
    return [
        Finding(
            "survivors",
            Level.WARNING,
            title,
            tuple(evidence),
            advice=(
                f"{prevent}; to see what holds the GPUs now: `gpuguard status`, then "
                f"`gpuguard reap --unit {show(unit, 300)} --dry-run` and, after checking the "
                f"plan, `gpuguard reap --unit {show(unit, 300)}` (workers that left the unit's "
                "cgroup with no provenance need `--scope patterns`, after checking them)"
            ),
        )
    ]


def _restart_policy(facts: AuditedUnit, host: HostFacts) -> list[Finding]:
    """What a restart loop costs per hour, and whether systemd's start limit ever ends it."""
    config = facts.config
    history = facts.history
    if config.restart not in RESTARTING:
        return [Finding("restart", Level.OK, f"Restart={config.restart or 'no'}")]
    restart_s = config.restart_s or 0.0
    # "Starting" → "Started" holds the model load only where the server says when it is ready
    # (Type=notify); for any other type it is the gate's wait, and a real vLLM under
    # Type=simple "starts" in under a second and loads for a minute after (issue 34).
    loads = history.load_times_s if config.type == "notify" else ()
    runs = [*history.failed_runs_s, *loads]
    run_s = statistics.median(runs) if runs else None
    evidence = [
        (
            f"Restart={config.restart}, RestartSec={span(restart_s)}, "
            f"StartLimitIntervalSec={span_or_off(config.start_limit_interval_s)}, "
            f"StartLimitBurst={_or_unknown(config.start_limit_burst)}"
        ),
        (
            f"{history.restarts} automatic restarts and {history.start_limit_hits} start-limit "
            "hits in the journal"
        ),
    ]
    if run_s is None:
        run_s = ASSUMED_LOAD_S
        evidence.append(
            f"no load time or failed run in the journal: a model load of {span(run_s)} assumed"
        )
    else:
        evidence.append(f"a failing run (load until exit) takes {span(run_s)} (median)")
    cycles = [restart_s + run_s]
    if gate_installed(config):
        cycles.append(restart_s + gate_timeout(config, host))
        evidence.append(
            f"a refusing gate repeats every {span(cycles[-1])} (gate timeout + RestartSec)"
        )
    unstopped = [c for c in cycles if not _start_limit_ends(config, c)]
    if not unstopped:
        return [
            Finding("restart", Level.OK, "the start limit ends a restart loop", tuple(evidence))
        ]
    cycle = max(unstopped)
    per_hour = 3600 / max(cycle, 1.0)
    cost = f", {span(per_hour * run_s)} of model loads"
    # Sized for the RestartSec= suggested below too, so both fixes together still end the loop.
    longest = max(cycles) - restart_s + max(restart_s, MIN_RESTART_S)
    interval = round_up(SUGGESTED_BURST * longest * 1.2)
    said = f"a restart loop never hits the start limit: {per_hour:.0f} starts per hour{cost}"
    if history.start_limit_hits:
        # The journal shows the limit ending a loop: a faster one. Say which loop escapes it.
        hits = history.start_limit_hits
        said = (
            f"a restart loop of one start every {span(cycle)} escapes the start limit: "
            f"{per_hour:.0f} starts per hour{cost}; the {hits} start-limit "
            f"hit{'' if hits == 1 else 's'} in the journal ended a faster loop"
        )
    return [
        Finding(
            "restart",
            Level.WARNING,
            said,
            tuple(evidence),
            (
                (
                    f"# at most {SUGGESTED_BURST} starts in {span(interval)}, then the unit "
                    "fails and waits for an operator"
                ),
                f"StartLimitIntervalSec={span(interval)}",
                f"StartLimitBurst={SUGGESTED_BURST}",
            ),
            section="Unit",
        ),
        *(
            [
                Finding(
                    "restart-sec",
                    Level.WARNING,
                    f"RestartSec={span(restart_s)} restarts at once; give the GPUs time to free",
                    fix=(f"RestartSec={span(MIN_RESTART_S)}",),
                )
            ]
            if restart_s < MIN_RESTART_S
            else []
        ),
    ]


def _or_unknown(value: int | None) -> str:
    """A setting systemd did not report, for people: "unknown", never None."""
    return "unknown" if value is None else str(value)


def _start_limit_ends(config: UnitConfig, cycle_s: float) -> bool:
    """Whether ``burst`` starts ``cycle_s`` apart fall within the start-limit interval."""
    interval = config.start_limit_interval_s
    burst = config.start_limit_burst
    if not burst or interval == 0:
        return False  # StartLimitBurst=0 or StartLimitIntervalSec=0: no start limit at all
    return interval is None or burst * cycle_s <= interval


def gate_installed(config: UnitConfig) -> bool:
    """Whether the gate's drop-in or an ExecStartPre= running gpuguard guards the unit's starts."""
    if any(path.endswith("/gpuguard-gate.conf") for path in config.drop_in_paths):
        return True
    return any(any("gpuguard" in word for word in argv[:2]) for argv in config.exec_start_pre)


def gate_timeout(config: UnitConfig, host: HostFacts) -> float:
    """The gate's ``--timeout`` on its ExecStartPre= line, else gate_timeout_s of the config."""
    for argv in config.exec_start_pre:
        if any("gpuguard" in word for word in argv[:2]) and "--timeout" in argv:
            at = argv.index("--timeout") + 1
            if at < len(argv) and _SECONDS.fullmatch(argv[at]):
                return float(argv[at])
    return host.gate_timeout_s


def _gate(facts: AuditedUnit, host: HostFacts, *, proposed: bool) -> list[Finding]:
    """Whether the gate guards the unit's starts and TimeoutStartSec= lets it finish.

    ``proposed``: the start-timeout finding proposes a TimeoutStartSec= (it covers the gate's
    timeout too): one line of the drop-in sets it, not two.
    """
    config = facts.config
    if not gate_installed(config):
        return [
            Finding(
                "gate",
                Level.WARNING,
                "the gate is not installed: a start can meet the last run's GPU memory",
                advice=f"gpuguard install-gate --unit {show(config.unit, VALUE_CHARS)}",
            )
        ]
    start = config.timeout_start_s
    waits_s = gate_timeout(config, host)
    needed = waits_s + GATE_MARGIN_S
    if start is not None and start < needed:
        return [
            Finding(
                "gate-timeout",
                Level.WARNING,
                f"TimeoutStartSec={span(start)} kills the gate before its own timeout "
                f"({span(waits_s)}) can explain the refusal",
                ("the start-timeout fix sets a TimeoutStartSec= that covers it",)
                if proposed
                else (),
                () if proposed else (f"TimeoutStartSec={span(round_up(needed))}",),
            )
        ]
    return [Finding("gate", Level.OK, "the gate is installed"), _stop_reap(config)]


def _stop_reap(config: UnitConfig) -> Finding:
    """What the drop-in's ExecStopPost= reap gets of TimeoutStopSec= (core/stopbudget.py)."""
    stop = config.timeout_stop_s
    shown = "infinity" if stop is None else span(stop)
    times = fit(DROP_IN, stop)
    if times.cut_by_s is None:
        return Finding(
            "stop-reap",
            Level.OK,
            f"the ExecStopPost= reap fits in TimeoutStopSec={shown} as asked: {times.in_words()}",
        )
    return Finding(
        "stop-reap",
        Level.OK,
        f"the ExecStopPost= reap fits itself in TimeoutStopSec={shown}: {times.in_words()}",
        (
            (
                "systemd kills an ExecStopPost= still running past the stop timeout; the reap "
                "takes what fits, and the next start's gate reaps what it left"
            ),
        ),
    )
