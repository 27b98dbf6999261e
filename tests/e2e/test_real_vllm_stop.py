"""An operator stops the real vLLM with requests in flight, then starts it: no failed start.

vllm.service (real_engine.py) as the package ships it beside: the gate drop-in verbatim and the
daemon, watching it (`server = "vllm"`). The operator's drop-in gives vLLM a real drain,
`--shutdown-timeout 60`, longer than its `TimeoutStopSec=2`: vLLM waits for the requests in
flight, systemd cuts the drain at 2 s if it is not done (SIGKILL; the gate's `KillMode=mixed`
takes the engine too). A client inside the container keeps completions of 240 tokens in flight
(back to back, 4 at a time; about 4.6 s each here) while `systemctl stop` runs; whether the
drain was cut is recorded, not asserted (a faster machine drains in time);
then `systemctl start`. Failed starts are PID 1's "Main process exited, code=exited" lines with
a non-zero status after the start; healthy is the new run's "Application startup complete.".
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from e2e.gpubox import GATE_DROPIN
from e2e.measure import SESSION_NOTES
from e2e.real_engine import (
    READY,
    REQUESTED_MIB,
    START_TIMEOUT_S,
    UNIT,
    VLLM_CONFIG,
    read_the_tools,
    unit_entries,
    vllm_pids,
    wait_unit_line,
)

if TYPE_CHECKING:
    from e2e.container import Container
    from e2e.gpubox import GpuBox

pytestmark = pytest.mark.slow

EXEC = (
    "/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server --model /opt/tiny-llama "
    "--served-model-name tiny --max-model-len 256 --dtype float32 --enforce-eager "
    "--host 127.0.0.1 --port 8000 --gpu-memory-utilization 0.9 --shutdown-timeout 60"
)
OPERATOR = f"[Service]\nExecStart=\nExecStart={EXEC}\nTimeoutStopSec=2\n"
#: Completions back to back, 4 at a time, until the server refuses; each says when it ended.
CLIENT = """
import json, sys, threading, time, urllib.request
body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 240,
                   "ignore_eos": True}).encode()
def one():
    while True:
        request = urllib.request.Request("http://127.0.0.1:8000/v1/completions", body,
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as answer:
                tokens = json.load(answer)["usage"]["completion_tokens"]
            print(f"done {time.time():.3f} {tokens}", flush=True)
        except Exception as exc:
            print(f"refused {time.time():.3f} {type(exc).__name__}", flush=True)
            return
threads = [threading.Thread(target=one) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
"""


def _pid1(box: Container, t0: float, text: str) -> list[tuple[float, str]]:
    """PID 1's lines about the unit after `t0` that contain `text`, with their time."""
    entries = box.journal(["_PID=1", f"UNIT={UNIT}", f"--since=@{int(t0)}"])
    return [
        (int(str(e["__REALTIME_TIMESTAMP"])) / 1e6, str(e.get("MESSAGE")))
        for e in entries
        if int(str(e["__REALTIME_TIMESTAMP"])) / 1e6 >= t0 and text in str(e.get("MESSAGE"))
    ]


def test_real_vllm_stop_with_requests_in_flight_then_start(vllm_box: GpuBox) -> None:
    """A drain cut by TimeoutStopSec= (or done), then a start: 0 failed starts, serving again."""
    box = vllm_box.box
    box.write_file("/etc/gpuguard/gpuguard.toml", VLLM_CONFIG)
    box.write_file(f"/etc/systemd/system/{UNIT}.d/gpuguard-gate.conf", GATE_DROPIN.read_text())
    vllm_box.drop_in(UNIT, "zz-operator.conf", OPERATOR)
    vllm_box.start_daemon()
    began = time.time()
    vllm_box.systemctl("start", UNIT)
    _, serving = wait_unit_line(box, READY, after_s=began, timeout=START_TIMEOUT_S)
    box.write_file("/root/client.py", CLIENT)
    box.run(["sh", "-c", "nohup python3 /root/client.py >/root/client.log 2>&1 &"])
    box.wait_for(
        "a first completion",
        lambda: "done " in box.run(["cat", "/root/client.log"], check=False).stdout,
        timeout=120,
    )
    t0 = time.time()
    vllm_box.systemctl("stop", UNIT)
    stopped = time.time()
    timed_out = _pid1(box, t0, "timed out")
    survivors = {name: pids for name, pids in vllm_pids(box).items() if pids}
    log = box.run(["cat", "/root/client.log"], check=False).stdout.split("\n")
    finished = [line for line in log if line.startswith("done ") and float(line.split()[1]) >= t0]
    t1 = time.time()
    vllm_box.systemctl("start", UNIT)
    ready_at, invocation = wait_unit_line(box, READY, after_s=t1, timeout=START_TIMEOUT_S)
    failed = [
        line
        for _, line in _pid1(box, t1, "Main process exited")
        if "code=exited" in line and "status=0/" not in line
    ]
    readings = read_the_tools(vllm_box, "operator stop")
    story = readings.explain_doc["story"]
    SESSION_NOTES.append(
        f"real vLLM operator stop with requests in flight (--shutdown-timeout 60, "
        f"TimeoutStopSec=2), the gate and the daemon: stop took {stopped - t0:.1f} s "
        f"({'cut by systemd' if timed_out else 'drained'}), {len(finished)} completions ended "
        f"during it, survivors after it {survivors or 'none'}; the next start: {len(failed)} "
        f"failed, healthy {ready_at - t1:.1f} s after it"
    )
    assert invocation != serving
    assert failed == [], (failed, readings.explain)
    assert unit_entries(box, after_s=t1)  # the new run said something of its own
    assert vllm_box.allocated() == [REQUESTED_MIB, 0, 0, 0]
    assert readings.status_rc == 0, readings.status
    assert "restart loop" not in story["verdict"], readings.explain
    assert any(line.startswith(f"run {serving[:8]}") for line in story["operator"]), story
    assert story["failed_starts"] == [], readings.explain
