"""doctor's analysis on recorded systemd 252/257 journals and hand-made unit settings."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from sglangstop import drained_then_self_killed

from gpuguard.adapters import reaper
from gpuguard.adapters.doctorio import path_chain
from gpuguard.core.doctor import (
    AuditedUnit,
    Finding,
    GpuUseFacts,
    History,
    HostFacts,
    PathFact,
    Stop,
    build_history,
    diagnose,
    render_fix,
    render_json,
    render_text,
    worst,
)
from gpuguard.core.levels import Level
from gpuguard.core.stopbudget import DROP_IN
from gpuguard.core.unitconfig import UnitConfig

SAMPLES = Path(__file__).parent.parent / "journal_samples"
UNIT = "sglang.service"
HOST = HostFacts(gate_timeout_s=300.0, nvidia_devices=False, persistenced_running=False)
GATED = ("/etc/systemd/system/sglang.service.d/gpuguard-gate.conf",)


def sample(release: str, name: str) -> History:
    """The history doctor builds from one recorded journal."""
    lines = (SAMPLES / release / f"{name}.jsonl").read_text().splitlines()
    return build_history([json.loads(line) for line in lines], UNIT)


def config(**overrides: object) -> UnitConfig:
    """A healthy gated unit; ``overrides`` make it unhealthy one setting at a time."""
    settings: dict[str, object] = {
        "unit": UNIT,
        "load_state": "loaded",
        "kill_mode": "mixed",
        "timeout_stop_s": 120.0,
        "timeout_start_s": 600.0,
        "restart": "on-failure",
        "restart_s": 10.0,
        "start_limit_interval_s": 3600.0,
        "start_limit_burst": 5,
        "drop_in_paths": GATED,
    }
    settings.update(overrides)
    return UnitConfig(**settings)  # type: ignore[arg-type]


def facts(
    unit_config: UnitConfig | None = None, history: History | None = None, **extra: object
) -> AuditedUnit:
    """AuditedUnit with defaults for everything a test does not care about."""
    values: dict[str, object] = {
        "config": unit_config or config(),
        "history": history or History(),
        "environment": {"CUDA_VISIBLE_DEVICES": "0,1"},
        "gpus": None,
        "user_uid": 0,
    }
    values.update(extra)
    return AuditedUnit(**values)  # type: ignore[arg-type]


def by_code(findings: tuple[Finding, ...], code: str) -> Finding:
    """The one finding with ``code``."""
    (found,) = [f for f in findings if f.code == code]
    return found


@pytest.mark.parametrize("release", ["bookworm", "trixie"])
def test_a_stop_cut_short_by_sigkill_is_critical_with_a_longer_timeout(release: str) -> None:
    """The incident: TimeoutStopSec=2s, the drain longer; SIGKILL counted, a budget proposed."""
    history = sample(release, "stop-sigterm-timeout")
    assert [s.killed for s in history.stops] == [True]
    assert 2.0 <= history.stops[0].drain_s < 2.5  # recorded: TimeoutStopSec=2s
    found = by_code(diagnose(facts(config(timeout_stop_s=2.0), history), {}, HOST), "stop-timeout")
    assert found.severity is Level.CRITICAL
    assert "1 of 1 stops short (SIGKILL)" in found.title
    assert "no observed upper bound" in found.title
    assert found.fix[-1] == "TimeoutStopSec=2min"


def test_stops_killed_under_an_earlier_shorter_timeout_no_longer_count() -> None:
    """After the fix: the 3 s kill is history, the 30 s drain is covered by 2 min: OK."""
    stops = (Stop("old", 3.1, killed=True), Stop("new", 30.0, killed=False))
    found = by_code(
        diagnose(facts(config(timeout_stop_s=120.0), History(stops=stops)), {}, HOST),
        "stop-timeout",
    )
    assert found.severity is Level.OK
    assert any("under an earlier, shorter setting" in line for line in found.evidence)
    only_old = by_code(
        diagnose(facts(config(timeout_stop_s=60.0), History(stops=stops[:1])), {}, HOST),
        "stop-timeout",
    )
    assert only_old.severity is Level.WARNING
    assert only_old.fix[-1] == "TimeoutStopSec=2min"


@pytest.mark.parametrize("release", ["bookworm", "trixie"])
def test_a_clean_stop_is_measured_and_needs_nothing(release: str) -> None:
    """Stopping → main process exited, on the monotonic clock; no kill, nothing to fix."""
    history = sample(release, "clean-start-stop")
    assert [s.killed for s in history.stops] == [False]
    assert history.stops[0].drain_s < 1
    found = by_code(diagnose(facts(history=history), {}, HOST), "stop-timeout")
    assert found.severity is Level.OK
    assert found.fix == ()


@pytest.mark.parametrize("release", ["bookworm", "trixie"])
def test_sglangs_own_sigkill_after_a_clean_drain_is_a_clean_stop(release: str) -> None:
    """SGLang's drain ends in its own SIGKILL (exit 137) before any timeout: a clean stop.

    Killed means systemd's timeout cut the stop ("State 'stop-sigterm' timed out"), never a
    status=9/KILL that came first (issue 34).
    """
    history = build_history(drained_then_self_killed(release), UNIT)
    assert [s.killed for s in history.stops] == [False]
    found = by_code(diagnose(facts(config(timeout_stop_s=90.0), history), {}, HOST), "stop-timeout")
    assert found.severity is Level.OK
    assert "0 ended in SIGKILL" in found.evidence[0]


def test_p99_drain_times_margin_sets_the_timeout() -> None:
    """100 clean drains of 10..109 s: p99 is 108 s, x1.5 = 162 s, rounded up to 3 min."""
    stops = tuple(Stop(f"i{n}", 10.0 + n, killed=False) for n in range(100))
    found = by_code(
        diagnose(facts(config(timeout_stop_s=90.0), History(stops=stops)), {}, HOST),
        "stop-timeout",
    )
    assert found.severity is Level.WARNING
    assert found.fix == ("# p99 drain x 1.5", "TimeoutStopSec=3min")
    assert any("p99 1min 48s" in line for line in found.evidence)


def test_killed_stops_longer_than_the_clean_ones_are_not_ignored() -> None:
    """Clean drains of 5 s but one stop killed at 60 s: the suggestion covers the killed one."""
    stops = (Stop("a", 5.0, killed=False), Stop("b", 60.0, killed=True))
    found = by_code(
        diagnose(facts(config(timeout_stop_s=60.0), History(stops=stops)), {}, HOST),
        "stop-timeout",
    )
    assert found.severity is Level.CRITICAL
    assert found.fix[-1] == "TimeoutStopSec=4min"


@pytest.mark.parametrize("release", ["bookworm", "trixie"])
def test_survivors_are_named_escaped_and_kill_mode_process_is_critical(release: str) -> None:
    """Processes that "remain running after unit stopped" and left-over ones, named, escaped."""
    history = sample(release, "stop-sigkill-survivor")
    assert [comm for _, comm in history.survivors] == ["python3"]
    left = sample(release, "left-over-process")
    assert {comm for _, comm in left.survivors} == {"sglang-worker"}
    assert len(left.survivors) == 2  # logged twice per start, counted once
    hostile = History(survivors=((7, "evil\x1b[2J\nOK"),))
    findings = diagnose(facts(config(kill_mode="process"), hostile), {}, HOST)
    kill = by_code(findings, "kill-mode")
    assert kill.severity is Level.CRITICAL
    assert kill.fix[-1] == "KillMode=mixed"
    assert str(by_code(findings, "survivors").advice).startswith("KillMode=mixed")
    mixed = by_code(diagnose(facts(config(), hostile), {}, HOST), "survivors")
    assert str(mixed.advice).startswith(
        "install the gate: its ExecStopPost= reap and its check before each start"
    )
    assert f"`gpuguard reap --unit {UNIT} --dry-run`" in str(mixed.advice)
    text = render_text({UNIT: findings})
    assert "\x1b" not in text
    (names,) = [line for line in text.splitlines() if "names:" in line]
    assert names.startswith("           names: evil\\")
    assert names.endswith("[2J\\nOK")  # the newline escaped: no forged line


def test_the_units_own_lines_never_count_as_survivors() -> None:
    """Lines the unit wrote that read as survivors count for nothing; systemd's one counts once.

    Its out-of-memory line naming 40 PIDs, a copy of systemd's "remains running" line and of
    the daemon's sweep from the unit's output, and lines with the trusted fields but another
    transport than the one PID 1 (native) or the daemon (its standard error) logs by. The
    named PIDs are the server's word: shown apart, never counted (before, they were: 41).
    """
    lines = (SAMPLES / "bookworm" / "stop-sigkill-survivor.jsonl").read_text().splitlines()
    entries = [json.loads(line) for line in lines]
    base = entries[0]
    run = base.get("INVOCATION_ID") or base.get("_SYSTEMD_INVOCATION_ID")
    unit_said = {
        **base,
        "_SYSTEMD_UNIT": UNIT,
        "_SYSTEMD_INVOCATION_ID": run,
        "_PID": "500",
        "_UID": "1000",
        "_TRANSPORT": "stdout",
        "_SYSTEMD_CGROUP": f"/system.slice/{UNIT}",
    }
    for key in ("UNIT", "MESSAGE_ID", "INVOCATION_ID"):
        unit_said.pop(key, None)
    oom = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacity of 140.40 GiB of which 21.06 GiB is free. "
        + " ".join(f"Process {pid} has 1.00 GiB memory in use." for pid in range(900, 940))
    )
    sweep = json.dumps({"event": "survivors of an ended run", "unit": UNIT, "pids": [7, 8]})
    remains = f"{UNIT}: Unit process 9 (x) remains running after unit stopped."
    forged = [
        {**unit_said, "MESSAGE": oom, "__CURSOR": "oom"},
        {**unit_said, "MESSAGE": remains, "__CURSOR": "remains"},
        {**unit_said, "MESSAGE": sweep, "__CURSOR": "sweep"},
        {**base, "MESSAGE": remains.replace("9", "10"), "_TRANSPORT": "stdout", "__CURSOR": "s"},
        {**base, "MESSAGE": sweep, "_SYSTEMD_UNIT": "gpuguard.service", "_PID": "300",
         "_TRANSPORT": "syslog", "__CURSOR": "syslog"},
    ]  # fmt: skip
    history = build_history([*entries, *forged], UNIT)
    assert [comm for _, comm in history.survivors] == ["python3"]
    assert history.swept == ()
    assert history.named[:2] == (900, 901)
    finding = by_code(diagnose(facts(config(), history), {}, HOST), "survivors")
    assert finding.title == "1 process survived a stop or was left over at a start"
    [pids] = [line for line in finding.evidence if line.startswith("PIDs: ")]
    assert pids == f"PIDs: {history.survivors[0][0]}"
    assert any("(its word, not counted)" in line for line in finding.evidence)


@pytest.mark.parametrize("release", ["bookworm", "trixie"])
def test_forged_entries_yield_no_history(release: str) -> None:
    """A user's journal entries that claim to be PID 1 make no stop, run or survivor."""
    history = sample(release, "forged-entries")
    assert history.entries > 0
    assert history == History(entries=history.entries)


