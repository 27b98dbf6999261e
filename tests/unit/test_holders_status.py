"""The pure core: merging NVML and /proc evidence, judging it, and rendering it."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

import pytest
import snapshots
from builders import STATUS_CONTEXT, gpu, lost_gpu, nvml, process

from gpuguard.core.inventory import build_inventory, gpu_minor_of
from gpuguard.core.levels import Level
from gpuguard.core.status.document import to_json
from gpuguard.core.status.judge import assess
from gpuguard.core.status.report import StatusContext, UnitView
from gpuguard.core.status.text import render_text
from gpuguard.core.unitcontainers import ContainerVerdict, Engine
from gpuguard.core.values import MIB, NvmlHealth, ProcScan

if TYPE_CHECKING:
    from gpuguard.core.snapshot import Snapshot, XidRecord
    from gpuguard.core.values import NvmlReading, ProcessFacts

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


def with_control_node(facts: ProcessFacts) -> ProcessFacts:
    """The process holds /dev/nvidiactl too, which names no GPU."""
    return replace(facts, device_files=facts.device_files | {"/dev/nvidiactl"})


def judge(reading: NvmlReading, *procs: ProcessFacts) -> tuple[Level, str, dict[str, object]]:
    """Build, assess and render; return the level, the text and the JSON."""
    inventory = build_inventory(reading, ProcScan(procs), 16 * MIB)
    report = assess(inventory, STATUS_CONTEXT, NOW)
    return report.level, render_text(report), to_json(report)


def test_minor_is_read_from_the_node_name() -> None:
    """/dev/nvidiaN names minor N; control nodes name no GPU."""
    assert gpu_minor_of("/dev/nvidia3") == 3
    assert gpu_minor_of("/tmp/x/dev/nvidia12") == 12
    assert gpu_minor_of("/dev/nvidiactl") is None
    assert gpu_minor_of("/dev/nvidia-uvm") is None


def test_idle_host_is_ok() -> None:
    """Four idle GPUs with no holders are OK and say so."""
    level, text, doc = judge(nvml(gpu(0, used_mib=2), gpu(1), gpu(2), gpu(3)))
    assert level is Level.OK
    assert text.startswith("gpuguard status: OK - all 4 GPUs idle\n")
    assert doc["schema_version"] == 3
    assert all(g["idle"] for g in doc["gpus"])  # type: ignore[attr-defined]


def test_holder_attributed_by_nvml_and_device_file() -> None:
    """A server listed by NVML and holding the device is shown under its GPU with unit and MiB."""
    level, text, doc = judge(
        nvml(gpu(0, (10, 1000)), gpu(1)),
        with_control_node(process(10, 0)),
    )
    assert level is Level.OK
    assert "pid 10" in text
    assert "sglang.service" in text
    assert "1000 MiB" in text
    holder = doc["holders"][0]  # type: ignore[index]
    assert holder["unit"] == "sglang.service"
    assert holder["gpus"] == [
        {"index": 0, "used_mib": 1000, "listed_by_nvml": True, "holds_device_file": True}
    ]


def test_device_node_maps_to_gpu_by_minor_not_index() -> None:
    """/dev/nvidia7 belongs to the GPU whose NVML minor is 7, whatever its index."""
    inventory = build_inventory(
        nvml(gpu(0, minor=7), gpu(1, minor=0)),
        ProcScan((process(10, 7),)),
        16 * MIB,
    )
    assert [u.gpu_index for u in inventory.holders[0].gpus] == [0]


def test_inherited_fd_child_shows_as_fd_only() -> None:
    """A child that only inherited the device file is a holder without a size."""
    level, text, _ = judge(
        nvml(gpu(0, (10, 1000))),
        process(10, 0),
        process(11, 0, comm="python3"),
    )
    assert level is Level.OK
    assert "pid 11" in text
    assert "fd only" in text


def test_unattributed_memory_is_critical_and_never_guessed() -> None:
    """Memory beyond the listed processes and the idle allowance is unattributed: CRITICAL."""
    level, text, doc = judge(nvml(gpu(0, (10, 1000), used_mib=3000)), process(10, 0))
    assert level is Level.CRITICAL
    assert "Unattributed: GPU 0: 2000 MiB" in text
    assert doc["gpus"][0]["unattributed_mib"] == 2000  # type: ignore[index]
    assert doc["holders"][0]["gpus"][0]["used_mib"] == 1000  # type: ignore[index]


def test_small_difference_is_within_the_idle_allowance() -> None:
    """A few MiB of driver bookkeeping beyond the processes is not reported."""
    level, _, doc = judge(nvml(gpu(0, (10, 1000), used_mib=1010)), process(10, 0))
    assert level is Level.OK
    assert doc["gpus"][0]["unattributed_mib"] == 0  # type: ignore[index]


def test_pid_named_by_nvml_but_missing_in_proc_is_reported() -> None:
    """A listed PID that /proc lacks is reported as vanished, not dropped."""
    level, text, doc = judge(nvml(gpu(0, (999, 500))))
    assert level is Level.CRITICAL
    assert "PID 999" in text
    assert doc["vanished"] == [{"pid": 999, "gpu": 0, "used_mib": 500}]


def test_lost_gpu_is_critical_and_others_still_reported() -> None:
    """One lost GPU makes the status CRITICAL while the other GPUs are still shown."""
    level, text, _ = judge(nvml(gpu(0), lost_gpu(1), gpu(2)))
    assert level is Level.CRITICAL
    assert "GPU 1" in text
    assert "LOST" in text
    assert "GPU 2  NVIDIA H200" in text


def test_d_state_holder_is_critical() -> None:
    """A holder stuck in the driver (its kernel stack says so) cannot be killed: CRITICAL."""
    stuck = process(10, 0, state="D", kernel_wait=("os_acquire_mutex+0x2a/0x50 [nvidia]",))
    level, text, _ = judge(nvml(gpu(0, (10, 100))), stuck)
    assert level is Level.CRITICAL
    assert "state D" in text


def test_escaped_worker_of_watched_unit_is_a_warning() -> None:
    """A holder that looks like the watched unit's worker but runs outside it is a warning."""
    level, text, _ = judge(
        nvml(gpu(0, (10, 100))),
        process(
            10,
            0,
            cgroup="/user.slice/user-0.slice/session-1.scope",
            cmdline=("sglang::scheduler_TP0",),
        ),
    )
    assert level is Level.WARNING
    assert "left-over of sglang.service" in text


