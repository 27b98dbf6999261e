"""Restart-loop detection: windows, runs by invocation, immediate signs, causes, and replays."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import replace
from datetime import timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.core.detector import Cause, Detector, Diagnosis, GpuEvidence, LoopSettings
from gpuguard.core.events import MESSAGE_IDS, EventKind, UnitEvent, parse_entry
from gpuguard.core.startfailure import FailureClass

if TYPE_CHECKING:
    import random
    from collections.abc import Callable

UNIT = "sglang.service"
OTHER = "vllm.service"
T0 = 1_795_970_000.0
W = 600.0
IDLE = GpuEvidence()
SAMPLES = Path(__file__).resolve().parents[1] / "journal_samples"
RELEASES = ["bookworm", "trixie"]
ID_OF_KIND = {kind: message_id for message_id, kind in MESSAGE_IDS.items()}
OOM_LINE = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
OOM_SIGNATURE = "PyTorch: CUDA out of memory"  # the most specific of the two it matches
# What PID 1 says for the kinds that have no MESSAGE_ID (the parser matches these texts).
TEXTS = {
    EventKind.LEFT_OVER_PROCESS: (
        "sglang.service: Found left-over process {pid} ({comm}) in control group while "
        "starting unit. Ignoring."
    ),
    EventKind.STOP_TIMED_OUT: "sglang.service: State '{state}' timed out. Killing.",
    EventKind.SURVIVED_SIGKILL: "sglang.service: Processes still around after {which}SIGKILL.",
    EventKind.START_LIMIT_HIT: "sglang.service: Start request repeated too quickly.",
    EventKind.MAIN_EXITED: "sglang.service: Main process exited, code={code}, status={status}",
}


def inv(number: int) -> str:
    """The invocation ID of run ``number``."""
    return f"{number:032x}"


CURSORS = itertools.count(1)


class Journal:
    """Hands out events with fresh cursors and microsecond times, as the journal would."""

    def event(
        self,
        kind: EventKind,
        at: float,
        invocation: str | None,
        *,
        unit: str = UNIT,
        exit_code: str | None = None,
        exit_status: int | None = None,
        signal: str | None = None,
        result: str | None = None,
        n_restarts: int | None = None,
        pid: int | None = None,
        comm: str | None = None,
        final: bool = False,
        job_type: str | None = None,
    ) -> UnitEvent:
        """One event, its message as systemd (or the unit) would write it."""
        template = TEXTS.get(kind, f"{kind.value} {UNIT}")
        message = OOM_LINE if kind is EventKind.GPU_OOM_OUTPUT else template
        message = message.format(
            pid=pid,
            comm=comm,
            state="final-sigterm" if final else "stop-sigterm",
            which="final " if final else "",
            code=exit_code,
            status=exit_status,
        )
        return UnitEvent(
            kind=kind,
            unit=unit,
            monotonic_s=round(at * 1_000_000) / 1_000_000,
            realtime_s=round(at * 1_000_000) / 1_000_000,
            cursor=f"s=test;i={next(CURSORS):x}",
            invocation_id=invocation,
            boot_id="b" * 32,
            message=message,
            exit_code=exit_code,
            exit_status=exit_status,
            signal=signal,
            result=result,
            n_restarts=n_restarts,
            pid=pid,
            comm=comm,
            final=final,
            job_type=job_type,
            failure=FailureClass.MEMORY if kind is EventKind.GPU_OOM_OUTPUT else None,
            signature=OOM_SIGNATURE if kind is EventKind.GPU_OOM_OUTPUT else None,
        )

    def failed_run(
        self,
        number: int,
        at: float,
        *,
        status: int = 1,
        result: str = "exit-code",
        oom: bool = False,
        n_restarts: int | None = None,
    ) -> list[UnitEvent]:
        """A run that starts at ``at``, exits with ``status`` 2 s later and fails."""
        run = inv(number)
        events = [self.event(EventKind.STARTED, at, run)]
        if oom:
            events.append(self.event(EventKind.GPU_OOM_OUTPUT, at + 1, run))
        events += [
            self.event(EventKind.MAIN_EXITED, at + 2, run, exit_code="exited", exit_status=status),
            self.event(EventKind.FAILED, at + 2.01, run, result=result),
        ]
        if n_restarts is not None:
            events.append(
                self.event(EventKind.RESTART_SCHEDULED, at + 3, run, n_restarts=n_restarts)
            )
        return events

    def clean_run(self, number: int, at: float, stop_at: float) -> list[UnitEvent]:
        """A run that starts at ``at`` and is stopped cleanly at ``stop_at``."""
        run = inv(number)
        return [
            self.event(EventKind.STARTED, at, run),
            self.event(EventKind.STOPPING, stop_at, run),
            self.event(EventKind.DEACTIVATED, stop_at + 0.01, run),
            self.event(EventKind.STOPPED, stop_at + 0.02, run),
        ]


def fed(events: list[UnitEvent], settings: LoopSettings | None = None) -> Detector:
    """A detector that has observed ``events`` live, in the order given."""
    detector = Detector(UNIT, settings)
    for event in events:
        detector.observe(event, live=True)
    return detector


def failures(count: int, *, spacing: float = 20.0, oom: bool = False) -> list[UnitEvent]:
    """``count`` failed runs, one every ``spacing`` seconds from T0, all exiting with status 1."""
    journal = Journal()
    return [
        event
        for number in range(count)
        for event in journal.failed_run(number, T0 + number * spacing, oom=oom)
    ]


def sample_events(release: str, name: str) -> list[UnitEvent]:
    """The events the parser finds in a recorded sample."""
    lines = (SAMPLES / release / f"{name}.jsonl").read_text().splitlines()
    parsed = (parse_entry(json.loads(line), UNIT) for line in lines)
    return [event for event in parsed if event is not None]


def journal_entry(event: UnitEvent, *, forged: bool = False) -> dict[str, object]:
    """The journal entry systemd (or the unit, for output) writes for ``event``.

    ``forged`` gives the same fields sent by an unprivileged user: only journald's trusted
    fields differ.
    """
    entry: dict[str, object] = {
        "__CURSOR": event.cursor + (";forged" if forged else ""),
        "__REALTIME_TIMESTAMP": str(round((event.realtime_s or 0) * 1_000_000)),
        "__MONOTONIC_TIMESTAMP": str(round(event.monotonic_s * 1_000_000)),
        "_BOOT_ID": event.boot_id,
        "MESSAGE": event.message,
    }
    if event.kind is EventKind.GPU_OOM_OUTPUT:
        entry |= {
            "_PID": "57",
            "_UID": "0",
            "_TRANSPORT": "stdout",
            "_SYSTEMD_UNIT": OTHER if forged else event.unit,
            "_SYSTEMD_INVOCATION_ID": event.invocation_id,
        }
        return entry
    entry |= {
        "_PID": "4242" if forged else "1",
        "_UID": "1000" if forged else "0",
        "_SYSTEMD_CGROUP": "/user.slice/user-1000.slice" if forged else "/init.scope",
        "_TRANSPORT": "journal",
        "UNIT": event.unit,
        "INVOCATION_ID": event.invocation_id,
    }
    if event.kind in ID_OF_KIND:
        entry["MESSAGE_ID"] = ID_OF_KIND[event.kind]
    optional = {
        "EXIT_CODE": event.exit_code,
        "EXIT_STATUS": None if event.exit_status is None else str(event.exit_status),
        "UNIT_RESULT": event.result if event.kind is EventKind.FAILED else None,
        "JOB_RESULT": event.result if event.kind is EventKind.START_FAILED else None,
        "N_RESTARTS": None if event.n_restarts is None else str(event.n_restarts),
        "COMMAND": "ExecStart" if event.kind is EventKind.MAIN_EXITED else None,
    }
    entry |= {key: value for key, value in optional.items() if value is not None}
    return entry


SHAPES = ["fail", "fail-oom", "killed", "clean", "up", "left-over", "timeout", "start-limit"]


@st.composite
def scenarios(draw: st.DrawFn) -> list[UnitEvent]:
    """A plausible history of runs: failures, clean runs, left-overs, stop timeouts, limits."""
    journal = Journal()
    events: list[UnitEvent] = []
    at = T0
    restarts = 0
    for number in range(draw(st.integers(min_value=0, max_value=8))):
        at += draw(st.integers(min_value=1, max_value=400))
        shape = draw(st.sampled_from(SHAPES))
        run = inv(number)
        if shape in {"fail", "fail-oom"}:
            restarts += 1
            status = draw(st.sampled_from([1, 2]))
            events += journal.failed_run(
                number, at, status=status, oom=shape == "fail-oom", n_restarts=restarts
            )
        elif shape == "killed":
            events += [
                journal.event(EventKind.STARTED, at, run),
                journal.event(
                    EventKind.MAIN_EXITED,
                    at + 5,
                    run,
                    exit_code="killed",
                    exit_status=9,
                    signal="KILL",
                ),
                journal.event(EventKind.FAILED, at + 5.01, run, result="signal"),
            ]
        elif shape == "clean":
            events += journal.clean_run(number, at, at + draw(st.integers(1, 500)))
        elif shape == "up":
            events.append(journal.event(EventKind.STARTED, at, run))
        elif shape == "left-over":
            events += [
                journal.event(EventKind.LEFT_OVER_PROCESS, at, run, pid=65, comm="sglang-worker"),
                journal.event(EventKind.STARTING, at + 0.01, run),
                journal.event(EventKind.STARTED, at + 0.02, run),
            ]
        elif shape == "timeout":
            events += [
                journal.event(EventKind.STARTED, at, run),
                journal.event(EventKind.STOPPING, at + 30, run),
                journal.event(EventKind.STOP_TIMED_OUT, at + 120, run),
                journal.event(EventKind.FAILED, at + 120.01, run, result="timeout"),
            ]
        else:
            restarts += 1
            events += journal.failed_run(number, at, n_restarts=restarts)
            events.append(journal.event(EventKind.START_LIMIT_HIT, at + 3.5, run))
    return events


# --- thresholds and windows --------------------------------------------------------------------


@given(
    min_starts=st.integers(min_value=1, max_value=6),
    count=st.integers(min_value=0, max_value=8),
)
def test_n_minus_one_failures_is_not_a_loop_but_n_is(min_starts: int, count: int) -> None:
    """Fewer than min_starts failed runs in a row is no loop; min_starts of them is one."""
    settings = LoopSettings(min_starts=min_starts)
    detector = fed(failures(count), settings)
    diagnosis = detector.diagnose(T0 + count * 20 + 5, IDLE)
    assert diagnosis.looping is (count >= min_starts)
    assert diagnosis.failures_in_window == count
    assert diagnosis.starts_in_window == count
    assert not diagnosis.immediate


def test_three_failures_in_ten_minutes_is_a_loop() -> None:
    """A unit that fails 3 times within 600 s is reported as looping, with one line per failure."""
    diagnosis = fed(failures(3)).diagnose(T0 + 60, IDLE)
    assert diagnosis.looping
    assert diagnosis.reason.startswith("3 failed runs in a row within 600 s")
    assert diagnosis.first_failure_s == pytest.approx(T0 + 2)
    assert [line for line in diagnosis.evidence if "failed:" in line] == [
        f"{clock} run {inv(number)[:8]}… failed: exit-code (status 1)"
        for number, clock in enumerate(["16:33:22", "16:33:42", "16:34:02"])
    ]


@pytest.mark.parametrize(("offset", "looping"), [(0.0, True), (0.001, False)])
def test_failure_just_inside_the_window_counts_just_outside_does_not(
    offset: float, *, looping: bool
) -> None:
    """A failure exactly window_s before now counts; one a millisecond older does not."""
    events = failures(3, spacing=100)
    oldest_failure = T0 + 2.01
    diagnosis = fed(events).diagnose(oldest_failure + W + offset, IDLE)
    assert diagnosis.looping is looping
    assert diagnosis.failures_in_window == (3 if looping else 2)


def test_failures_spread_wider_than_the_window_are_no_loop() -> None:
    """Three failures five minutes apart never fit three into a 300 s window."""
    settings = LoopSettings(window_s=300)
    events = failures(3, spacing=301)
    assert not fed(events, settings).diagnose(T0 + 2 * 301 + 10, IDLE).looping


def test_events_older_than_the_window_before_the_newest_are_dropped() -> None:
    """The detector keeps only the events within window_s of the newest one it saw."""
    events = failures(4, spacing=300)
    detector = fed(events)
    assert min(event.monotonic_s for event in detector.events) >= T0 + 900 - W
    stale = replace(events[0], cursor="s=test;i=late")
    assert not detector.observe(stale, live=True)


# --- runs are invocations; trust ---------------------------------------------------------------


def test_many_messages_of_one_run_count_once() -> None:
    """PID 1 logs many lines per run (252 more than 257): one invocation is one run."""
    journal = Journal()
    run = inv(7)
    events = [
        journal.event(EventKind.STARTING, T0, run),
        journal.event(EventKind.STARTED, T0 + 1, run),
        journal.event(EventKind.MAIN_EXITED, T0 + 2, run, exit_code="exited", exit_status=1),
        journal.event(EventKind.FAILED, T0 + 3, run, result="exit-code"),
        # A counter at the threshold with a failed start is a loop by itself (the counter rule):
        # a low one keeps this test about counting runs.
        journal.event(EventKind.RESTART_SCHEDULED, T0 + 4, run, n_restarts=1),
        journal.event(EventKind.STOPPED, T0 + 5, run),
        # (no start-limit line: systemd ending a loop is a loop by itself)
        journal.event(EventKind.FAILED, T0 + 7, run, result="exit-code"),
        journal.event(EventKind.START_FAILED, T0 + 8, run, result="failed"),
    ]
    diagnosis = fed(events).diagnose(T0 + 10, IDLE)
    assert (diagnosis.starts_in_window, diagnosis.failures_in_window) == (1, 1)
    assert not diagnosis.looping


def test_other_units_are_ignored() -> None:
    """Events of another unit are not recorded and never ask for a judgement."""
    journal = Journal()
    detector = Detector(UNIT)
    for number in range(5):
        event = journal.event(EventKind.FAILED, T0 + number, inv(number), unit=OTHER)
        assert not detector.observe(event, live=True)
    assert detector.events == ()
    assert not detector.diagnose(T0 + 10, IDLE).looping


@given(scenarios())
def test_parsing_a_journal_entry_gives_back_its_event(events: list[UnitEvent]) -> None:
    """The test journal's entries parse back to exactly the events they were made from."""
    for event in events:
        assert parse_entry(journal_entry(event), UNIT) == event