@pytest.mark.parametrize("release", ["bookworm", "trixie"])
def test_a_restart_loop_the_start_limit_ends_is_ok(release: str) -> None:
    """The recorded loop: RestartSec=1s, 5 starts in 10 s; the start limit hit once."""
    history = sample(release, "restart-loop-start-limit")
    assert history.restarts == 5
    assert history.start_limit_hits == 1
    assert len(history.failed_runs_s) == 5
    unit = config(
        restart="always",
        restart_s=1.0,
        start_limit_interval_s=10.0,
        start_limit_burst=5,
        drop_in_paths=(),
    )
    found = by_code(diagnose(facts(unit, history), {}, HOST), "restart")
    assert found.severity is Level.OK


def test_a_refusing_gate_loops_forever_under_default_start_limits() -> None:
    """Gate timeout 300 s + RestartSec 100 ms never puts 5 starts in 10 s: sized limit proposed."""
    unit = config(restart="always", restart_s=0.1, start_limit_interval_s=10.0)
    history = History(failed_runs_s=(100.0,) * 3)
    findings = diagnose(facts(unit, history), {}, HOST)
    loop = by_code(findings, "restart")
    assert loop.severity is Level.WARNING
    assert loop.section == "Unit"
    assert "12 starts per hour" in loop.title  # one every 300.1 s
    assert "20min of model loads" in loop.title
    assert loop.fix[1:] == ("StartLimitIntervalSec=31min", "StartLimitBurst=5")
    assert by_code(findings, "restart-sec").fix == ("RestartSec=10s",)