def test_protected_process_is_never_called_a_left_over() -> None:
    """Protected processes holding devices do not raise warnings by pattern."""
    level, _, _ = judge(
        nvml(gpu(0)),
        with_control_node(
            process(
                5,
                0,
                cgroup="/system.slice/nvidia-persistenced.service",
                comm="nvidia-persistenced",
                cmdline=("/usr/bin/nvidia-persistenced", "--sglang"),
            )
        ),
    )
    assert level is Level.OK


def test_nvml_unavailable_without_evidence_is_unknown() -> None:
    """No NVML and nothing in /proc: UNKNOWN (3), with the reason on screen."""
    unavailable = nvml(health=NvmlHealth.UNAVAILABLE, reason="NVML unavailable: Driver Not Loaded")
    level, text, doc = judge(unavailable)
    assert level is Level.UNKNOWN
    assert "NVML unavailable: Driver Not Loaded" in text.splitlines()[0]
    assert doc["exit_code"] == 3


def test_nvml_unavailable_with_proc_evidence_is_a_warning() -> None:
    """No NVML but /proc shows device holders: WARNING, and the holders are listed."""
    unavailable = nvml(health=NvmlHealth.UNAVAILABLE, reason="NVML unavailable: Driver Not Loaded")
    level, text, _ = judge(unavailable, process(10, 0))
    assert level is Level.WARNING
    assert "pid 10" in text


