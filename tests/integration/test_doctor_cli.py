"""`gpuguard doctor` end to end in a subprocess, on recorded journals and real environment files.

systemd cannot run here outside a container, so ``systemctl`` and ``journalctl`` are small shell
scripts bound over the real programs in a private mount namespace (the only stand-ins; gpuguard
never looks at PATH; root only): ``systemctl show`` prints settings as systemd 252
prints them, ``journalctl`` prints a journal recorded from a real systemd 252
(tests/journal_samples). Everything else is the real CLI: argument parsing, the gathering
adapter reading real EnvironmentFile= files, the analysis and the renderers. The e2e suite runs
doctor against a real systemd.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from asnobody import public_dir, run_as_nobody
from fakestate import update_gpu

if TYPE_CHECKING:
    from collections.abc import Iterator

    from clirunner import Cli, UnitCgroups
    from fakeholder import HolderSpawner

SAMPLES = Path(__file__).parent.parent / "journal_samples" / "bookworm"
INCIDENT_SHOW = """\
LoadState=loaded
User=
Type=simple
KillMode=process
TimeoutStopUSec=2s
TimeoutStartUSec=1min 30s
Restart=always
RestartUSec=100ms
StartLimitIntervalUSec=10s
StartLimitBurst=5
Environment=
EnvironmentFiles={env_file} (ignore_errors=no)
DropInPaths=
"""
OTHER_SHOW = """\
LoadState=loaded
KillMode=mixed
TimeoutStopUSec=1min 30s
Restart=on-failure
Environment=CUDA_VISIBLE_DEVICES=1,2
ExecStart={ path=/opt/vllm/bin/vllm ; argv[]=/opt/vllm/bin/vllm serve Qwen/Qwen3-0.6B \
--api-key sk-live-4f9a0c --shutdown-timeout 300 ; ignore_errors=no ; start_time=[n/a] ; \
stop_time=[n/a] ; pid=0 ; code=(null) ; status=0/0 }
"""


@pytest.fixture
def doubles(cli: Cli, tmp_path: Path) -> Iterator[Path]:
    """systemctl/journalctl stand-ins in place of the real ones; returns their directory."""
    if os.geteuid() != 0:
        pytest.skip("binding the stand-ins needs root")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env_file = tmp_path / "sglang.env"
    env_file.write_text("# the server's GPUs\nCUDA_VISIBLE_DEVICES='0,1'\n")
    (tmp_path / "sglang.show").write_text(INCIDENT_SHOW.format(env_file=env_file))
    (tmp_path / "vllm.show").write_text(OTHER_SHOW)
    (bin_dir / "systemctl").write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {tmp_path}/systemctl.args\n'
        f'[ "$1" = show ] || exit 1\n'
        f'case "$2" in sglang.service) cat {tmp_path}/sglang.show;; '
        f"vllm.service) cat {tmp_path}/vllm.show;; *) echo 'Host is down' >&2; exit 1;; esac\n"
    )
    (bin_dir / "journalctl").write_text(
        f'#!/bin/sh\necho "$*" >> {tmp_path}/journalctl.args\n'
        f"cat {SAMPLES}/stop-sigterm-timeout.jsonl\n"
    )
    for script in bin_dir.iterdir():
        script.chmod(0o755)
        cli.doubles[script.name] = script
    cli.configure('[units."sglang.service"]\n[units."vllm.service"]\n')
    yield bin_dir
    cli.doubles.clear()


@pytest.mark.usefixtures("doubles")
def test_doctor_finds_the_incident_and_prints_its_fix(cli: Cli, tmp_path: Path) -> None:
    """Short stop timeout cut by SIGKILL, KillMode=process, no gate, GPUs shared: exit 2."""
    result = cli("doctor", "--unit", "sglang.service")
    assert result.code == 2, result.err
    lines = result.out.splitlines()
    assert lines[0] == "sglang.service: CRITICAL"
    assert any(
        "CRITICAL TimeoutStopSec=2s cut 1 of 1 stops short (SIGKILL)" in line for line in lines
    )
    assert any("CRITICAL KillMode=process" in line for line in lines)
    assert any("shares GPUs (1) with vllm.service" in line for line in lines)
    assert any("the gate is not installed" in line for line in lines)
    [args] = [
        line
        for line in (tmp_path / "journalctl.args").read_text().splitlines()
        if "UNIT=sglang.service" in line
    ]
    assert args.endswith(
        "_PID=1 UNIT=sglang.service + _SYSTEMD_CGROUP=/init.scope UNIT=sglang.service"
    )
    assert "--lines=20000" in args

    fixed = cli("doctor", "--unit", "sglang.service", "--fix")
    assert fixed.code == 2
    assert "TimeoutStopSec=2min" in fixed.out.splitlines()
    assert "KillMode=mixed" in fixed.out.splitlines()
    assert "StartLimitBurst=5" in fixed.out.splitlines()


@pytest.mark.usefixtures("doubles")
def test_doctor_json_covers_every_watched_unit(cli: Cli) -> None:
    """Without --unit: both watched units, versioned, exit code in the document."""
    result = cli("doctor", "--json")
    document = result.json()
    assert result.code == document["exit_code"] == 2
    assert document["schema"] == "gpuguard.doctor"
    assert document["version"] == 1
    assert [u["unit"] for u in document["units"]] == ["sglang.service", "vllm.service"]
    stop = next(f for f in document["units"][0]["findings"] if f["code"] == "stop-timeout")
    assert stop["fix"] == {
        "section": "Service",
        "lines": [stop["fix"]["lines"][0], "TimeoutStopSec=2min"],
    }
    json.dumps(document)


@pytest.mark.usefixtures("doubles")
def test_doctor_reads_the_servers_own_settings_from_execstart(cli: Cli, tmp_path: Path) -> None:
    """The --shutdown-timeout and Restart= of a vLLM unit judged; its --api-key shown nowhere."""
    result = cli("doctor", "--unit", "vllm.service", "--json")
    findings = {f["code"]: f for f in result.json()["units"][0]["findings"]}
    assert findings["engine"]["title"] == "ExecStart= runs vLLM"
    assert findings["engine-drain"]["fix"]["lines"][-1] == "TimeoutStopSec=5min 30s"
    assert findings["exit-0"]["fix"]["lines"][-1] == "Restart=always"
    assert "--property=ExecStart" in (tmp_path / "systemctl.args").read_text().split()
    fixed = cli("doctor", "--unit", "vllm.service", "--fix")
    text = cli("doctor", "--unit", "vllm.service")
    assert "--api-key '<redacted>'" in text.out or "--api-key <redacted>" in text.out
    for output in (result.out, fixed.out, text.out, result.err, fixed.err, text.err):
        assert "sk-live-4f9a0c" not in output


@pytest.mark.usefixtures("doubles")
def test_doctor_is_unknown_when_systemd_cannot_be_asked(cli: Cli) -> None:
    """A failing systemctl: exit 3 with systemctl's reason, never a clean bill of health."""
    result = cli("doctor", "--unit", "other.service")
    assert result.code == 3
    assert "UNKNOWN" in result.out
    assert "Host is down" in result.out


