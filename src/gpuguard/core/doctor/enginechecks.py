"""doctor's checks of systemd's timeouts and restart policy against the server's own settings.

``engines`` reads what ExecStart= told the server (vLLM's drain and ready timeouts, SGLang's
watchdog); each check here compares one of them with the unit's settings and its learned
starts, says where each number came from, and proposes a drop-in line only from numbers it
understood. The command line appears only through ``display_command``: a server's ``--api-key``
never reaches doctor's text, ``--json`` or ``--fix``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from gpuguard.core.doctor.engines import (
    SGLANG,
    SGLANG_FORCE_SHUTDOWN,
    VLLM,
    VLLM_READY_VARIABLE,
    Engine,
    Setting,
    read_engine,
)
from gpuguard.core.doctor.findings import Finding, round_up, span
from gpuguard.core.levels import Level
from gpuguard.core.redaction import display_command
from gpuguard.core.startbudgets import BUDGET_FACTOR, BUDGET_SLACK_S, MIN_STARTS, budget_for

if TYPE_CHECKING:
    from gpuguard.core.doctor.facts import AuditedUnit

ENGINE_STOP_MARGIN_S: Final = 30.0
"""TimeoutStopSec= must be the server's own drain budget plus this: after its drain the server
still tears down (its engine and worker processes exit, their CUDA contexts give the GPUs'
memory back), and ExecStopPost= (the gate's reap) runs inside the same timeout. llm-d's guides
(llm-d PR #1653) leave vLLM 30 s beyond its drain: a 30 s drain in a 60 s grace period, 300 s
in 330 s for wide-EP DeepSeek-R1."""
STOP_CEILING_S: Final = 600.0
"""The longest TimeoutStopSec= doctor proposes (checks.DRAIN_CEILING_S: a drain past 10 min is
hung, and each minute of it holds the unit's GPUs at every stop)."""
EXIT_0_HOLES: Final = frozenset({"on-failure", "on-abnormal", "on-abort", "on-watchdog"})
"""The Restart= values that never restart a main process that exited 0 (systemd.service(5))."""
COMMAND_CHARS: Final = 300
_KNOWN: Final = (
    "doctor reads vLLM (`vllm serve`, `python -m vllm.entrypoints.openai.api_server`) and "
    "SGLang (`python -m sglang.launch_server`, `sglang serve`)"
)


def engine_of(facts: AuditedUnit) -> Engine:
    """The server the unit's ExecStart= runs, read from its effective settings."""
    return read_engine(facts.config.exec_start, facts.environment, facts.config.environment)


def _command(engine: Engine) -> str:
    return f"ExecStart= runs: {display_command(engine.argv, COMMAND_CHARS)}"


def engine_read(engine: Engine) -> list[Finding]:
    """What doctor understood of the server's command line, and what it did not."""
    if engine.name is None:
        return [
            Finding(
                "engine",
                Level.OK,
                "doctor does not know the server ExecStart= runs: its own drain and ready "
                "timeouts are not checked",
                (*([_command(engine)] if engine.argv else []), *engine.unread, _KNOWN),
            )
        ]
    settings = [
        f"{label}: {_value(setting.value_s)} ({setting.source})"
        for label, setting in (
            ("drain after SIGTERM", engine.drain),
            ("engine ready timeout", engine.ready),
            ("watchdog on a hung batch", engine.watchdog),
        )
        if setting is not None
    ]
    if engine.name == SGLANG:
        settings.insert(
            0,
            "drain after SIGTERM: until no request is left, no bound of its own"
            + (f" ({SGLANG_FORCE_SHUTDOWN} set: skipped)" if engine.force_shutdown else ""),
        )
    title = f"ExecStart= runs {engine.name}" + (
        f"; {len(engine.unread)} of its settings not understood" if engine.unread else ""
    )
    return [Finding("engine", Level.OK, title, (_command(engine), *settings, *engine.unread))]


def _value(seconds: float | None) -> str:
    return "not understood" if seconds is None else f"{seconds:g} s"


def engine_drain(facts: AuditedUnit, engine: Engine) -> list[Finding]:
    """TimeoutStopSec= against the drain the server was told to allow itself."""
    timeout = facts.config.timeout_stop_s
    shown = "infinity" if timeout is None else span(timeout)
    if engine.name == SGLANG:
        return [_sglang_drain(engine, timeout, shown)]
    if engine.name != VLLM or engine.drain is None:
        return []
    drain = engine.drain
    if drain.value_s is None:
        return [
            Finding(
                "engine-drain",
                Level.OK,
                f"vLLM's drain budget is not understood: TimeoutStopSec={shown} not compared "
                "with it",
                engine.unread,
            )
        ]
    needed = drain.value_s + ENGINE_STOP_MARGIN_S
    said = (
        f"vLLM drains {span(drain.value_s) if drain.value_s else 'for 0 s'} after SIGTERM "
        f"({drain.source}"
        + ("; 0 aborts every request in flight at once" if not drain.value_s else "")
        + f"), then tears down: TimeoutStopSec= needs {span(needed)} "
        f"(its drain + {span(ENGINE_STOP_MARGIN_S)})"
    )
    if timeout is None or timeout >= needed:
        return [
            Finding(
                "engine-drain",
                Level.OK,
                f"TimeoutStopSec={shown} covers vLLM's own drain and its teardown",
                (said,),
            )
        ]
    proposal = round_up(needed)
    title = (
        f"TimeoutStopSec={shown} cuts vLLM's own drain short: SIGKILL comes before the "
        f"{span(drain.value_s)} it was told to wait for requests in flight"
        if timeout <= drain.value_s
        else f"TimeoutStopSec={shown} leaves vLLM less than {span(ENGINE_STOP_MARGIN_S)} to "
        "tear down after its drain"
    )
    if proposal > STOP_CEILING_S:
        return [
            Finding(
                "engine-drain",
                Level.WARNING,
                title,
                (said,),
                advice=(
                    f"a stop of {span(needed)} is past the {span(STOP_CEILING_S)} doctor proposes "
                    "at most (each minute of it holds the unit's GPUs): lower vLLM's "
                    f"--shutdown-timeout to at most "
                    f"{STOP_CEILING_S - ENGINE_STOP_MARGIN_S:g}, or set TimeoutStopSec= above "
                    "it by hand"
                ),
            )
        ]
    return [
        Finding(
            "engine-drain",
            Level.WARNING,
            title,
            (said,),
            (
                f"# vLLM's drain ({drain.source}) + {span(ENGINE_STOP_MARGIN_S)} of teardown",
                f"TimeoutStopSec={span(proposal)}",
            ),
        )
    ]


def _sglang_drain(engine: Engine, timeout: float | None, shown: str) -> Finding:
    """SGLang drains until no request is left: only TimeoutStopSec= bounds its stop."""
    watchdog = engine.watchdog
    evidence = [
        (
            "SGLang's drain after SIGTERM waits, every 5 s, until no request is left, with no "
            "bound of its own (TokenizerManager.sigterm_watchdog)"
        ),
    ]
    if watchdog is not None and watchdog.value_s is not None:
        evidence.append(
            f"a forward batch hung past {watchdog.value_s:g} s crashes the server "
            f"({watchdog.source}): a stuck request is no longer waited for after that"
        )
    if engine.force_shutdown:
        return Finding(
            "engine-drain",
            Level.OK,
            f"SGLang skips its drain ({SGLANG_FORCE_SHUTDOWN} is set): requests in flight fail "
            "at a stop",
        )
    if timeout is None:
        return Finding(
            "engine-drain",
            Level.WARNING,
            "TimeoutStopSec=infinity and SGLang's unbounded drain: a stop can wait forever on a "
            "request that never ends",
            tuple(evidence),
            advice=(
                "set TimeoutStopSec= from the drains the stop-timeout finding measured, at most "
                f"{span(STOP_CEILING_S)}"
            ),
        )
    return Finding(
        "engine-drain",
        Level.OK,
        f"SGLang's drain has no bound of its own: TimeoutStopSec={shown} is what ends it (the "
        "stop-timeout finding says whether the drains seen fit)",
        tuple(evidence),
    )


def engine_ready(facts: AuditedUnit, engine: Engine) -> list[Finding]:
    """The engine ready timeout vLLM was given, against the starts the daemon learned."""
    ready = engine.ready
    if engine.name != VLLM or ready is None:
        return []
    if ready.value_s is None:
        return [
            Finding(
                "engine-ready",
                Level.OK,
                "vLLM's engine ready timeout is not understood: not compared with the learned "
                "starts",
                engine.unread,
            )
        ]
    said = f"vLLM's engine cores must be ready within {span(ready.value_s)} ({ready.source})"
    starts = facts.learned.ready_s if facts.learned is not None else ()
    if not starts:
        return [
            Finding(
                "engine-ready",
                Level.OK,
                f"vLLM's engine ready timeout is {span(ready.value_s)}; no learned start to "
                "compare it with",
                (said, "gpuguard's daemon learns each start of a unit it watches"),
            )
        ]
    return [_ready_against(engine, ready, said, starts)]


def _ready_against(engine: Engine, ready: Setting, said: str, starts: tuple[float, ...]) -> Finding:
    """The ready timeout (understood: ``ready.value_s`` is set) against the learned ``starts``."""
    ready_s = ready.value_s or 0.0
    longest = max(starts)
    proposal = float(round_up(budget_for(longest)))
    basis = (
        f"the longest learned start ({span(longest)}, systemd's Starting → the server's ready "
        f"line, more than the engine's own part) x {BUDGET_FACTOR:g}, at least the longest + "
        f"{span(BUDGET_SLACK_S)}"
    )
    evidence = (said, f"{len(starts)} learned starts; their budget: {span(proposal)} ({basis})")
    if len(starts) < MIN_STARTS:
        return Finding(
            "engine-ready",
            Level.OK,
            f"vLLM's engine ready timeout is {span(ready_s)}; too few learned starts "
            f"to judge it ({len(starts)} of {MIN_STARTS})",
            (*evidence, "a guess, not a proposal: run doctor again after more starts"),
        )
    if ready_s >= proposal:
        return Finding(
            "engine-ready",
            Level.OK,
            f"vLLM's engine ready timeout ({span(ready_s)}) covers every learned start",
            evidence,
        )
    title = (
        f"vLLM's engine ready timeout ({span(ready_s)}) is below what the learned starts "
        f"need ({span(proposal)}): a slow load fails there and the unit restarts into another "
        "load"
    )
    line = f'Environment="{VLLM_READY_VARIABLE}={proposal:.0f}"'
    if not engine.ready_settable:
        return Finding(
            "engine-ready",
            Level.WARNING,
            title,
            evidence,
            advice=f"set {VLLM_READY_VARIABLE}={proposal:.0f} where it is set now "
            f"({ready.source}): a drop-in's Environment= does not win over it",
        )
    return Finding(
        "engine-ready",
        Level.WARNING,
        title,
        evidence,
        (f"# {len(starts)} learned starts: {basis}", line),
    )


def exit_zero(facts: AuditedUnit, engine: Engine) -> list[Finding]:
    """Restart= that never restarts vLLM's exit 0 after its engine died (vLLM issue #48966)."""
    restart = facts.config.restart
    if engine.name != VLLM or restart not in EXIT_0_HOLES:
        return []
    evidence = (
        (
            "vLLM can exit 0 after its engine died (vLLM issue #48966, open): systemd records "
            f"Result=success and Restart={restart} leaves the unit down"
        ),
    )
    if facts.on_engine_dead == "recover" and facts.clean_exit_is_death:
        return [
            Finding(
                "exit-0",
                Level.OK,
                f"Restart={restart} on a vLLM unit: gpuguard's daemon restarts a run that ended "
                '0 with no stop asked (on_engine_dead = "recover")',
                evidence,
            )
        ]
    return [
        Finding(
            "exit-0",
            Level.WARNING,
            f"Restart={restart} on a vLLM unit: an exit 0 after its engine died leaves the unit "
            "down",
            evidence,
            ("# restart after an exit 0 too (vLLM issue #48966)", "Restart=always"),
            advice=(
                "the other fix, instead of Restart=always: opt in to the daemon's recovery of an "
                'exit 0 nobody asked for, on_engine_dead = "recover" in the unit\'s section of '
                "gpuguard's configuration"
                + (
                    ""
                    if facts.clean_exit_is_death
                    else " and [daemon] clean_exit_is_death = true (off now: to the daemon an "
                    "exit 0 is no dead engine)"
                )
            ),
        )
    ]