def test_hostile_command_cannot_forge_output_lines() -> None:
    """A command line with newlines renders on one line."""
    evil = ("python3", "x\ngpuguard status: OK - all 4 GPUs idle")
    _, text, doc = judge(nvml(gpu(0, (10, 100))), process(10, 0, cmdline=evil))
    assert sum(line.startswith("gpuguard status:") for line in text.splitlines()) == 1
    assert json.loads(json.dumps(doc))["holders"][0]["cmdline"] == list(evil)


def test_hostile_comm_cannot_forge_output_lines() -> None:
    """A process name with a newline is escaped in findings too."""
    _, text, _ = judge(
        nvml(gpu(0, (10, 100))),
        process(10, 0, state="D", comm="x\nOK: fine"),
    )
    assert not any(line.startswith("OK: fine") for line in text.splitlines())


def test_refused_gate_is_critical() -> None:
    """A unit whose last start the gate refused is reported CRITICAL with the blocker."""
    refused = UnitView(
        "sglang.service",
        "failed (failed)",
        "GPUs 0,1 (from config)",
        (
            {"time": "t1", "result": "passed", "blockers": []},
            {"time": "t2", "result": "refused", "blockers": ["GPU 1: 500 MiB used, held by X"]},
        ),
    )
    context = StatusContext(
        watched_units={},
        protected_names=(),
        idle_threshold_bytes=16 * MIB,
        as_root=True,
        units=(refused,),
    )
    report = assess(build_inventory(nvml(gpu(0)), ProcScan(()), 16 * MIB), context, NOW)
    assert report.level is Level.CRITICAL
    assert "refused the last start of sglang.service at t2" in report.headline
    # What the gate named then is the unit's gate line; the headline says only what is now.
    assert "GPU 1: 500 MiB used" not in report.headline
    assert "gate t2 refused after ? s, reaped 0, spared 0: GPU 1: 500 MiB used" in render_text(
        report
    )


@pytest.mark.parametrize(
    ("no_config_file", "fix"),
    [
        (False, "check the name in the configuration"),
        (
            True,
            (
                "the default with no configuration file: name yours in "
                "/etc/gpuguard/gpuguard.toml (or --config FILE)"
            ),
        ),
    ],
)
def test_a_unit_systemd_lacks_is_blamed_on_the_file_only_when_there_is_one(
    no_config_file: bool, fix: str
) -> None:
    """Without a configuration file (a source install) the unknown unit is the default one."""
    missing = UnitView("sglang.service", "not found", "all GPUs", not_found=True)
    context = StatusContext(
        watched_units={"sglang.service": ()},
        protected_names=(),
        idle_threshold_bytes=16 * MIB,
        as_root=False,
        units=(missing,),
        no_config_file=no_config_file,
    )
    report = assess(build_inventory(nvml(gpu(0)), ProcScan(()), 16 * MIB), context, NOW)
    assert report.level is Level.WARNING
    assert report.headline == (
        f"watched unit sglang.service does not exist (LoadState=not-found): {fix}"
    )


def test_a_blanked_command_line_cannot_forge_a_status_line() -> None:
    """The name shown in place of an empty command line is escaped, as are owners and findings."""
    level, text, doc = judge(
        nvml(gpu(0, (10, 1000)), gpu(1, (11, 500))),
        process(10, 0, comm="\nOK: all idle", cmdline=()),
        process(
            11,
            1,
            cgroup="/system.slice/gg-\x1b]0;pwn\x07\u202e.service",
            comm="\x1b[2Jsglang",
            cmdline=("python3", "-m", "sglang\r\x1b[KOK", "a\u2028b"),
        ),
    )
    lines = text.splitlines()
    assert not [line for line in lines if line.startswith("OK")]
    assert all(line.isprintable() for line in lines)
    assert "[\\nOK: all idle]" in text
    assert "gg-\\x1b]0;pwn\\x07\\u202e.service" in text
    assert "sglang\\r\\x1b[KOK" in text
    assert "a\\u2028b" in text
    assert level.name == "WARNING"  # the look-alike outside its unit, named escaped
    assert "(\\x1b[2Jsglang)" in text
    assert json.loads(json.dumps(doc))["holders"][0]["comm"] == "\nOK: all idle"