def test_doctor_without_root_and_an_empty_journal_is_unknown(cli: Cli) -> None:
    """As nobody, a journal that shows nothing is not "no stops": UNKNOWN, saying why."""
    if os.geteuid() != 0:
        pytest.skip("dropping to nobody needs root")
    with public_dir() as public:
        bin_dir = public / "bin"
        bin_dir.mkdir()
        (bin_dir / "systemctl").write_text(
            "#!/bin/sh\necho LoadState=loaded\necho KillMode=mixed\n"
        )
        (bin_dir / "journalctl").write_text("#!/bin/sh\nexit 0\n")
        for script in bin_dir.iterdir():
            script.chmod(0o755)
            cli.doubles[script.name] = script
        config = public / "gpuguard.toml"
        shutil.copy(cli.config, config)
        config.chmod(0o644)
        args = ["--config", str(config), "doctor", "--unit", "sglang.service"]
        result = run_as_nobody(args, cli.env, prefix=cli.prefix())
        cli.doubles.clear()
    assert result.code == 3, result.out + result.err
    assert "the journal showed nothing about sglang.service: run as root" in result.out


@pytest.mark.usefixtures("doubles")
def test_doctor_compares_the_gpu_set_with_what_the_units_processes_hold(
    cli: Cli, spawn_holder: HolderSpawner, unit_cgroups: UnitCgroups
) -> None:
    """Its EnvironmentFile= says GPUs 0,1; a real process in its cgroup holds 1 and 2."""
    server = spawn_holder(cli.state, gpus=(1, 2), mib=1000, name="python3 -m sglang.launch_server")
    # A slice of this test's own: the unit is the first unit below the slices, whatever slice.
    unit_cgroups.move(server.pid, "sglang.service", slice_=f"doctor-{uuid.uuid4().hex[:8]}.slice")
    result = cli("doctor", "--unit", "sglang.service")
    assert "its processes hold GPUs 2 outside its GPU set (0,1)" in result.out, result.out
    fixed = cli("doctor", "--unit", "sglang.service", "--fix")
    assert 'Environment="CUDA_VISIBLE_DEVICES=1,2"' in fixed.out.splitlines()


@pytest.mark.usefixtures("doubles")
def test_doctor_reads_persistence_mode_through_nvml(cli: Cli) -> None:
    """The fake driver's default is persistence off (as the real one's): every GPU is named."""
    result = cli("doctor", "--unit", "sglang.service")
    assert "persistence mode is off on GPUs 0,1,2,3:" in result.out, result.out
    for gpu in range(4):
        update_gpu(cli.state, gpu, persistence_mode=1)
    assert "persistence mode is on on every GPU" in cli("doctor", "--unit", "sglang.service").out


@pytest.mark.usefixtures("doubles")
def test_doctor_proposes_timeout_start_sec_from_the_daemons_saved_starts(
    cli: Cli, tmp_path: Path
) -> None:
    """A Type=notify unit with 3 starts saved in state_dir: one TimeoutStartSec= line in --fix."""
    show = tmp_path / "sglang.show"
    show.write_text(show.read_text().replace("Type=simple", "Type=notify"))
    starts = [
        {"invocation_id": f"run{n}", "ready_s": ready, "phases": {"starting": ready}}
        for n, ready in enumerate([40.0, 50.0, 60.0])
    ]
    saved = cli.config.parent / "lib" / "units" / "sglang.service.json"
    saved.parent.mkdir(parents=True)
    saved.write_text(json.dumps({"schema_version": 1, "liveness": {"starts": starts}}))
    result = cli("doctor", "--unit", "sglang.service")
    assert "WARNING  TimeoutStartSec=1min 30s can kill a healthy slow start" in result.out
    assert f"saved them in {saved}: median 50s, longest 1min" in result.out
    fixed = cli("doctor", "--unit", "sglang.service", "--fix").out.splitlines()
    assert [line for line in fixed if line.startswith("TimeoutStartSec=")] == [
        "TimeoutStartSec=2min"
    ]
