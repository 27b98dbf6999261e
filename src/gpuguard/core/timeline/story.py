"""The story the rows tell: the incident in the few sentences people ask for first.

Stops that timed out, what systemd SIGKILLed, each PID that outlived a run once (with everything
said about it, the server's out-of-memory lines included), the failed starts with their first
start-failure signature, start-limit hits (a loop systemd ended, and what to do), stop jobs
(never a loop), what gpuguard decided and did, and the newest run that stayed up.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final

from gpuguard.core.escaping import escape
from gpuguard.core.events import (
    EventKind,
    UnitEvent,
)
from gpuguard.core.loopruns import UNNAMED, Run, runs_of
from gpuguard.core.prevented import HEALED_OUTCOMES, Prevented, in_words
from gpuguard.core.timeline.model import GPUGUARD, SURVIVOR_PID, Row, Story, short_run

if TYPE_CHECKING:
    from collections.abc import Collection

    from gpuguard.core.timeline.replay import Holders, Replayed

_FAILED_RUN_KINDS: Final = frozenset({EventKind.FAILED, EventKind.START_FAILED})
# gpuguard's rows told in the table only: single signals, the daemon's every-event verdicts, the
# gate server's acceptances, exits and the reaper lines it copied (its verdicts are the story).
_TABLE_ONLY: Final = frozenset(
    {"signal", "reap-outcome", "verdict", "gate-server", "gate-said", "reap-said"}
    | {"gate-exit", "reap-exit"}
)


def tell(  # noqa: PLR0913 - the pieces the rows were read into
    rows: list[Row],
    events: list[UnitEvent],
    would: tuple[str, ...],
    replayed: Replayed,
    holders: Holders,
    *,
    ready: Collection[str | None] = (),
) -> Story:
    """The story of ``rows`` (``would``: the replay's rows' texts, when gpuguard left none).

    ``ready``: the runs that printed their server's ready line; one of them that failed is told
    as a crash, not a failed start.
    """
    stops = [f"{short_run(r.run)}: {r.text}" for r in rows if r.kind == EventKind.STOP_TIMED_OUT]
    killed = [r.text for r in rows if r.kind == "killed"]
    ours = [r.text for r in rows if r.source == GPUGUARD and r.kind not in _TABLE_ONLY]
    survivors, counted = _survivors(rows, holders)
    failed = _failed_starts(rows, events)
    return Story(
        stop_timeouts=tuple(stops),
        sigkilled=tuple(killed),
        survivors=tuple(survivors),
        survivor_pids=counted,
        failed_starts=tuple(line for run, line in failed if run not in ready),
        crashes=tuple(
            f"{line}; it had printed its ready line (a crash, not a failed start)"
            for run, line in failed
            if run in ready
        ),
        gpuguard=tuple(ours),
        would=would,
        # A run still starting is no answer to a loop the detector sees (systemd's counter).
        healthy=None if replayed.verdict.startswith("restart loop") else _healthy(events, rows),
        start_limit=tuple(_start_limit(events)),
        operator=tuple(_operator(events)),
        findings=replayed.findings,
        verdict=replayed.verdict,
        disagreements=replayed.disagreements,
    )


def _survivors(rows: list[Row], holders: Holders) -> tuple[list[str], int]:
    """One line per distinct PID that outlived a run, and how many PIDs systemd or gpuguard named.

    Each line has everything said about its PID.
    A holder only the server's out-of-memory line names (outside the cgroup: systemd never saw
    it) gets a line too, said to be the server's word, and is not counted: any process of the
    unit can print such a line naming any PID (doctor counts the same way).
    """
    by_pid: dict[str, list[str]] = {}
    other: list[str] = []
    for row in rows:
        systemd = row.kind in {"remains-running", EventKind.LEFT_OVER_PROCESS}
        ours = row.source == GPUGUARD and row.kind in {"reap-outcome", "survivors-of-an-ended-run"}
        if row.kind == EventKind.SURVIVED_SIGKILL:
            other.append(f"run {short_run(row.run)}: {row.text}")
            continue
        if not (systemd or ours):
            continue
        swept = _SWEPT_PIDS.search(row.text) if row.kind == "survivors-of-an-ended-run" else None
        match = SURVIVOR_PID.search(row.text) if swept is None else None
        pids = swept["pids"].split(",") if swept else [match[1] or match[2]] if match else []
        if not pids:
            other.append(row.text)
            continue
        what = _SURVIVOR_WORDS.get(row.kind, row.kind)
        if swept is not None and (summary := row.text.find("summary=")) >= 0:
            what = f"swept by gpuguard's daemon: {row.text[summary + len('summary=') :]}"
        said = f"{what} (run {short_run(row.run)})" if row.run else what
        for pid in pids:
            if said not in by_pid.setdefault(pid, []):
                by_pid[pid].append(said)
    lines = [f"PID {pid}: {'; '.join(said)}" for pid, said in by_pid.items()]
    lines += [
        f"PID {pid}: named by the server's out-of-memory line as holding GPU memory (its word); "
        "systemd never saw it in the unit's cgroup"
        for pid in holders.named_outside
        if str(pid) not in by_pid
    ]
    return lines + other, len(by_pid)


_SURVIVOR_WORDS: Final = {
    "remains-running": "remained running after the run stopped",
    EventKind.LEFT_OVER_PROCESS.value: "left over at the start",
    "reap-outcome": "reaped by gpuguard",
}
_SWEPT_PIDS = re.compile(r"\bpids=\[(?P<pids>\d{1,10}(?:,\d{1,10}){0,19})\]")


def _start_limit(events: list[UnitEvent]) -> list[str]:
    """Each start-limit hit: systemd ended a loop; what the operator does next."""
    return [
        f"run {short_run(event.invocation_id)}: start request repeated too quickly: systemd ended "
        f"the loop and will not start {escape(event.unit)} again; fix the cause, then "
        f"`systemctl reset-failed {escape(event.unit)}` (and start it)"
        for event in events
        if event.kind is EventKind.START_LIMIT_HIT
    ]


def _operator(events: list[UnitEvent]) -> list[str]:
    """The stop jobs: someone asked for the stop (an operator's stop or restart): never a loop."""
    lines: dict[str | None, str] = {}
    for event in events:
        if event.kind in {EventKind.STOPPING, EventKind.STOPPED} and event.job_type == "stop":
            lines.setdefault(
                event.invocation_id,
                f"run {short_run(event.invocation_id)}: stopped by a stop job (an operator's "
                "`systemctl stop` or `restart`, a conflicting unit, or gpuguard): not a failure",
            )
    return list(lines.values())


def _failed_starts(rows: list[Row], events: list[UnitEvent]) -> list[tuple[str | None, str]]:
    """Each run that failed, with the first start-failure signature it printed."""
    said: dict[str | None, str] = {}
    for row in rows:
        if row.kind == EventKind.GPU_OOM_OUTPUT and row.run not in said:
            said[row.run] = row.text
    lines: list[tuple[str | None, str]] = []
    done: set[str | None] = set()
    clean = {e.invocation_id for e in events if e.kind is EventKind.DEACTIVATED}
    asked = {e.invocation_id for e in events if e.job_type == "stop"}
    stopping: set[str | None] = set()
    for event in events:
        if event.kind is EventKind.STOPPING and event.job_type == "stop":
            stopping.add(event.invocation_id)
        restarted = (
            event.kind is EventKind.RESTART_SCHEDULED
            and event.invocation_id in clean
            and event.invocation_id not in asked
        )
        if restarted and event.invocation_id not in done:
            done.add(event.invocation_id)
            n = event.n_restarts
            counter = "" if n is None else f" (restart counter at {n})"
            lines.append(
                (
                    event.invocation_id,
                    (
                        f"run {short_run(event.invocation_id)}: exited cleanly and systemd "
                        f"restarted it{counter}: a server that exits is not serving"
                    ),
                )
            )
            continue
        if event.kind not in _FAILED_RUN_KINDS or event.invocation_id in done:
            continue
        done.add(event.invocation_id)
        if event.kind is EventKind.FAILED and (
            event.result == "timeout" or event.invocation_id in stopping
        ):
            # A stop that timed out is told as such; how a stop someone asked for ended is no
            # failed start either (SGLang's clean drain ends in its own SIGKILL, 'signal').
            continue
        why = f"result '{event.result}'" if event.result else "failed"
        signature = said.get(event.invocation_id)
        lines.append(
            (
                event.invocation_id,
                f"run {short_run(event.invocation_id)}: {why}"
                + (f"; it printed {signature}" if signature else "; no start-failure signature"),
            )
        )
    # A run whose main process exited unclean with no "Failed with result" line (the journal
    # ends there, or a restart was pending): failed all the same, as the detector counts it.
    for run in runs_of(events):
        if run.failure_s is None or run.result or run.job_result or run.clean_restart:
            continue
        signature = said.get(_named(run))
        lines.append(
            (
                _named(run),
                f"run {short_run(_named(run))}: {run.describe_failure()}"
                + (f"; it printed {signature}" if signature else "; no start-failure signature"),
            )
        )
    return lines


def _healthy(events: list[UnitEvent], rows: list[Row]) -> str | None:
    """The newest run that started and did not fail afterwards, as far as the journal goes.

    Failed as the detector counts it (core.loopruns): a main process that exited unclean, a
    failure result, a failed start job, the start limit; ended: a clean end or a stop.
    """
    boot = events[-1].boot_id if events else None
    runs = runs_of(e for e in events if e.boot_id == boot)
    started = [run for run in runs if run.started_s is not None]
    if not started:
        return None
    run = started[-1]
    stopped = any(
        e.kind is EventKind.STOPPED and e.invocation_id == run.invocation_id for e in events
    )
    if run.failure_s is not None or run.deactivated_s is not None or stopped or run is not runs[-1]:
        return None
    began = run.started_s or 0.0
    last = max((r.monotonic_s for r in rows if r.boot_id == boot), default=began)
    return (
        f"run {short_run(_named(run))} started and has not failed since "
        f"({last - began:.1f} s of journal after its start)"
    )


def _named(run: Run) -> str | None:
    """The run's invocation ID as the rows name it (None for one the journal named not)."""
    return None if run.invocation_id.startswith(UNNAMED) else run.invocation_id


_REQUESTER = re.compile(r"gate for \S{1,300} from PID (?P<pid>\d{1,10}): ")
_OUTCOME = re.compile(r"reap outcome: pid=\d{1,10} outcome=(?P<outcome>[a-z-]{1,20}); ")


def prevented_in(rows: list[Row], each_s: float | None) -> str | None:
    """The failed starts the rows show gpuguard prevented (core.prevented's rule), in words.

    A gate request (the gate server's lines, one requester PID) whose reaper ended a holder
    (exited, killed) and that then exited 0 let a start through it healed; a daemon's
    ``recovery finished`` with ``result=restarted`` ended a loop. Each counts 1.
    """
    healed: set[str] = set()
    by_gate = by_daemon = 0
    for row in rows:
        if row.source != GPUGUARD:
            continue
        if row.kind == "recovery-finished" and "result=restarted" in row.text:
            by_daemon += 1
            continue
        outcome = _OUTCOME.match(row.text) if row.kind == "reap-outcome" else None
        text = row.text[outcome.end() :] if outcome else row.text
        requester = _REQUESTER.match(text)
        if requester is None:
            continue
        if outcome is not None and outcome["outcome"] in HEALED_OUTCOMES:
            healed.add(requester["pid"])
        elif row.kind == "gate-exit":
            if requester["pid"] in healed and text.endswith(": exit 0"):
                by_gate += 1
            healed.discard(requester["pid"])
    return in_words(Prevented(by_gate, by_daemon, each_s))