@given(scenarios(), st.randoms(use_true_random=False))
def test_forged_and_foreign_entries_never_count_as_churn(
    events: list[UnitEvent], rng: random.Random
) -> None:
    """Copies sent by a user, not PID 1 (or printed by another unit), change no diagnosis."""
    entries = [journal_entry(event) for event in events]
    forged = [journal_entry(event, forged=True) for event in events]
    foreign = [
        {**entry, "UNIT": OTHER, "__CURSOR": f"{entry['__CURSOR']};other"} for entry in entries
    ]
    mixed = entries + rng.sample(forged, len(forged)) + foreign
    mixed.sort(key=lambda entry: int(str(entry["__MONOTONIC_TIMESTAMP"])))
    honest, tampered = Detector(UNIT), Detector(UNIT)
    for entry in entries:
        event = parse_entry(entry, UNIT)
        assert event is not None
        honest.observe(event, live=True)
    for entry in mixed:
        event = parse_entry(entry, UNIT)
        if event is not None:
            tampered.observe(event, live=True)
    now = max((event.monotonic_s for event in events), default=T0) + 1
    assert tampered.diagnose(now, IDLE) == honest.diagnose(now, IDLE)


# --- replays, duplicates, order ----------------------------------------------------------------


@given(scenarios())
def test_replayed_history_never_asks_for_action(events: list[UnitEvent]) -> None:
    """History observed with live=False never returns True, yet informs later diagnoses."""
    replayed = Detector(UNIT)
    assert not any(replayed.observe(event, live=False) for event in events)
    now = max((event.monotonic_s for event in events), default=T0) + 1
    assert replayed.diagnose(now, IDLE) == fed(events).diagnose(now, IDLE)


