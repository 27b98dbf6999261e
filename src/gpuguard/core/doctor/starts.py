"""doctor's proposals for how long a start may take: TimeoutStartSec= and the gate's timeout.

A fixed start timeout is wrong at one end: it kills a healthy slow load, or waits forever on a
hang. So these checks take their numbers from the unit's own past: the starts gpuguard's daemon
saw come up (``core.liveness``, saved in the unit's state) and the gate's recorded waits for
idle GPUs. A number is proposed only with ``MIN_STARTS`` of them behind it, by the same rule the
daemon's start budgets use (the longest x 1.5, at least the longest + 60 s); with fewer, doctor
says how many it has and labels what they suggest a guess, in the evidence, never a fix line.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Final

from gpuguard.core.doctor.findings import VALUE_CHARS, Finding, round_up, show, span
from gpuguard.core.levels import Level
from gpuguard.core.startbudgets import BUDGET_FACTOR, BUDGET_SLACK_S, MIN_STARTS, budget_for

if TYPE_CHECKING:
    from gpuguard.core.doctor.facts import AuditedUnit

WAITS_FOR_READY: Final = frozenset({"notify", "notify-reload"})
"""The service types whose start job lasts until the server says it is ready (sd_notify): only
for them does TimeoutStartSec= bound the model load. Type=simple's start ends at the fork,
exec's at the execve (systemd.service(5), Type=)."""
ENDS_AT_EXEC: Final = frozenset({"simple", "exec", "idle"})
"""The types whose start job ends when the server's process is running, before any load."""


def _rule(longest_s: float) -> str:
    """How a proposal follows from the longest learned time, in words."""
    return (
        f"the longest ({span(longest_s)}) x {BUDGET_FACTOR:g}, at least the longest "
        f"+ {span(BUDGET_SLACK_S)}"
    )


def start_timeout(facts: AuditedUnit, gate_s: float | None) -> list[Finding]:
    """TimeoutStartSec= against the starts that came up; ``gate_s``: the gate's timeout, if gated.

    A start's time includes the gate's wait in those runs; a future start may wait up to the
    gate's whole timeout before its load, so a gated proposal adds that timeout.
    """
    learned = facts.learned
    if learned is None:
        return []
    config = facts.config
    timeout = config.timeout_start_s
    shown = "infinity" if timeout is None else span(timeout)
    source = show(learned.source, VALUE_CHARS)
    unread = tuple(f"{source}: {problem}" for problem in learned.problems)
    starts = learned.ready_s
    if not starts:
        return [
            Finding(
                "start-timeout",
                Level.OK,
                f"TimeoutStartSec={shown}; no start that came up is learned yet",
                (
                    f"gpuguard's daemon saves each start that reaches its ready line in {source}",
                    *unread,
                ),
            )
        ]
    longest = max(starts)
    evidence = [
        (
            f"{len(starts)} starts came up (systemd's Starting → the server's ready line), as "
            f"gpuguard's daemon saved them in {source}: median "
            f"{span(statistics.median(starts))}, longest {span(longest)}"
        ),
        *unread,
    ]
    proposal = round_up(budget_for(longest) + (gate_s or 0.0))
    basis = _rule(longest) + (
        f", plus the gate's timeout ({span(gate_s)}) a start may wait for idle GPUs"
        if gate_s is not None
        else ""
    )
    if config.type not in WAITS_FOR_READY:
        evidence.append(
            "gpuguard's daemon reports a start stuck once one of its phases runs past the "
            "budget the learned starts taught (`gpuguard status`, gpuguard_unit_start_stuck)"
        )
        title = (
            f"Type={config.type}: systemd's start ends before the server is ready, so "
            "TimeoutStartSec= bounds the gate's ExecStartPre=, not the model load"
            if config.type in ENDS_AT_EXEC
            else f"Type={config.type or 'unknown'}: doctor cannot tell when systemd's start "
            "ends against the server's ready line; no TimeoutStartSec= proposed"
        )
        return [Finding("start-timeout", Level.OK, title, tuple(evidence))]
    if len(starts) < MIN_STARTS:
        evidence.append(
            f"a guess from {len(starts)}, not a proposal: TimeoutStartSec={span(proposal)} "
            f"({basis}); run doctor again after {MIN_STARTS - len(starts)} more starts"
        )
        return [
            Finding(
                "start-timeout",
                Level.OK,
                f"TimeoutStartSec={shown}; too few learned starts to propose one "
                f"({len(starts)} of {MIN_STARTS})",
                tuple(evidence),
            )
        ]
    return [_against(timeout, len(starts), proposal, basis, tuple(evidence))]