def test_gate_missing_and_gate_timeout_above_timeout_start() -> None:
    """No drop-in: install it; a TimeoutStartSec= under the gate's timeout: raise it."""
    missing = by_code(diagnose(facts(config(drop_in_paths=())), {}, HOST), "gate")
    assert missing.severity is Level.WARNING
    assert missing.advice == "gpuguard install-gate --unit sglang.service"
    short = by_code(diagnose(facts(config(timeout_start_s=90.0)), {}, HOST), "gate-timeout")
    assert short.fix == ("TimeoutStartSec=6min",)
    via_exec = config(drop_in_paths=(), exec_start_pre=(("/usr/bin/gpuguard", "gate"),))
    assert by_code(diagnose(facts(via_exec), {}, HOST), "gate").severity is Level.OK
    own_timeout = config(
        timeout_start_s=600.0,
        exec_start_pre=(("/usr/bin/gpuguard", "gate", "--unit", UNIT, "--timeout", "900"),),
    )
    longer = by_code(diagnose(facts(own_timeout), {}, HOST), "gate-timeout")
    assert longer.fix == ("TimeoutStartSec=16min",)  # its own --timeout 900, not the config's


def test_the_stop_reap_says_what_it_gets_of_the_stop_timeout() -> None:
    """The drop-in's ExecStopPost= reap: as asked in 2min, cut to fit 5s, with the numbers."""
    roomy = by_code(diagnose(facts(config(timeout_stop_s=120.0)), {}, HOST), "stop-reap")
    assert roomy.severity is Level.OK
    assert roomy.title == (
        "the ExecStopPost= reap fits in TimeoutStopSec=2min as asked: 5.0 s SIGTERM grace, "
        "5.0 s after SIGKILL, 20.0 s wait for the memory"
    )
    short = by_code(diagnose(facts(config(timeout_stop_s=5.0)), {}, HOST), "stop-reap")
    assert short.title == (
        "the ExecStopPost= reap fits itself in TimeoutStopSec=5s: 1.8 s SIGTERM grace, 1.8 s "
        "after SIGKILL, no wait for the memory (the next start's gate waits for it)"
    )
    assert "the next start's gate reaps what it left" in short.evidence[0]
    ungated = diagnose(facts(config(drop_in_paths=())), {}, HOST)
    assert [f for f in ungated if f.code == "stop-reap"] == []