def _with_daemon(snapshot: Snapshot) -> tuple[Level, str, dict[str, object]]:
    """Judge four idle GPUs with a running daemon whose snapshot is ``snapshot``."""
    inventory = build_inventory(nvml(gpu(0), gpu(1), gpu(2), gpu(3)), ProcScan(()), 16 * MIB)
    context = replace(STATUS_CONTEXT, daemon=snapshots.running(snapshot))
    report = assess(inventory, context, NOW)
    return report.level, render_text(report), to_json(report)


def test_kernel_xids_are_shown_under_their_gpu_and_serious_ones_warned() -> None:
    """Xid 79 on GPU 1's address warns; Xid 13 is only shown; an unknown address is said."""

    def xid(code: int, pci: str) -> XidRecord:
        return snapshots.xid(
            code, pci, name="<unknown>", detail="text\x1b[2J", time="2026-12-01T03:00:00+00:00"
        )

    snapshot = snapshots.written(
        xids=(xid(13, "0000:19:00"), xid(79, "0000:1a:00"), xid(48, "0000:99:00")),
        xids_malformed=2,
    )
    level, text, doc = _with_daemon(snapshot)
    assert level is Level.WARNING
    assert "GPU 1 had Xid 79 (reboot)" in text
    assert "kernel Xid for PCI 0000:99:00, which NVML does not know: Xid 48" in text
    assert "GPU 0 had" not in text
    assert "    Xid 13 (application) at 2026-12-01T03:00:00+00:00: text\\x1b[2J" in text
    assert "\x1b" not in text
    assert "2 kernel Xid line(s) could not be read" in text
    events = doc["xid_events"]
    assert isinstance(events, list)
    assert [e["gpu"] for e in events] == [0, 1, None]


def test_daemon_needs_operator_for_a_gpu_reset_says_so() -> None:
    """The daemon stopped at needs-operator for a GPU reset: CRITICAL, naming the GPU."""
    watch = snapshots.unit(
        needs_operator=True,
        looping=True,
        cause="gpu-needs-reset",
        cause_detail="GPU 1: a memory row remap is pending",
        verdict="3 failed starts",
    )
    level, text, _ = _with_daemon(snapshots.written({"sglang.service": watch}))
    assert level is Level.CRITICAL
    assert "a GPU of its set needs a reset" in text
    assert "GPU 1: a memory row remap is pending" in text


def test_since_limits_the_history_shown_not_the_current_state() -> None:
    """--since 1h: an older Xid, recovery and sweep are left out; GPU health is still judged."""

    def xid(code: int, when: str) -> XidRecord:
        return snapshots.xid(code, "0000:1a:00", time=when)

    watch = snapshots.unit(
        verdict="ok",
        recoveries=(
            {"started_at": "2026-11-29T09:00:00+00:00", "result": "old-recovery"},
            {"started_at": "2026-11-29T11:30:00+00:00", "result": "new-recovery"},
        ),
        survivors=(
            {"at": "2026-11-29T09:00:00+00:00", "summary": "old-sweep"},
            {"at": "2026-11-29T11:59:00+00:00", "summary": "new-sweep"},
        ),
    )
    snapshot = snapshots.written(
        {"sglang.service": watch},
        xids=(xid(79, "2026-11-29T10:00:00+00:00"), xid(48, "2026-11-29T11:10:00")),
    )
    inventory = build_inventory(nvml(gpu(0), gpu(1)), ProcScan(()), 16 * MIB)
    unit = UnitView("sglang.service", "active (running)", "GPUs 0,1 (from config)")
    context = replace(
        STATUS_CONTEXT,
        daemon=snapshots.running(snapshot),
        units=(unit,),
        since=NOW - timedelta(hours=1),
    )
    report = assess(inventory, context, NOW)
    text, doc = render_text(report), to_json(report)
    assert "History since 2026-11-29T11:00:00+00:00" in text
    assert "Xid 48" in text
    assert "Xid 79" not in text
    assert "new-recovery" in text
    assert "old-recovery" not in text
    assert "new-sweep" in text
    assert "old-sweep" not in text
    assert [e["code"] for e in doc["xid_events"]] == [48]
    assert doc["since"] == "2026-11-29T11:00:00+00:00"
    everything = to_json(assess(inventory, replace(context, since=None), NOW))
    assert [e["code"] for e in everything["xid_events"]] == [79, 48]
    assert everything["since"] is None


