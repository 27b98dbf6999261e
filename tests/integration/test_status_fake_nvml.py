"""`gpuguard status` over the unmodified pynvml and the C fake NVML, with real holders."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from fakestate import FakeGpu, fake_library, update_gpu, update_state, write_state
from hostpids import HOST_PIDS
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from pathlib import Path

    from clirunner import Cli, UnitCgroups
    from fakeholder import HolderSpawner


def test_idle_host_is_ok(cli: Cli) -> None:
    """Four idle GPUs: exit 0, one line per GPU marked idle, JSON says the same."""
    text = cli("status")
    assert text.code == 0, text.err
    assert text.out.startswith("gpuguard status: OK - all 4 GPUs idle")
    assert sum(line.endswith(" idle") for line in text.out.splitlines()[1:]) == 4
    doc = cli("status", "--json").json()
    assert doc["schema_version"] == 3
    assert doc["exit_code"] == 0
    assert [g["index"] for g in doc["gpus"]] == [0, 1, 2, 3]
    assert all(g["idle"] and g["memory"]["api"] == "v2" for g in doc["gpus"])
    assert doc["nvml"] == {"health": "ok", "reason": None, "driver_version": "550.54.15"}


def test_one_holder_per_gpu_with_units(
    cli: Cli, spawn_holder: HolderSpawner, unit_cgroups: UnitCgroups
) -> None:
    """Each GPU shows its own holder with the right unit and MiB."""
    holders = [spawn_holder(cli.state, gpus=(gpu,), mib=1000 * (gpu + 1)) for gpu in range(4)]
    for gpu, holder in enumerate(holders):
        unit_cgroups.move(holder.pid, f"gg-test-{os.getpid()}-{gpu}.service")
    result = cli("status", "--json")
    assert result.code == 0, result.out
    doc = result.json()
    by_pid = {h["pid"]: h for h in doc["holders"]}
    for gpu, holder in enumerate(holders):
        entry = by_pid[holder.pid]
        assert entry["unit"] == f"gg-test-{os.getpid()}-{gpu}.service"
        assert entry["gpus"] == [
            {
                "index": gpu,
                "used_mib": 1000 * (gpu + 1),
                "listed_by_nvml": True,
                "holds_device_file": True,
            }
        ]
        assert doc["gpus"][gpu]["holder_pids"] == [holder.pid]
        started = datetime.fromisoformat(entry["started_at"])
        assert abs((datetime.now(timezone.utc) - started).total_seconds()) < 120
        assert doc["gpus"][gpu]["memory"]["used_mib"] == 1000 * (gpu + 1)
    text = cli("status").out
    assert f"gg-test-{os.getpid()}-3.service" in text
    assert "4000 MiB" in text


def test_holder_on_four_gpus_with_inheriting_children(
    cli: Cli, spawn_holder: HolderSpawner
) -> None:
    """A server on 4 GPUs and its forked workers: all found, workers by their inherited fds."""
    server = spawn_holder(
        cli.state, gpus=(0, 1, 2, 3), mib=2048, children=3, name="sglang::scheduler"
    )
    doc = cli("status", "--json").json()
    by_pid = {h["pid"]: h for h in doc["holders"]}
    assert set(by_pid) >= {server.pid, *server.children}
    assert [u["used_mib"] for u in by_pid[server.pid]["gpus"]] == [2048] * 4
    for child in server.children:
        uses = by_pid[child]["gpus"]
        assert [u["index"] for u in uses] == [0, 1, 2, 3]
        assert all(u["used_mib"] is None and u["holds_device_file"] for u in uses)
        assert by_pid[child]["ppid"] == server.pid
    for gpu in doc["gpus"]:
        assert set(gpu["holder_pids"]) == {server.pid, *server.children}


@HOST_PIDS
def test_unattributed_memory_is_critical(cli: Cli) -> None:
    """Memory that no process explains is reported as unattributed: exit 2."""
    update_gpu(cli.state, 2, unattributed_mib=3000)
    result = cli("status")
    assert result.code == 2
    assert "Unattributed: GPU 2: 3000 MiB" in result.out
    assert cli("status", "--json").json()["gpus"][2]["unattributed_mib"] == 3000


@HOST_PIDS
def test_dead_parent_named_by_nvml_and_left_child(cli: Cli, spawn_holder: HolderSpawner) -> None:
    """A killed server whose worker kept the fds: NVML's PID is vanished, the worker is found."""
    server = spawn_holder(cli.state, gpus=(1,), mib=1500, children=1, leave_child=True)
    server.kill()
    server.wait()
    doc = cli("status", "--json").json()
    assert doc["vanished"] == [{"pid": server.pid, "gpu": 1, "used_mib": 1500}]
    assert doc["exit_code"] == 2
    child = next(h for h in doc["holders"] if h["pid"] == server.children[0])
    assert child["gpus"][0]["index"] == 1
    assert child["gpus"][0]["listed_by_nvml"] is False