@given(scenarios(), st.randoms(use_true_random=False), st.integers(min_value=0, max_value=700))
def test_duplicates_and_out_of_order_arrival_change_nothing(
    events: list[UnitEvent], rng: random.Random, later: int
) -> None:
    """A journal resume that re-delivers entries, in any order, gives the same diagnosis."""
    messy = events + rng.sample(events, len(events) // 2)
    rng.shuffle(messy)
    in_order, resumed = fed(events), fed(messy)
    now = max((event.monotonic_s for event in events), default=T0) + later
    assert resumed.diagnose(now, IDLE) == in_order.diagnose(now, IDLE)
    assert resumed.diagnose(now, None) == in_order.diagnose(now, None)


def test_a_duplicate_is_not_news() -> None:
    """The same entry (same cursor) observed twice asks for a judgement only the first time."""
    event = failures(1)[-1]
    detector = Detector(UNIT)
    assert detector.observe(event, live=True)
    assert not detector.observe(event, live=True)
    assert len(detector.events) == 1


def test_stop_lines_never_ask_for_a_judgement() -> None:
    """Stopping/Stopped change no verdict; a failure does."""
    journal = Journal()
    detector = Detector(UNIT)
    assert not detector.observe(journal.event(EventKind.STOPPING, T0, inv(1)), live=True)
    assert not detector.observe(journal.event(EventKind.STOPPED, T0 + 1, inv(1)), live=True)
    failed = journal.event(EventKind.FAILED, T0 + 2, inv(1), result="exit-code")
    assert detector.observe(failed, live=True)


# --- the restart counter -----------------------------------------------------------------------


def test_high_restart_counter_is_a_loop() -> None:
    """Two failed runs with systemd's restart counter at 7 are a loop, below min_starts."""
    journal = Journal()
    events = journal.failed_run(1, T0, n_restarts=6) + journal.failed_run(2, T0 + 200, n_restarts=7)
    diagnosis = fed(events).diagnose(T0 + 210, IDLE)
    assert diagnosis.looping
    assert diagnosis.n_restarts == 7
    assert "restart counter is at 7" in diagnosis.reason


def test_restart_counter_alone_is_not_a_rate() -> None:
    """One failure with a counter grown over days (it resets only on a manual start) is no loop."""
    events = Journal().failed_run(1, T0, n_restarts=9)
    diagnosis = fed(events).diagnose(T0 + 10, IDLE)
    assert not diagnosis.looping
    assert diagnosis.n_restarts == 9


# --- immediate signs ---------------------------------------------------------------------------


def test_left_over_process_at_a_restart_after_a_failure_is_immediate() -> None:
    """A restart after a failure that finds a process of the failed run is a loop right away."""
    journal = Journal()
    events = [
        *journal.failed_run(1, T0, n_restarts=1),
        journal.event(EventKind.LEFT_OVER_PROCESS, T0 + 101, inv(2), pid=65, comm="sglang-worker"),
        journal.event(EventKind.STARTING, T0 + 101.1, inv(2)),
    ]
    diagnosis = fed(events).diagnose(T0 + 102, None)
    assert diagnosis.looping
    assert diagnosis.immediate
    assert "left-over process 65 (sglang-worker)" in diagnosis.reason


def crash_then_restart_with(comm: str, pid: int) -> list[UnitEvent]:
    """One crash (SIGKILL of the main process), then systemd's restart finding ``pid`` left over."""
    journal = Journal()
    return [
        *journal.failed_run(1, T0, n_restarts=1),
        journal.event(EventKind.LEFT_OVER_PROCESS, T0 + 101, inv(2), pid=pid, comm=comm),
        journal.event(EventKind.STARTED, T0 + 101.1, inv(2)),
    ]


def test_a_left_over_holding_no_gpu_after_one_crash_is_a_finding_not_a_loop() -> None:
    """One crash, one restart still loading, a left-over holding none of the unit's GPUs: no loop.

    A crashed vLLM leaves multiprocessing's resource_tracker (comm "python") in the cgroup; it
    holds nothing the next start needs (issue 34, real vLLM 0.32.0 under systemd 252).
    """
    events = crash_then_restart_with("python", 254)
    inventory = GpuEvidence(gpus_busy=True, holder_pids=frozenset({301}))  # the new run's engine
    diagnosis = fed(events).diagnose(T0 + 140, inventory)
    assert not diagnosis.looping
    assert not diagnosis.immediate
    assert len(diagnosis.findings) == 1
    assert "left-over process 254 (python)" in diagnosis.findings[0]
    assert "holding none of the unit's GPUs" in diagnosis.findings[0]


@pytest.mark.parametrize(
    "evidence",
    [
        None,
        GpuEvidence(gpus_busy=True, holder_pids=frozenset({109})),
        GpuEvidence(stale_holders=("PID 110 (VLLM::EngineCor) holds GPU 0: left over",)),
    ],
    ids=["no-inventory-yet", "left-over-holds-a-gpu", "a-stale-holder"],
)
def test_a_left_over_that_may_hold_a_gpu_after_a_crash_is_an_immediate_loop(
    evidence: GpuEvidence | None,
) -> None:
    """The same restart is an immediate loop while the left-over may hold the unit's GPUs."""
    diagnosis = fed(crash_then_restart_with("VLLM::Worker", 109)).diagnose(T0 + 140, evidence)
    assert diagnosis.looping
    assert diagnosis.immediate
    assert "left-over process 109 (VLLM::Worker)" in diagnosis.reason


def test_left_over_process_at_an_operators_start_is_a_finding_not_a_loop() -> None:
    """A left-over found at a start with no failure and no scheduled restart is no loop."""
    journal = Journal()
    events = [
        *journal.clean_run(1, T0, T0 + 100),
        journal.event(EventKind.LEFT_OVER_PROCESS, T0 + 101, inv(2), pid=65, comm="sglang-worker"),
        journal.event(EventKind.STARTING, T0 + 101.1, inv(2)),
    ]
    diagnosis = fed(events).diagnose(T0 + 102, None)
    assert not diagnosis.looping
    assert not diagnosis.immediate
    assert len(diagnosis.findings) == 1
    assert "left-over process 65 (sglang-worker)" in diagnosis.findings[0]
    assert "a finding, not a loop" in diagnosis.findings[0]


def test_left_over_run_that_fails_is_an_immediate_loop() -> None:
    """A run that started beside a left-over process and failed is an immediate loop."""
    journal = Journal()
    events = [
        journal.event(EventKind.LEFT_OVER_PROCESS, T0, inv(2), pid=65, comm="sglang-worker"),
        journal.event(EventKind.STARTED, T0 + 1, inv(2)),
        journal.event(EventKind.FAILED, T0 + 5, inv(2), result="exit-code"),
    ]
    assert not fed(events[:2]).diagnose(T0 + 2, None).looping
    diagnosis = fed(events).diagnose(T0 + 6, None)
    assert diagnosis.looping
    assert diagnosis.immediate


def test_stop_timeout_followed_by_a_failed_start_is_immediate() -> None:
    """A stop that timed out, then a start that failed: the next start will fail as well."""
    journal = Journal()
    events = [
        journal.event(EventKind.STARTED, T0, inv(1)),
        journal.event(EventKind.STOPPING, T0 + 100, inv(1)),
        journal.event(EventKind.STOP_TIMED_OUT, T0 + 190, inv(1)),
        journal.event(EventKind.FAILED, T0 + 190.1, inv(1), result="timeout"),
        *journal.failed_run(2, T0 + 200),
    ]
    diagnosis = fed(events).diagnose(T0 + 210, None)
    assert diagnosis.looping
    assert diagnosis.immediate
    assert "stop timed out" in diagnosis.reason


def test_stop_timeout_followed_by_a_good_start_is_no_loop() -> None:
    """A stop timeout whose next start came up and stayed up is not a sign of anything."""
    journal = Journal()
    events = [
        journal.event(EventKind.STARTED, T0, inv(1)),
        journal.event(EventKind.STOP_TIMED_OUT, T0 + 90, inv(1)),
        journal.event(EventKind.FAILED, T0 + 90.1, inv(1), result="timeout"),
        journal.event(EventKind.STARTED, T0 + 100, inv(2)),
    ]
    diagnosis = fed(events).diagnose(T0 + 100 + LoopSettings().stable_s, None)
    assert not diagnosis.looping
    assert not diagnosis.immediate


# --- causes ------------------------------------------------------------------------------------


def test_same_non_gpu_exit_each_time_is_not_gpu_related() -> None:
    """Every run exiting with status 1 and idle GPUs points away from the GPUs."""
    diagnosis = fed(failures(3)).diagnose(T0 + 60, IDLE)
    assert diagnosis.cause is Cause.NOT_GPU_RELATED
    assert "exit-code (status 1)" in diagnosis.cause_detail


@pytest.mark.parametrize(
    ("gpu", "detail"),
    [
        (None, "no GPU inventory"),
        (GpuEvidence(gpus_busy=True), "GPUs are busy"),
    ],
)
def test_without_an_idle_inventory_the_cause_is_unknown(
    gpu: GpuEvidence | None, detail: str
) -> None:
    """No inventory, or busy GPUs without a stale holder, rule nothing out."""
    diagnosis = fed(failures(3)).diagnose(T0 + 60, gpu)
    assert diagnosis.looping
    assert diagnosis.cause is Cause.UNKNOWN
    assert detail in diagnosis.cause_detail


def test_different_failures_are_an_unknown_cause() -> None:
    """Runs failing in different ways do not make a pattern."""
    journal = Journal()
    events = journal.failed_run(1, T0, status=1) + journal.failed_run(2, T0 + 20, status=2)
    events += journal.failed_run(3, T0 + 40, status=1)
    diagnosis = fed(events).diagnose(T0 + 60, IDLE)
    assert diagnosis.cause is Cause.UNKNOWN
    assert "different ways" in diagnosis.cause_detail


def test_one_failure_is_not_a_pattern() -> None:
    """A single failure is not called "not GPU related"."""
    diagnosis = fed(failures(1)).diagnose(T0 + 10, IDLE)
    assert diagnosis.cause is Cause.UNKNOWN


def test_gpu_oom_output_of_a_failed_run_points_at_stale_holders() -> None:
    """A failed run that printed "CUDA out of memory" makes the cause stale GPU holders."""
    journal = Journal()
    events = failures(2) + journal.failed_run(9, T0 + 60, oom=True)
    diagnosis = fed(events).diagnose(T0 + 70, IDLE)
    assert diagnosis.looping
    assert diagnosis.cause is Cause.STALE_GPU_HOLDERS
    assert "CUDA out of memory" in diagnosis.cause_detail
    assert any("printed: torch.OutOfMemoryError" in line for line in diagnosis.evidence)


def test_the_device_a_failure_names_is_the_gpu_the_unit_sees_as_that_number() -> None:
    """cuda:1 is the unit's second GPU; a number past its GPUs is said and ignored."""
    journal = Journal()
    run = journal.failed_run(9, T0 + 60, oom=True)
    run[1] = replace(run[1], device=1)
    seen = GpuEvidence(cuda_devices=("GPU 2, held by no process now", "GPU 3, held by PID 77"))
    diagnosis = fed(failures(2) + run).diagnose(T0 + 70, seen)
    assert diagnosis.cause is Cause.STALE_GPU_HOLDERS
    assert "; cuda:1 = GPU 3, held by PID 77 (no stale holder found now)" in diagnosis.cause_detail
    run[1] = replace(run[1], device=7, cursor="s=test;i=device7")
    far = fed(failures(2) + run).diagnose(T0 + 70, seen).cause_detail
    assert "cuda:7 names no GPU the unit sees (2 visible to it): ignored" in far
    assert fed(failures(2) + run).diagnose(T0 + 70, None).oom_device == 7  # for the gate
    assert fed(failures(3)).diagnose(T0 + 70, None).oom_device is None
    unknown = GpuEvidence(cuda_note="mixed GPU models and CUDA_DEVICE_ORDER is not PCI_BUS_ID")
    mixed = fed(failures(2) + run).diagnose(T0 + 70, unknown).cause_detail
    assert "cuda:7 cannot be placed: mixed GPU models" in mixed


def test_gpu_oom_output_alone_is_no_loop_and_no_cause() -> None:
    """OOM text from a run PID 1 never reported as failed triggers nothing (it is free text)."""
    journal = Journal()
    events = [
        journal.event(EventKind.STARTED, T0, inv(1)),
        journal.event(EventKind.GPU_OOM_OUTPUT, T0 + 1, inv(1)),
    ]
    diagnosis = fed(events).diagnose(T0 + 2, IDLE)
    assert not diagnosis.looping
    assert diagnosis.cause is Cause.UNKNOWN


def test_stale_holders_are_the_cause() -> None:
    """Holders from earlier invocations named by the inventory are the cause, listed briefly."""
    holders = tuple(f"PID {pid} (sglang::scheduler_TP0) holds GPU 0" for pid in range(5))
    diagnosis = fed(failures(3)).diagnose(T0 + 60, GpuEvidence(holders, gpus_busy=True))
    assert diagnosis.cause is Cause.STALE_GPU_HOLDERS
    assert diagnosis.cause_detail.startswith("PID 0 (sglang::scheduler_TP0) holds GPU 0; PID 1")
    assert diagnosis.cause_detail.endswith("; and 2 more")


def test_a_gpu_needing_a_reset_is_the_cause_before_stale_holders() -> None:
    """Stale holders and a GPU that needs a reset: the reset wins, since no kill can help."""
    evidence = GpuEvidence(
        ("PID 7 (sglang::scheduler_TP0) holds GPU 1",),
        gpus_busy=True,
        needs_reset=("GPU 1: GPU is lost (fallen off the bus)",),
    )
    diagnosis = fed(failures(3)).diagnose(T0 + 60, evidence)
    assert diagnosis.looping
    assert diagnosis.cause is Cause.GPU_NEEDS_RESET
    assert diagnosis.cause_detail == "GPU 1: GPU is lost (fallen off the bus)"


# --- recovery ----------------------------------------------------------------------------------


def test_a_stable_run_after_failures_ends_the_loop() -> None:
    """After three failures, a run that stays up for stable_s means the unit is not looping."""
    journal = Journal()
    events = [*failures(3), journal.event(EventKind.STARTED, T0 + 100, inv(10))]
    detector = fed(events)
    assert not detector.diagnose(T0 + 110, IDLE).looping  # still loading: no verdict yet
    diagnosis = detector.diagnose(T0 + 100 + LoopSettings().stable_s, IDLE)
    assert not diagnosis.looping
    assert diagnosis.reason == f"run {inv(10)[:8]}… is up for 300 s without failing"


def test_a_clean_stop_after_failures_ends_the_loop() -> None:
    """A run that ended cleanly after failures ends the loop."""
    journal = Journal()
    events = [*failures(3), *journal.clean_run(10, T0 + 100, T0 + 150)]
    diagnosis = fed(events).diagnose(T0 + 160, IDLE)
    assert not diagnosis.looping
    assert "ended cleanly" in diagnosis.reason


def test_reset_forgets_the_handled_loop() -> None:
    """After reset, old failures (even re-delivered) no longer count; one new failure is no loop."""
    events = failures(3)
    detector = fed(events)
    assert detector.diagnose(T0 + 60, IDLE).looping
    detector.reset(T0 + 60)
    assert not any(detector.observe(event, live=True) for event in events)
    assert detector.events == ()
    for event in Journal().failed_run(20, T0 + 100):
        detector.observe(event, live=True)
    diagnosis = detector.diagnose(T0 + 110, IDLE)
    assert not diagnosis.looping
    assert diagnosis.failures_in_window == 1


def test_settings_refuse_nonsense() -> None:
    """Settings under which every or no unit would loop are refused with the field's name."""
    with pytest.raises(ValueError, match="min_starts"):
        LoopSettings(min_starts=0)
    with pytest.raises(ValueError, match="window_s"):
        LoopSettings(window_s=0)
    with pytest.raises(ValueError, match="restart_counter_threshold"):
        LoopSettings(restart_counter_threshold=0)
    with pytest.raises(ValueError, match="stable_s"):
        LoopSettings(stable_s=-1)


def test_evidence_times_follow_the_given_time_zone() -> None:
    """Evidence lines show the time in the detector's zone (UTC unless told)."""
    plus_two = timezone(timedelta(hours=2))
    detector = Detector(UNIT, tz=plus_two)
    for event in failures(1):
        detector.observe(event, live=True)
    (line,) = detector.diagnose(T0 + 10, IDLE).evidence
    assert line == f"18:33:22 run {inv(0)[:8]}… failed: exit-code (status 1)"


# --- the recorded samples ----------------------------------------------------------------------


def last_time(events: list[UnitEvent]) -> float:
    """The time of the newest event."""
    return max(event.monotonic_s for event in events)


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("name", ["restart-loop-start-limit", "restart-loop-start-limit-gated"])
def test_recorded_restart_loop_is_a_loop_with_a_gpu_cause(release: str, name: str) -> None:
    """The recorded loop up to the start limit is a loop, and its OOM output names the cause.

    Memory on the unit's GPUs while it loops: held by others (stale holders). The same loop on
    GPUs nothing holds is one that does not fit (test_a_loop_out_of_memory_on_idle_gpus_…).
    """
    events = sample_events(release, name)
    diagnosis = fed(events).diagnose(last_time(events) + 1, GpuEvidence(gpus_busy=True))
    assert diagnosis.looping
    assert not diagnosis.immediate
    assert (diagnosis.starts_in_window, diagnosis.failures_in_window) == (5, 5)
    assert diagnosis.n_restarts == 5
    assert diagnosis.cause is Cause.STALE_GPU_HOLDERS
    assert "CUDA error: out of memory" in diagnosis.cause_detail
    first_failure = min(e.monotonic_s for e in events if e.kind is EventKind.MAIN_EXITED)
    assert diagnosis.first_failure_s == first_failure
    assert sum("failed: exit-code (status 1)" in line for line in diagnosis.evidence) == 5
    assert any("start limit hit" in line for line in diagnosis.evidence)


@pytest.mark.parametrize("release", RELEASES)
def test_recorded_loop_replayed_as_history_asks_for_nothing(release: str) -> None:
    """The recorded loop replayed on start never asks for action, but is known afterwards."""
    events = sample_events(release, "restart-loop-start-limit")
    detector = Detector(UNIT)
    assert not any(detector.observe(event, live=False) for event in events)
    assert detector.diagnose(last_time(events) + 1, None).looping


@pytest.mark.parametrize("release", RELEASES)
def test_recorded_loop_is_judged_only_when_a_run_has_failed(release: str) -> None:
    """Fed live, the recorded loop becomes a loop at the third failure, not while starting."""
    detector = Detector(UNIT)
    verdicts = [
        (event.kind, detector.diagnose(event.monotonic_s, None).looping)
        for event in sample_events(release, "restart-loop-start-limit")
        if detector.observe(event, live=True)
    ]
    first_loop = next(i for i, (_, looping) in enumerate(verdicts) if looping)
    failed_before = [kind for kind, _ in verdicts[:first_loop]].count(EventKind.MAIN_EXITED)
    assert failed_before == 2
    assert verdicts[first_loop][0] is EventKind.MAIN_EXITED
    assert all(not looping for kind, looping in verdicts if kind is EventKind.STARTED)


@pytest.mark.parametrize("release", RELEASES)
def test_recorded_operator_restart_with_a_left_over_is_a_finding_not_a_loop(release: str) -> None:
    """The operator's recorded restart that found a left-over worker is never called a loop."""
    events = sample_events(release, "left-over-process")
    detector = Detector(UNIT)
    found: list[str] = []
    for event in events:
        detector.observe(event, live=True)
        diagnosis = detector.diagnose(event.monotonic_s, None)
        assert not diagnosis.looping, diagnosis.reason
        found += diagnosis.findings
    assert any("left-over process" in line and "(sglang-worker)" in line for line in found)
    final = detector.diagnose(last_time(events) + 1, None)
    assert not final.looping
    assert "ended cleanly" in final.reason


@pytest.mark.parametrize("release", RELEASES)
def test_recorded_stop_timeout_then_failed_start_is_immediate(release: str) -> None:
    """The recorded stop (a stop job) timed out: stopped, no loop; a failed start after it is.

    The stop job was asked for, so its timeout is no failure of the series; once someone starts
    the unit again and that start fails, the timeout explains it: an immediate loop.
    """
    events = sample_events(release, "stop-sigterm-timeout")
    end = last_time(events)
    detector = fed(events)
    alone = detector.diagnose(end + 1, None)
    assert not alone.looping
    assert "stopped by a stop job" in alone.reason
    assert alone.failures_in_window == 0
    assert any("stop-sigterm timed out" in line for line in alone.evidence)
    assert any("failed: timeout (killed by SIGKILL)" in line for line in alone.evidence)
    for event in Journal().failed_run(99, end + 5):
        detector.observe(replace(event, boot_id=events[0].boot_id), live=True)
    after = detector.diagnose(end + 10, None)
    assert after.looping
    assert after.immediate


def test_diagnosis_is_a_plain_frozen_value() -> None:
    """A diagnosis compares by value and cannot be changed."""
    first = fed(failures(3)).diagnose(T0 + 60, IDLE)
    second = fed(failures(3)).diagnose(T0 + 60, IDLE)
    assert first == second
    assert isinstance(first, Diagnosis)
    with pytest.raises(AttributeError):
        first.looping = False  # type: ignore[misc]


def test_left_over_on_a_failed_run_of_a_loop_is_still_immediate() -> None:
    """A loop whose newest run also found a left-over process is reported as immediate."""
    journal = Journal()
    left_over = journal.event(
        EventKind.LEFT_OVER_PROCESS, T0 + 59, inv(2), pid=65, comm="sglang-worker"
    )
    diagnosis = fed([*failures(3), left_over]).diagnose(T0 + 60, None)
    assert diagnosis.looping
    assert diagnosis.immediate
    assert diagnosis.reason.startswith("3 failed runs in a row")


# --- the operator's intent ----------------------------------------------------------------------


def timed_out_stop(journal: Journal, run: str, at: float, job_type: str) -> list[UnitEvent]:
    """A stop of ``run`` by a ``job_type`` job whose SIGTERM timed out (what systemd logs)."""
    return [
        journal.event(EventKind.STOPPING, at, run, job_type=job_type),
        journal.event(EventKind.STOP_TIMED_OUT, at + 90, run),
        journal.event(
            EventKind.MAIN_EXITED, at + 90.01, run, exit_code="killed", exit_status=9, signal="KILL"
        ),
        journal.event(EventKind.FAILED, at + 90.02, run, result="timeout"),
        journal.event(EventKind.STOPPED, at + 90.03, run, job_type=job_type),
    ]


def test_an_operators_stop_after_a_timed_out_restart_is_no_loop() -> None:
    """Restart, then the operator's `systemctl stop`, both timing out: stopped, not a loop.

    On main this was an immediate loop ("a stop timed out … and the next start failed"), and
    with stale holders a recovery that ended by starting the unit the operator had stopped.
    """
    journal = Journal()
    events = [
        journal.event(EventKind.STARTED, T0, inv(1)),
        *timed_out_stop(journal, inv(1), T0 + 10, "restart"),
        journal.event(EventKind.STARTED, T0 + 101, inv(2)),
        *timed_out_stop(journal, inv(2), T0 + 150, "stop"),
    ]
    stale = GpuEvidence(stale_holders=("PID 77 (python3) holds GPU 0: from an earlier run",))
    diagnosis = fed(events).diagnose(T0 + 241, stale)
    assert not diagnosis.looping
    assert not diagnosis.immediate
    assert "stopped by a stop job" in diagnosis.reason
    assert any("stopped by a stop job" in line for line in diagnosis.evidence)


def test_a_stop_job_ends_a_restart_loop() -> None:
    """A loop that an operator stops (between two restarts) is over: the stop ends the series."""
    journal = Journal()
    loop = failures(3)
    assert fed(loop).diagnose(T0 + 60, None).looping
    stop = journal.event(EventKind.STOPPED, T0 + 50, inv(2), job_type="stop")
    after = fed([*loop, stop]).diagnose(T0 + 60, None)
    assert not after.looping
    restart = journal.event(EventKind.STOPPED, T0 + 50, inv(2), job_type="restart")
    assert fed([*loop, restart]).diagnose(T0 + 60, None).looping


# --- time from the journal, not the wall --------------------------------------------------------


def with_wall(events: list[UnitEvent], wall: Callable[[float], float | None]) -> list[UnitEvent]:
    """The same events with their wall stamps rewritten (the monotonic stamps are untouched)."""
    return [replace(event, realtime_s=wall(event.monotonic_s)) for event in events]


def test_a_wall_clock_step_back_is_not_aging() -> None:
    """An NTP step back of more than the window between two failures does not hide the loop."""
    stepped = with_wall(failures(3), lambda at: at - (0 if at < T0 + 30 else 2 * W))
    diagnosis = fed(stepped).diagnose(T0 + 60, None)
    assert diagnosis.looping
    assert diagnosis.starts_in_window == 3


def test_one_entry_stamped_in_the_future_ages_nothing() -> None:
    """A single entry with a wall stamp a year ahead leaves later events in the window."""
    events = failures(3)
    future = with_wall(events[:1], lambda at: at + 365 * 86400) + events[1:]
    diagnosis = fed(future).diagnose(T0 + 60, None)
    assert diagnosis.looping
    assert diagnosis.starts_in_window == 3


def test_wall_stamps_past_year_9999_or_missing_only_hide_the_clock() -> None:
    """Without a showable wall stamp the verdict is the same; evidence times read "?"."""
    events = with_wall(failures(3), lambda _at: None)
    diagnosis = fed(events).diagnose(T0 + 60, None)
    assert diagnosis.looping
    assert all(line.startswith("? ") for line in diagnosis.evidence)
    huge = with_wall(failures(3), lambda _at: 253_402_300_799.0)
    far = fed([*huge[:-1], replace(huge[-1], realtime_s=253_402_300_799.0 + 10**6)])
    assert far.diagnose(T0 + 60, None).looping


def test_another_boot_starts_a_new_timeline() -> None:
    """Monotonic stamps of two boots are not compared: the new boot's events replace the old."""
    old = failures(3)
    new_boot = [replace(event, boot_id="c" * 32) for event in Journal().failed_run(7, 5.0)]
    detector = fed([*old, *new_boot])
    assert {event.boot_id for event in detector.events} == {"c" * 32}
    assert detector.diagnose(10.0, None).starts_in_window == 1


# --- bounded memory for hostile output ----------------------------------------------------------


def test_out_of_memory_lines_are_kept_a_few_per_run() -> None:
    """200,000 OOM lines of one run (~150 MiB and 0.4 s per verdict on main) keep only a few."""
    journal = Journal()
    loop = failures(3)
    flood = [
        journal.event(EventKind.GPU_OOM_OUTPUT, T0 + 41 + n * 1e-6, inv(2)) for n in range(200_000)
    ]
    detector = Detector(UNIT)
    for event in [*loop, *flood]:
        detector.observe(event, live=True)
    oom = [event for event in detector.events if event.kind is EventKind.GPU_OOM_OUTPUT]
    assert len(oom) <= 3
    started = time.perf_counter()
    diagnosis = detector.diagnose(T0 + 60, None)
    assert time.perf_counter() - started < 0.05
    assert diagnosis.cause is Cause.STALE_GPU_HOLDERS


def recorded(name: str) -> list[str]:
    """The releases that have a recorded sample ``name`` (new ones may exist for one only)."""
    return [release for release in RELEASES if (SAMPLES / release / f"{name}.jsonl").is_file()]


@pytest.mark.parametrize("release", RELEASES)
def test_recorded_start_limit_hit_says_systemd_ended_the_loop(release: str) -> None:
    """At the recorded start limit the loop is one systemd ended, and the reason says what to do."""
    events = sample_events(release, "restart-loop-start-limit")
    diagnosis = fed(events).diagnose(last_time(events) + 1, None)
    assert diagnosis.looping
    assert diagnosis.start_limit_hit
    assert "start limit ended the loop" in diagnosis.reason
    assert f"systemctl reset-failed {UNIT}" in diagnosis.reason


@pytest.mark.parametrize("release", recorded("restart-counter-clean-exit"))
def test_recorded_clean_exits_restarted_by_systemd_are_a_loop(release: str) -> None:
    """Runs that exit 0 at once and that systemd restarts (only the counter tells) are a loop."""
    events = sample_events(release, "restart-counter-clean-exit")
    detector = Detector(UNIT)
    looping_at: list[int | None] = []
    for event in events:
        detector.observe(event, live=True)
        diagnosis = detector.diagnose(event.monotonic_s, None)
        if diagnosis.looping:
            looping_at.append(diagnosis.n_restarts)
            assert "exited cleanly and systemd restarted it" in "\n".join(diagnosis.evidence)
    assert looping_at, "never a loop"
    assert max(n or 0 for n in looping_at) == 6
    final = detector.diagnose(last_time(events) + 1, None)
    assert not final.looping  # the operator's stop ended the last run cleanly
    assert "ended cleanly" in final.reason


@pytest.mark.parametrize("release", recorded("operator-restart"))
def test_recorded_operator_restarts_and_stop_start_are_never_a_loop(release: str) -> None:
    """An operator's `systemctl restart` (twice) and `stop` + `start`: never a loop."""
    events = sample_events(release, "operator-restart")
    detector = Detector(UNIT)
    for event in events:
        detector.observe(event, live=True)
        assert not detector.diagnose(event.monotonic_s, None).looping


@pytest.mark.parametrize("release", recorded("left-over-at-start"))
def test_recorded_left_over_at_an_operators_start_is_a_finding(release: str) -> None:
    """A left-over found at a start with no failure and no restart: a finding, never a loop."""
    events = sample_events(release, "left-over-at-start")
    detector = Detector(UNIT)
    found: list[str] = []
    for event in events:
        detector.observe(event, live=True)
        diagnosis = detector.diagnose(event.monotonic_s, None)
        assert not diagnosis.looping, diagnosis.reason
        found += diagnosis.findings
    assert found
    assert all("a finding, not a loop" in line for line in found)


@pytest.mark.parametrize("release", RELEASES)
def test_a_loop_out_of_memory_on_idle_gpus_does_not_fit_and_names_no_reap(release: str) -> None:
    """Five OOM failures while nothing holds the unit's GPUs: the server does not fit as set up.

    No reap or restart helps, so the cause is not stale holders (the daemon only reports it).
    """
    events = sample_events(release, "restart-loop-start-limit")
    diagnosis = fed(events).diagnose(last_time(events) + 1, IDLE)
    assert diagnosis.looping
    assert diagnosis.cause is Cause.DOES_NOT_FIT
    assert "no process holds the unit's GPUs: the server does not fit" in diagnosis.cause_detail


def test_unreadable_gpus_are_said_so_not_called_busy() -> None:
    """With NVML missing the cause says the GPUs cannot be read, never that they are busy."""
    missing = GpuEvidence(gpus_busy=True, unreadable="NVML unavailable: Driver Not Loaded")
    diagnosis = fed(failures(3)).diagnose(T0 + 60, missing)
    assert diagnosis.cause is Cause.UNKNOWN
    assert "cannot be read (NVML unavailable: Driver Not Loaded)" in diagnosis.cause_detail
    assert "busy" not in diagnosis.cause_detail
