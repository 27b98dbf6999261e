"""The operator's `reap` times the release; `status`, `explain` and the metrics agree on it.

A real holder (tests/fakenvml) keeps fake GPU memory that the fake NVML releases
``release_delay_ms`` after the holder is gone, like a driver tearing a context down. `reap`
signals it, waits, prints the release and appends it to the release log; then the three views
read that log and must give the same numbers. `systemctl`/`journalctl` are stand-ins (root).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clirunner import unit_name
from fakestate import update_gpu
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from clirunner import Cli, FakeSystemd
    from fakeholder import HolderSpawner

_RELEASED = re.compile(
    r"^GPU 0: memory released (\d+\.\d{3}) s after the last signal$", re.MULTILINE
)
_STARTED = "39f53479d3a045ac8e11786248231fbf"


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")


def _started_entry(unit: str, monotonic_s: float) -> dict[str, Any]:
    """PID 1's "Started" entry for ``unit`` on this boot at ``monotonic_s``."""
    return {
        "__CURSOR": "s=1",
        "__MONOTONIC_TIMESTAMP": str(int(monotonic_s * 1e6)),
        "__REALTIME_TIMESTAMP": str(int((time.time() - time.monotonic() + monotonic_s) * 1e6)),
        "_BOOT_ID": _boot_id(),
        "_PID": "1",
        "_UID": "0",
        "_SYSTEMD_CGROUP": "/init.scope",
        "_TRANSPORT": "journal",
        "MESSAGE_ID": _STARTED,
        "MESSAGE": f"Started {unit}.",
        "UNIT": unit,
        "INVOCATION_ID": uuid.uuid4().hex,
        "JOB_TYPE": "start",
        "JOB_RESULT": "done",
    }


def _gauges(text: str, name: str) -> dict[str, float]:
    return {
        sample.labels["gpu"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def test_reap_times_the_release_and_status_explain_and_metrics_agree(
    cli: Cli, spawn_holder: HolderSpawner, fake_systemd: FakeSystemd, tmp_path: Path
) -> None:
    """A release 1.2 s after the holder's death: reap prints it, the three views say the same."""
    unit = unit_name()
    cli.configure(f'[units."{unit}"]\n')
    fake_systemd(unit)  # its User= (root): --scope patterns reaps only the unit's uid
    update_gpu(cli.state, 0, release_delay_ms=1200)
    before = time.monotonic()
    holder = spawn_holder(cli.state, gpus=(0,), mib=2000, name="sglang::scheduler_TP0")

    reaped = cli("reap", "--unit", unit, "--scope", "patterns", "--yes", "--grace", "5")
    assert reaped.code == 0, reaped.out + reaped.err
    assert f"pid {holder.pid}: exited (SIGTERM)" in reaped.out
    [shown] = _RELEASED.findall(reaped.out)
    assert 1.2 <= float(shown) < 10, reaped.out
    [logged] = json.loads((cli.config.parent / "run" / "releases.json").read_text())
    assert (logged["by"], logged["unit"], logged["gpu"]) == ("reap", unit, 0)
    assert f"{logged['seconds']:.3f}" == shown

    # status: the unit's GPU 0, last and typical; the same in --json.
    status = cli("status")
    line = next(x for x in status.out.splitlines() if "released reaped memory" in x)
    assert line.startswith(f"    GPU 0 released reaped memory after {shown} s last time (reap, ")
    assert line.endswith(f"typically {shown} s (1 release logged)"), line
    [unit_json] = cli("status", "--json").json()["units"]
    [gpu0] = unit_json["releases"]
    assert (gpu0["gpu"], gpu0["last_by"], gpu0["count"]) == (0, "reap", 1)
    assert f"{gpu0['last_s']:.3f}" == f"{gpu0['typical_s']:.3f}" == shown

    # the metrics: the gauges carry the same numbers.
    scraped = cli("status", "--prometheus").out
    assert _gauges(scraped, "gpuguard_holder_release_last_seconds") == {"0": float(shown)}
    assert _gauges(scraped, "gpuguard_holder_release_typical_seconds") == {"0": float(shown)}

    # explain: the release on the unit's timeline, after the start the journal holds.
    journal = tmp_path / "journal.jsonl"
    journal.write_text(json.dumps(_started_entry(unit, before)) + "\n")
    stand_in = tmp_path / "journalctl"
    stand_in.write_text(f"#!/bin/sh\ncat {journal}\n")
    stand_in.chmod(0o755)
    cli.doubles["journalctl"] = stand_in
    doc = cli("explain", "--unit", unit, "--json").json()
    kinds = [row["kind"] for row in doc["rows"]]
    assert kinds == ["started", "gpu-released"], doc["rows"]
    released = doc["rows"][1]
    assert f"reaped by reap released {shown} s after the last signal" in released["text"]
    assert released["monotonic_s"] > before
    assert doc["story"]["released"] == [line.strip()]
    assert not doc["gpuguard_seen"]  # the log is no line of the journal
    text = cli("explain", "--unit", unit).out
    assert "GPU memory released after a reap: 1" in text
    assert line.strip() in text