def test_the_drop_ins_kill_wait_is_the_reapers() -> None:
    """The budget counts the reaper's own wait after SIGKILL, whatever it becomes."""
    assert DROP_IN.kill_wait_s == reaper.KILL_WAIT_S


def test_overlapping_gpu_sets_are_named() -> None:
    """0,1 and 1,2 share GPU 1; a unit without any GPU set shares them all."""
    mine = facts()
    other = facts(config(unit="vllm.service"), environment={"CUDA_VISIBLE_DEVICES": "1,2"})
    overlap = by_code(diagnose(mine, {"vllm.service": other}, HOST), "gpu-overlap")
    assert overlap.title == "shares GPUs (1) with vllm.service"
    disjoint = facts(config(unit="vllm.service"), environment={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert not [f for f in diagnose(mine, {"v": disjoint}, HOST) if f.code == "gpu-overlap"]
    unset = facts(environment={})
    assert "all" in by_code(diagnose(unset, {"v": disjoint}, HOST), "gpu-overlap").title


def test_paths_the_service_user_can_change_are_found(tmp_path: Path) -> None:
    """A world-writable directory on PATH (real lstat), and a file owned by the user."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (tmp_path / "venv").chmod(0o777)
    safe = tmp_path / "safe"
    safe.mkdir(mode=0o755)
    service_uid = 4242
    owned = PathFact("/srv/env", service_uid, 0, 0o100600, is_dir=False)
    unit = facts(
        config(user="sglang"),
        user_uid=service_uid,
        paths={str(venv): path_chain(str(venv)), str(safe): (), "/srv/env": (owned,)},
    )
    found = [f for f in diagnose(unit, {}, HOST) if f.code == "writable-path"]
    assert [f.evidence[0] for f in found] == [
        "/srv/env: owned by the service user, mode 0600",
        f"{tmp_path / 'venv'}: group/other-writable, mode 0777",
    ]
    assert all(f.severity is Level.WARNING for f in found)
    as_root = facts(paths={str(venv): path_chain(str(venv))})
    assert not [f for f in diagnose(as_root, {}, HOST) if f.code == "writable-path"]


def test_sticky_directories_do_not_count() -> None:
    """/tmp is world-writable but sticky: nobody replaces a root-owned entry in it."""
    tmp = path_chain("/tmp")
    assert tmp
    assert tmp[0].mode & 0o1000
    unit = facts(user_uid=4242, paths={"/tmp": tmp})
    assert not [f for f in diagnose(unit, {}, HOST) if f.code == "writable-path"]


def test_persistenced_only_matters_with_nvidia_devices() -> None:
    """No /dev/nvidiactl: nothing said; present but no daemon: a warning."""
    assert not [f for f in diagnose(facts(), {}, HOST) if f.code == "persistenced"]
    gpus = HostFacts(300.0, nvidia_devices=True, persistenced_running=False)
    assert by_code(diagnose(facts(), {}, gpus), "persistenced").severity is Level.WARNING


def test_persistence_mode_from_nvml_decides_over_the_daemons_presence() -> None:
    """NVML says GPU 1 has persistence off: a warning naming it, even with the daemon running."""
    off = HostFacts(300.0, nvidia_devices=True, persistenced_running=True, persistence_off=(1,))
    finding = by_code(diagnose(facts(), {}, off), "persistenced")
    assert finding.severity is Level.WARNING
    assert finding.title.startswith("persistence mode is off on GPUs 1:")
    assert finding.evidence == ("nvidia-persistenced is running",)
    on = HostFacts(300.0, nvidia_devices=True, persistenced_running=False, persistence_off=())
    assert by_code(diagnose(facts(), {}, on), "persistenced").severity is Level.OK


def test_mig_mode_on_is_a_warning_saying_what_is_not_judged() -> None:
    """MIG on GPU 0: a warning that gpuguard neither waits on nor reaps from it; none without."""
    assert not [f for f in diagnose(facts(), {}, HOST) if f.code == "mig"]
    mig = HostFacts(300.0, nvidia_devices=True, persistenced_running=True, mig_on=(0,))
    finding = by_code(diagnose(facts(), {}, mig), "mig")
    assert finding.severity is Level.WARNING
    assert finding.title.startswith("MIG mode is on on GPU 0: ")
    assert "other tenants'" in finding.title
    assert "neither wait on nor reap from it" in finding.title


def test_unknown_when_systemd_cannot_be_asked_and_not_found() -> None:
    """No settings at all: UNKNOWN (exit 3), not a clean bill of health."""
    blind = facts(UnitConfig(UNIT), problems=("systemctl show: Host is down",))
    assert worst(diagnose(blind, {}, HOST)) is Level.UNKNOWN
    missing = facts(UnitConfig(UNIT, load_state="not-found"))
    assert by_code(diagnose(missing, {}, HOST), "not-found").severity is Level.UNKNOWN


def test_fix_is_one_complete_drop_in_and_json_is_versioned() -> None:
    """Every fix line under its section, advice as comments; JSON carries level and exit code."""
    unit = config(
        kill_mode="process",
        timeout_stop_s=2.0,
        restart="always",
        restart_s=0.1,
        start_limit_interval_s=10.0,
        drop_in_paths=(),
    )
    history = History(stops=(Stop("a", 2.0, killed=True),))
    findings = diagnose(facts(unit, history), {}, HOST)
    fix = render_fix(UNIT, findings)
    unit_part, service_part = fix.split("[Unit]\n")[1].split("[Service]\n")
    assert "StartLimitIntervalSec=" in unit_part
    assert "StartLimitBurst=5" in unit_part
    for line in ("KillMode=mixed", "TimeoutStopSec=2min", "RestartSec=10s"):
        assert line in service_part.splitlines()
    assert "# Also (gate): gpuguard install-gate --unit sglang.service" in fix
    assert "zz-gpuguard-doctor.conf" in fix
    document = render_json({UNIT: findings})
    assert document["schema"] == "gpuguard.doctor"
    assert document["version"] == 1
    assert document["exit_code"] == 2
    assert json.loads(json.dumps(document)) == document


def test_writable_path_chain_reads_real_modes(tmp_path: Path) -> None:
    """path_chain lists the object first and / last, with lstat's owner and mode."""
    target = tmp_path / "a"
    target.mkdir()
    chain = path_chain(str(target))
    assert chain[0].path == str(target)
    assert chain[-1].path == "/"
    assert chain[0].uid == os.getuid()
    assert path_chain("relative/path") == ()


def test_hostile_environment_values_and_reasons_stay_on_one_line() -> None:
    """An ESC/newline in CUDA_VISIBLE_DEVICES or in a gathering problem never reaches raw."""
    hostile = "0,\x1b[2J\nOK: all fine"
    mine = facts(environment={"CUDA_VISIBLE_DEVICES": hostile}, problems=("read\x1b]0;x\x07",))
    other = facts(config(unit="vllm.service"), environment={"CUDA_VISIBLE_DEVICES": hostile})
    findings = diagnose(mine, {"vllm.service": other}, HOST)
    for text in (render_text({UNIT: findings}), render_fix(UNIT, findings)):
        assert "\x1b" not in text
        assert "\x07" not in text
        assert not [line for line in text.splitlines() if line.startswith("OK: all fine")]
    assert "\x1b" not in json.dumps(render_json({UNIT: findings}))


def test_gpus_held_outside_the_set_are_named_with_the_fixing_line() -> None:
    """Its processes hold GPU 2 while CUDA_VISIBLE_DEVICES says 0,1: the gate looks elsewhere."""
    use = GpuUseFacts(set_indices=frozenset({0, 1}), held=frozenset({1, 2}), gpu_count=4)
    finding = by_code(diagnose(facts(use=use), {}, HOST), "gpu-use")
    assert finding.severity is Level.WARNING
    assert finding.title == "its processes hold GPUs 2 outside its GPU set (0,1)"
    assert 'Environment="CUDA_VISIBLE_DEVICES=1,2"' in finding.fix


def test_a_unit_on_all_gpus_that_uses_some_is_told_to_name_them() -> None:
    """No set (all GPUs) but it holds two of four: OK, with the line that names them."""
    use = GpuUseFacts(set_indices=None, held=frozenset({0, 3}), gpu_count=4)
    finding = by_code(diagnose(facts(environment={}, use=use), {}, HOST), "gpu-use")
    assert finding.severity is Level.OK
    assert "hold GPUs 0,3 of 4" in finding.title
    assert 'Environment="CUDA_VISIBLE_DEVICES=0,3"' in finding.fix
    inside = GpuUseFacts(set_indices=frozenset({0, 1}), held=frozenset({0}), gpu_count=4)
    assert "all in its set" in by_code(diagnose(facts(use=inside), {}, HOST), "gpu-use").title


def test_nothing_held_or_nvml_unknown_says_nothing_about_use() -> None:
    """A stopped unit (nothing held) or NVML unavailable (None): no gpu-use finding at all."""
    idle = GpuUseFacts(set_indices=frozenset({0}), held=frozenset(), gpu_count=4)
    for use in (idle, None):
        assert not [f for f in diagnose(facts(use=use), {}, HOST) if f.code == "gpu-use"]


def test_survivors_the_daemon_swept_outside_the_cgroup_are_a_finding_with_the_command() -> None:
    """Workers that left the cgroup: systemd names none, the daemon's sweep line makes the finding.

    Only gpuguard.service as root counts: the unit printing the same JSON makes nothing.
    """
    base = json.loads(
        (SAMPLES / "bookworm" / "stop-sigterm-timeout.jsonl").read_text().split("\n")[0]
    )
    line = json.dumps(
        {
            "event": "survivors of an ended run",
            "unit": UNIT,
            "pids": [192, 193],
            "summary": "reaped 2 survivors of run 0959ecc2 within 1.7 s of its end; GPUs idle",
        }
    )
    daemon = {**base, "MESSAGE": line, "_SYSTEMD_UNIT": "gpuguard.service", "_UID": "0",
              "_PID": "300", "__CURSOR": "daemon"}  # fmt: skip
    forged = {**daemon, "_SYSTEMD_UNIT": UNIT, "_UID": "1000", "__CURSOR": "forged"}
    assert build_history([forged], UNIT).swept == ()
    history = build_history([daemon, forged], UNIT)
    assert history.swept == (((192, 193), json.loads(line)["summary"]),)
    finding = by_code(diagnose(facts(config(), history), {}, HOST), "survivors")
    assert finding.title.startswith("2 processes survived a stop")
    assert any("reaped 2 survivors of run 0959ecc2" in e for e in finding.evidence)
    assert f"`gpuguard reap --unit {UNIT}`" in str(finding.advice)


def test_the_guessed_stop_timeout_has_a_ceiling() -> None:
    """A drain killed at 8 min is never answered with 32 min: the guess stops at 10 min."""
    stops = (Stop("killed", 480.0, killed=True),)
    found = by_code(
        diagnose(facts(config(timeout_stop_s=480.0), History(stops=stops)), {}, HOST),
        "stop-timeout",
    )
    assert found.severity is Level.CRITICAL
    assert found.fix[-1] == "TimeoutStopSec=10min"
    assert "at most 10min" in found.fix[0]


def test_a_drain_killed_at_the_ceiling_is_advice_not_a_longer_timeout() -> None:
    """Killed at 10 min already: no longer timeout is proposed, the hanging shutdown is named."""
    stops = (Stop("killed", 600.0, killed=True),)
    found = by_code(
        diagnose(facts(config(timeout_stop_s=600.0), History(stops=stops)), {}, HOST),
        "stop-timeout",
    )
    assert found.severity is Level.CRITICAL
    assert found.fix == ()
    assert found.advice is not None
    assert "shutdown hangs" in found.advice


def test_a_simple_units_start_is_no_model_load() -> None:
    """Type=simple: "Starting" → "Started" (the gate's wait) never stands for a failing run's load.

    A real vLLM (issue 34) is "Started" 0.8 s after "Starting" and crashed 45 s after that: the
    loop's cost is counted from the 45 s run, never from the 0.8 s; Type=notify keeps both.
    """
    history = History(load_times_s=(0.807, 0.124), failed_runs_s=(45.2,))
    unit = config(type="simple", restart="always", restart_s=1.0, start_limit_interval_s=10.0)
    found = by_code(diagnose(facts(unit, history), {}, HOST), "restart")
    assert "a failing run (load until exit) takes 45s (median)" in found.evidence
    notify = config(type="notify", restart="always", restart_s=1.0, start_limit_interval_s=10.0)
    found = by_code(diagnose(facts(notify, history), {}, HOST), "restart")
    assert "a failing run (load until exit) takes 807ms (median)" in found.evidence
