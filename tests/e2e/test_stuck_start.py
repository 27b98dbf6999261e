"""Issue 25 on real systemd: a start stuck behind a stale holder, recovered only past its budget.

sglang.service is made `Type=notify` (the fake SGLang sends READY=1 with its ready line) with
no start timeout, and `on_start_stuck = "recover"`. The daemon first learns four starts that came
up (2 s of weight load each: a budget of 62 s for the phase). Then a worker of the serving run
that ignores SIGTERM is moved out of the unit's cgroup, and the operator's stop leaves it holding
GPU 3; the next start hangs in its weight load (the fake waits for a rank that cannot allocate,
printing nothing). The daemon must call it stuck no sooner than the learned budget, then stop the
unit, reap that worker and start it again to a healthy run, with no failed start. The same hang
stopped by the operator before its budget is left stopped, and its blocker left alone.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import pytest

from e2e.container import Container
from e2e.gpubox import CONFIG, UNIT, GpuBox, install
from e2e.scenario import SERVING_MIB, STUBBORN_TP3, alive, failed_starts, pid1_messages

if TYPE_CHECKING:
    from pathlib import Path

    from e2e.gpubox import Artifacts

pytestmark = pytest.mark.slow

NOTIFY = (
    "[Service]\n"
    "Type=notify\n"
    "NotifyAccess=main\n"
    "TimeoutStartSec=infinity\n"
    "Environment=FAKE_SGLANG_HANG_WHEN_BUSY=1\n"
)
LEARNED = 4
"""Starts that came up before the hang (core.startbudgets needs 3)."""
LOAD_BEGIN = "Load weight begin"
STARTING = "7d4958e842da4a758f6c1cdc7b36dcc5"
LATE_S = 5.0
"""How late past its budget the daemon may see the stuck start: it wakes for the budget itself
(without that, its next wake - the watchdog's 15 s ping - could come up to 15 s late)."""
WATCH_S = 15.0
"""How long past the budget a stopped hang is watched for a recovery that must not come."""


def load_began(gpubox: GpuBox, since_s: float) -> tuple[float, str]:
    """When the newest run since ``since_s`` logged its weight load's start, and that run."""
    found: list[tuple[float, str]] = []

    def logged() -> bool:
        for entry in gpubox.box.journal([f"_SYSTEMD_UNIT={UNIT}", f"--since=@{int(since_s)}"]):
            if LOAD_BEGIN in str(entry.get("MESSAGE")):
                stamp = int(str(entry["__REALTIME_TIMESTAMP"])) / 1e6
                found.append((stamp, str(entry.get("_SYSTEMD_INVOCATION_ID"))))
        return bool(found)

    gpubox.box.wait_for("the weight load's first line", logged, timeout=30)
    return found[-1]


def liveness(gpubox: GpuBox) -> dict[str, Any]:
    """The daemon's liveness of the unit, as `status --json` carries it."""
    view: dict[str, Any] = gpubox.status_json()["daemon"]["snapshot"]["units"][UNIT]["liveness"]
    return view


def stale_holder(gpubox: GpuBox) -> int:
    """TP3 of the serving run, moved out of the cgroup, left holding GPU 3 by an operator's stop."""
    [tp3] = gpubox.pids("sglang::scheduler_TP3")
    gpubox.escape_to_scope(tp3, scope=f"operator-shell-{tp3}")
    gpubox.systemctl("stop", UNIT)  # the drain outlasts TimeoutStopSec=3: SIGKILL, TP3 missed
    assert alive(gpubox, tp3)
    return tp3


def hang(gpubox: GpuBox) -> tuple[float, str, float]:
    """Start the unit behind the stale holder: its load's first line, its run, its budget."""
    began = time.time()
    gpubox.systemctl("--no-block", "start", UNIT)
    load_at, run = load_began(gpubox, began)
    budgets: list[float] = []

    def learned() -> bool:
        view = liveness(gpubox)
        if view.get("phase") == "loading-weights" and view.get("budget_s") is not None:
            budgets.append(float(view["budget_s"]))
        return bool(budgets)

    gpubox.box.wait_for("the daemon timing the load against its budget", learned, timeout=90)
    return load_at, run, budgets[0]


def test_a_stuck_start_is_recovered_past_its_budget_and_never_after_an_operators_stop(
    rootfs: Path, e2e_artifacts: Artifacts
) -> None:
    """Stuck no sooner than the budget, recovered to a healthy run; an operator's stop stands."""
    config = CONFIG + 'on_start_stuck = "recover"\n'
    with Container(rootfs, binds=e2e_artifacts.binds()) as booted:
        gpubox = GpuBox(booted, install_s=install(booted, config=config))
        try:
            gpubox.start_daemon()
            gpubox.drop_in(UNIT, "e2e-notify.conf", NOTIFY)
            gpubox.drop_in(UNIT, "e2e-fault.conf", STUBBORN_TP3)
            learning = time.time()
            gpubox.start_server()
            for _ in range(LEARNED - 1):
                gpubox.systemctl("restart", UNIT)  # Type=notify: returns once READY=1 came
            assert len(pid1_messages(gpubox, learning - 1, STARTING)) == LEARNED

            # 1. Stuck behind the stale holder: recovered only past the learned budget.
            tp3 = stale_holder(gpubox)
            load_at, stuck_run, budget_s = hang(gpubox)
            assert budget_s >= 60.0, budget_s
            assert gpubox.show(UNIT, "ActiveState") == "activating"
            stuck_at, stuck = next(iter(_waited(gpubox, load_at, "start stuck", budget_s)))
            healthy = gpubox.wait_fired_up(after_s=stuck_at, timeout=120)
            served_s = time.time() - stuck_at
            gpubox.box.wait_for(
                f"{UNIT} active", lambda: gpubox.show(UNIT, "ActiveState") == "active", timeout=30
            )
            [(_, finished)] = gpubox.daemon_said(stuck_at - 1, "recovery finished")
            [(_, decided)] = gpubox.daemon_said(stuck_at - 1, "start stuck: decision")
            after_s = stuck_at - load_at
            print(  # noqa: T201 - the scenario's figures, for docs/e2e.md
                f"\nstuck start seen {after_s:.1f} s into its load (budget {budget_s:.0f} s); "
                f"serving again {served_s:.1f} s later"
            )
            assert budget_s <= after_s <= budget_s + LATE_S, (after_s, budget_s)
            assert stuck["action"] == "recover"
            assert decided["action"] == "recover", decided
            assert finished["result"] == "restarted", finished
            assert healthy != stuck_run
            assert not alive(gpubox, tp3)  # the stale holder was reaped
            failed = failed_starts(gpubox, load_at - 1)
            assert failed == [], failed
            assert gpubox.allocated() == [SERVING_MIB] * 4

            # 2. The same hang, stopped by the operator before its budget: left stopped.
            tp3 = stale_holder(gpubox)
            load_at, stuck_run, budget_s = hang(gpubox)
            time.sleep(max(0.0, load_at + budget_s / 2 - time.time()))  # half its budget in
            assert gpubox.show(UNIT, "ActiveState") == "activating"
            stopped = time.time()
            gpubox.systemctl("stop", UNIT)
            time.sleep(max(0.0, load_at + budget_s + WATCH_S - time.time()))  # past its budget
            assert gpubox.show(UNIT, "ActiveState") == "inactive"
            assert pid1_messages(gpubox, stopped, STARTING) == []
            assert gpubox.daemon_said(stopped, "recovery finished") == []
            assert [line for _, line in gpubox.daemon_said(stopped, "start stuck")] == []
            assert alive(gpubox, tp3)  # the operator's to clean up (`gpuguard reap`)
        finally:
            gpubox.kill_server()


def _waited(
    gpubox: GpuBox, since_s: float, event: str, budget_s: float
) -> list[tuple[float, dict[str, Any]]]:
    """The daemon's ``event`` lines since ``since_s``, waited for up to the budget and a minute."""
    found: list[tuple[float, dict[str, Any]]] = []

    def logged() -> bool:
        found[:] = gpubox.daemon_said(since_s - 1, event)
        return bool(found)

    gpubox.box.wait_for(f"the daemon's {event!r}", logged, timeout=budget_s + 60)
    return found