def _stuck_report(xid_pid: int, xid_at_s: float, *, unkillable: bool) -> tuple[Level, str]:
    """Judge PID 4242 holding GPU 0 in state R, after an Xid 31 naming ``xid_pid``.

    4242 started at tick 5242 (52.42 s after boot); the Xid came at ``xid_at_s``; the gate's
    last reap left it alive or not.
    """
    holder = process(4242, 0, state="R")
    inventory = build_inventory(nvml(gpu(0, (4242, 8000))), ProcScan((holder,)), 16 * MIB)
    xid = snapshots.xid(
        31, "0000:19:00", pid=xid_pid, time="2026-11-29T11:59:00+00:00", monotonic_s=xid_at_s
    )
    decision = {
        "time": "2026-11-29T11:59:30+00:00",
        "result": "refused",
        "reaped": [{"pid": 4242, "outcome": "unkillable" if unkillable else "killed"}],
    }
    unit = UnitView("sglang.service", "activating", "all GPUs", gate_decisions=(decision,))
    context = replace(
        STATUS_CONTEXT, daemon=snapshots.running(snapshots.written(xids=(xid,))), units=(unit,)
    )
    report = assess(inventory, context, NOW)
    return report.level, render_text(report)


def test_a_holder_sigkill_left_alive_after_an_xid_naming_it_is_stuck_in_the_driver() -> None:
    """Xid 31 named PID 4242 after it started; the gate's SIGKILL left it running: CRITICAL."""
    level, text = _stuck_report(4242, 60.0, unkillable=True)
    assert level is Level.CRITICAL
    assert (
        "PID 4242 (python3) holding GPU 0 is stuck in the driver after Xid 31 (GPU memory page "
        "fault) at 2026-11-29T11:59:00+00:00: SIGKILL did not end it"
    ) in text


@pytest.mark.parametrize(
    ("xid_pid", "at_s", "unkillable"),
    [(4243, 60.0, True), (4242, 50.0, True), (4242, 60.0, False)],
    ids=["another-pid", "younger-than-the-xid", "no-sigkill"],
)
def test_the_xid_pid_is_only_a_claim(xid_pid: int, at_s: float, *, unkillable: bool) -> None:
    """Another PID, a process younger than the Xid (PID reused), or no SIGKILL: not stuck."""
    _, text = _stuck_report(xid_pid, at_s, unkillable=unkillable)
    assert "stuck in the driver" not in text


# -- a unit's own docker/podman container (adapters/containerstop.owners confirms it) -----------

DOCKER_ID = "1a2b3c4d5e6f" + "0" * 52
DOCKER_CGROUP = f"/system.slice/docker-{DOCKER_ID}.scope"


def container_verdict(*, left_over: bool, name: str = "sglang-srv") -> ContainerVerdict:
    """The gate's verdict on a container the engine confirmed is sglang.service's."""
    return ContainerVerdict(
        Engine.DOCKER,
        DOCKER_ID[:12],
        stop=left_over,
        reason="confirmed",
        name=name,
        full_id=DOCKER_ID,
    )