def test_lost_gpu_is_critical_and_the_rest_reported(cli: Cli) -> None:
    """One lost GPU: exit 2, marked LOST, the other three still read."""
    update_gpu(cli.state, 1, lost=True)
    result = cli("status")
    assert result.code == 2
    assert "GPU 1" in result.out
    assert "LOST" in result.out
    doc = cli("status", "--json").json()
    assert doc["gpus"][1]["lost"] is True
    assert [g["memory"] is not None for g in doc["gpus"]] == [True, False, True, True]


def test_pending_row_remap_is_critical_and_says_what_to_do(cli: Cli) -> None:
    """A row remap pending on GPU 2: exit 2, NEEDS RESET, the reset command; unknown stays null."""
    update_gpu(cli.state, 2, remapped_rows_pending=1, ecc_volatile_uncorrected=3)
    result = cli("status")
    assert result.code == 2
    assert "GPU 2 needs a GPU reset (a memory row remap is pending)" in result.out
    assert "nvidia-smi -r -i 2" in result.out
    assert any(
        line.startswith("GPU 2 ") and line.endswith("NEEDS RESET")
        for line in result.out.splitlines()
    )
    doc = cli("status", "--json").json()
    health = doc["gpus"][2]["health"]
    assert health["needs_reset"] is True
    assert health["needs_reboot"] is False
    assert health["remapped_rows_pending"] is True
    assert health["volatile_uncorrectable_ecc"] == 3
    assert health["retired_pages_pending"] is None  # an H200 does not retire pages: unknown
    assert health["recovery_action"] == "none"
    assert doc["gpus"][0]["health"]["needs_reset"] is False


def test_unsupported_health_is_unknown_not_healthy(cli: Cli) -> None:
    """A driver that supports none of the health calls: every fact null, no verdict of health."""
    update_gpu(cli.state, 0, remapped_rows_pending=-1, ecc_volatile_uncorrected=-1)
    update_gpu(cli.state, 0, recovery_action=-1)
    doc = cli("status", "--json").json()
    health = doc["gpus"][0]["health"]
    assert [
        health[key]
        for key in (
            "retired_pages_pending",
            "remapped_rows_pending",
            "remapped_rows_failed",
            "volatile_uncorrectable_ecc",
            "recovery_action",
        )
    ] == [None] * 5
    assert doc["exit_code"] == 0


def test_driver_asks_for_reboot_or_answers_reset_required(cli: Cli) -> None:
    """Node reboot asked for GPU 0, RESET_REQUIRED from GPU 3: both critical, advice differs."""
    update_gpu(cli.state, 0, recovery_action=2)
    update_gpu(cli.state, 3, reset_required=True)
    result = cli("status")
    assert result.code == 2
    assert "GPU 0 needs a reboot (the driver asks for a node reboot)" in result.out
    assert any(
        line.startswith("GPU 0 ") and line.endswith("NEEDS REBOOT")
        for line in result.out.splitlines()
    )
    assert "GPU 3 needs a GPU reset (the driver answers 'GPU requires restart')" in result.out
    doc = cli("status", "--json").json()
    assert doc["gpus"][0]["health"]["needs_reboot"] is True
    assert doc["gpus"][3]["health"]["reset_required"] is True


def test_nvml_library_missing_is_unknown(cli: Cli, tmp_path: Path) -> None:
    """With no libnvidia-ml.so.1 where the configuration says: NVML unavailable, exit 3."""
    missing = tmp_path / "no-driver" / "libnvidia-ml.so.1"
    cli.config.write_text(cli.config.read_text().replace(str(cli.library), str(missing)))
    result = _run(cli, cli.env)
    assert result.returncode == 3
    first = result.stdout.splitlines()[0]
    assert first.startswith("gpuguard status: UNKNOWN - NVML unavailable:")