def _against(
    timeout: float | None, starts: int, proposal: float, basis: str, evidence: tuple[str, ...]
) -> Finding:
    """TimeoutStartSec= (None: infinity) against the proposal ``starts`` learned starts back."""
    if timeout is not None and timeout >= proposal:
        return Finding(
            "start-timeout",
            Level.OK,
            f"TimeoutStartSec={span(timeout)} covers every learned start",
            (*evidence, f"their budget: {span(proposal)} ({basis})"),
        )
    fix = (f"# {starts} learned starts: {basis}", f"TimeoutStartSec={span(proposal)}")
    if timeout is None:
        return Finding(
            "start-timeout",
            Level.OK,
            "TimeoutStartSec=infinity: systemd never ends a hung start; the learned starts "
            f"suggest {span(proposal)}",
            evidence,
            fix,
        )
    return Finding(
        "start-timeout",
        Level.WARNING,
        f"TimeoutStartSec={span(timeout)} can kill a healthy slow start: the learned starts "
        f"need {span(proposal)}",
        evidence,
        fix,
    )


def gate_wait(facts: AuditedUnit, gate_s: float | None) -> list[Finding]:
    """The gate's timeout (``gate_s``, None: no gate) against how long it waited before."""
    waits = facts.gate_waits
    if waits is None or gate_s is None:
        return []
    source = show(waits.source, VALUE_CHARS)
    waited = waits.waited_s
    evidence = [
        (
            f"{len(waited)} starts waited for idle GPUs and passed, {waits.refused} were "
            f"refused (the gate's decisions since boot, {source})"
        )
    ]
    if not waited:
        return [
            Finding(
                "gate-wait",
                Level.OK,
                f"the gate's timeout is {span(gate_s)}; no recorded start had to wait",
                tuple(evidence),
            )
        ]
    longest = max(waited)
    evidence.append(f"waits: median {span(statistics.median(waited))}, longest {span(longest)}")
    proposal = round_up(budget_for(longest))
    if len(waited) < MIN_STARTS:
        evidence.append(
            f"a guess from {len(waited)}, not a proposal: a gate timeout of {span(proposal)} "
            f"({_rule(longest)})"
        )
        return [
            Finding(
                "gate-wait",
                Level.OK,
                f"the gate's timeout is {span(gate_s)}; too few recorded waits to propose one "
                f"({len(waited)} of {MIN_STARTS})",
                tuple(evidence),
            )
        ]
    if gate_s >= proposal:
        return [
            Finding(
                "gate-wait",
                Level.OK,
                f"the gate's timeout ({span(gate_s)}) covers every recorded wait",
                tuple(evidence),
            )
        ]
    return [
        Finding(
            "gate-wait",
            Level.WARNING,
            f"the gate's timeout ({span(gate_s)}) is close to its longest wait "
            f"({span(longest)}): a start that waits a little longer is refused",
            tuple(evidence),
            advice=f"a gate timeout of {proposal:g} s ({_rule(longest)}): gate_timeout_s in "
            "gpuguard's configuration, or --timeout on the gate's ExecStartPre= line when it "
            "has one; TimeoutStartSec= at least 60 s above it",
        )
    ]