def judge_containers(
    owned: dict[str, tuple[str, ContainerVerdict]],
) -> tuple[Level, str, dict[str, Any]]:
    """A server in a docker container on GPU 0, judged with ``owned`` confirmations."""
    server = process(10, 0, cgroup=DOCKER_CGROUP)
    inventory = build_inventory(nvml(gpu(0, (10, 1000))), ProcScan((server,)), 16 * MIB)
    report = assess(inventory, replace(STATUS_CONTEXT, unit_containers=owned), NOW)
    return report.level, render_text(report), to_json(report)


def test_an_unconfirmed_container_is_shown_as_before() -> None:
    """Without the engine's confirmation the holder is docker:<id12>, and looks like a left-over."""
    level, text, doc = judge_containers({})
    assert "docker:1a2b3c4d5e6f" in text
    assert level is Level.WARNING
    assert "runs outside it (docker:1a2b3c4d5e6f)" in text
    assert doc["holders"][0]["unit_container"] is None


def test_the_units_live_container_is_shown_as_the_units() -> None:
    """Confirmed and live: the unit's, named; no warning; the JSON carries unit, name and id."""
    owned = {"docker:1a2b3c4d5e6f": ("sglang.service", container_verdict(left_over=False))}
    level, text, doc = judge_containers(owned)
    assert "sglang.service (container sglang-srv, docker 1a2b3c4d5e6f)" in text
    assert level is Level.OK
    holder = doc["holders"][0]
    assert holder["container"] == "docker:1a2b3c4d5e6f"
    assert holder["unit_container"] == {
        "unit": "sglang.service",
        "name": "sglang-srv",
        "engine": "docker",
        "id": DOCKER_ID,
        "left_over": False,
    }


def test_the_units_left_over_container_is_a_warning_saying_what_stops_it() -> None:
    """Confirmed and of an earlier run: said so on the holder line and as one WARNING."""
    owned = {"docker:1a2b3c4d5e6f": ("sglang.service", container_verdict(left_over=True))}
    level, text, doc = judge_containers(owned)
    assert "sglang.service (container sglang-srv, docker 1a2b3c4d5e6f, left over)" in text
    assert level is Level.WARNING
    [finding] = doc["findings"]
    assert finding["message"] == (
        "sglang.service's container sglang-srv (docker 1a2b3c4d5e6f) is left over from an "
        "earlier run (PID 10 holding GPU 0): `gpuguard reap --unit sglang.service` or the "
        "unit's gate stops it"
    )
    assert doc["holders"][0]["unit_container"]["left_over"] is True


def test_a_container_name_is_escaped() -> None:
    """The name is foreign text: a terminal never gets its control characters."""
    hostile = container_verdict(left_over=True, name="x\x1b[2J\nWARNING: fake")
    _, text, _ = judge_containers({"docker:1a2b3c4d5e6f": ("sglang.service", hostile)})
    assert "\x1b" not in text
    assert "\nWARNING: fake" not in text


def test_the_cut_counter_counts_what_was_cut_of_the_whole_command_line() -> None:
    """A 20,000-character command line cut to one status line says how much of it is left out.

    Not what was cut of the 4,096-character form kept for records (``[+4012 chars]``).
    """
    argv = ("python3", "-m", "sglang.launch_server", "--model", "x" * 20_000)
    _, text, _ = judge(nvml(gpu(0, (10, 100))), process(10, 0, cmdline=argv))
    line = next(line for line in text.splitlines() if line.startswith("    pid 10 "))
    shown = line[line.index("python3 -m") : line.index("...[+")]
    cut = int(line[line.index("...[+") + 5 :].removesuffix(" chars]"))
    assert cut == len(" ".join(argv)) - len(shown)
    assert cut > 19_900