def test_driver_not_loaded_is_unknown(cli: Cli) -> None:
    """NvmlInit failing with DRIVER_NOT_LOADED: exit 3 with the driver's reason."""
    update_state(cli.state, init_error=9)
    result = cli("status")
    assert result.code == 3
    assert "Driver Not Loaded" in result.out.splitlines()[0]


def test_driver_without_v3_symbols_says_too_old(
    cli: Cli,
    nvml_env: Any,
    spawn_holder: HolderSpawner,
) -> None:
    """A driver < 510 lacks the _v3 process calls: "driver too old", holders still found."""
    holder = spawn_holder(cli.state, gpus=(0,), mib=100)
    cli.config.write_text(
        cli.config.read_text().replace(str(cli.library), str(fake_library(old=True)))
    )
    result = _run(cli, nvml_env(cli.state, old=True), "--json")
    doc = __import__("json").loads(result.stdout)
    assert result.returncode == 1
    assert doc["nvml"]["health"] == "driver-too-old"
    assert "driver too old" in doc["nvml"]["reason"]
    assert doc["gpus"][0]["memory"]["api"] == "v1"
    assert [h["pid"] for h in doc["holders"]] == [holder.pid]


def test_blocking_nvml_call_is_abandoned(cli: Cli) -> None:
    """A wedged driver (a call that never returns) gives CRITICAL within the deadline."""
    update_state(cli.state, block_call="nvmlDeviceGetMemoryInfo_v2", block_ms=0)
    cli.configure("nvml_timeout_s = 1.0\n")
    started = time.monotonic()
    result = cli("status")
    assert time.monotonic() - started < 15
    assert result.code == 2
    assert "did not answer within 1 s" in result.out


def test_process_list_race_is_retried(cli: Cli, spawn_holder: HolderSpawner) -> None:
    """A list that grows between NVML's two calls is retried, not reported as an error."""
    holder = spawn_holder(cli.state, gpus=(3,), mib=700)
    update_gpu(cli.state, 3, process_list_race=2)
    doc = cli("status", "--json").json()
    assert doc["exit_code"] == 0
    assert doc["gpus"][3]["holder_pids"] == [holder.pid]
    assert doc["gpus"][3]["problem"] is None


def test_minor_numbers_map_device_files(tmp_path_factory: Any, cli: Cli) -> None:
    """/dev/nvidiaN maps to the GPU whose NVML minor is N, not the one at index N."""
    write_state(cli.state, [FakeGpu(minor=3), FakeGpu(minor=2), FakeGpu(minor=1), FakeGpu(minor=0)])
    sleeper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys,time; f=open(sys.argv[1]); time.sleep(60)",
            str(cli.state / "dev" / "nvidia3"),
        ],
    )
    try:
        time.sleep(0.5)
        doc = cli("status", "--json").json()
        entry = next(h for h in doc["holders"] if h["pid"] == sleeper.pid)
        assert [u["index"] for u in entry["gpus"]] == [0]
    finally:
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()
    del tmp_path_factory


def _run(cli: Cli, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli.command("status", *extra),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def test_prometheus_output_is_the_daemons_metrics_drawn_now(
    cli: Cli, spawn_holder: HolderSpawner
) -> None:
    """`status --prometheus`: every GPU with its memory, parsed by prometheus_client's parser."""
    spawn_holder(cli.state, gpus=(2,), mib=3000)
    result = cli("status", "--prometheus")
    assert result.code == 0, result.err
    found = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(result.out)
        for sample in family.samples
    }
    assert found["gpuguard_gpu_memory_used_bytes", (("gpu", "2"),)] == 3000 * 1024 * 1024
    assert found["gpuguard_gpu_idle", (("gpu", "2"),)] == 0
    assert found["gpuguard_gpu_idle", (("gpu", "0"),)] == 1
    assert found["gpuguard_daemon_up", ()] == 0  # no daemon snapshot here
    assert found["gpuguard_nvml_up", ()] == 1
