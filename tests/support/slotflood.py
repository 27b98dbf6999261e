"""Clients that hammer the gate socket: connect, ask, read the answer, close, and again.

Shared by tests/integration/test_gate_socket.py and bench/slot_flood.py. One ``Hammer`` is one
process of one user in one cgroup, keeping ``count`` requests in flight at once (a thread
each, blocking sockets: the flood costs the server, not the hammer's own CPU). Each request
asks the longest gate the protocol allows (``--timeout 3600``), as the issue's flood did.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

# argv: path uid count unit. Prints "ready" once every thread has had one answer, then keeps
# going until a line arrives on stdin; then prints its tally as JSON and exits.
SCRIPT = r"""
import json, os, socket, sys, threading
path, uid, count, unit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.setgroups([]); os.setgid(uid); os.setuid(uid)
line = json.dumps({"v": 1, "command": "gate", "unit": unit, "timeout": 3600}).encode() + b"\n"
stop = threading.Event()
lock = threading.Lock()
tally = {"answers": 0, "busy": 0, "refused": 0, "errors": 0, "first": ""}
answered = threading.Semaphore(0)

def hammer():
    first = True
    while not stop.is_set():
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(30)
                conn.connect(path)
                conn.sendall(line)
                data = b""
                while chunk := conn.recv(65536):
                    data += chunk
        except OSError:
            with lock:
                tally["errors"] += 1
            continue
        with lock:
            tally["answers"] += 1
            tally["busy"] += b"is busy" in data
            tally["refused"] += b"refused" in data
            tally["first"] = tally["first"] or data.decode(errors="replace").splitlines()[0]
        if first:
            first = False
            answered.release()

threads = [threading.Thread(target=hammer, daemon=True) for _ in range(count)]
for thread in threads:
    thread.start()
for _ in threads:
    answered.acquire()
print("ready", flush=True)
sys.stdin.readline()
stop.set()
for thread in threads:
    thread.join(60)
with lock:
    print(json.dumps(tally), flush=True)
"""


@dataclass
class Hammer:
    """One user's process hammering the socket from one cgroup."""

    process: subprocess.Popen[str]

    def stop(self) -> dict[str, int | str]:
        """End the flood; what its requests were told: answers, busy, refused, errors, first."""
        out, _ = self.process.communicate("stop\n", timeout=120)
        tally: dict[str, int | str] = json.loads(out.splitlines()[-1])
        return tally

    def kill(self) -> None:
        """End it now (cleanup after a failure)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.communicate()


def hammer(path: Path, cgroup: Path, uid: int, count: int, unit: str) -> Hammer:
    """Start ``count`` requests in flight for ``unit`` as ``uid`` from ``cgroup``; once answered."""
    script = shlex.join([sys.executable, "-c", SCRIPT, str(path), str(uid), str(count), unit])
    process = subprocess.Popen(
        ["sh", "-c", f"echo $$ > {shlex.quote(str(cgroup / 'cgroup.procs'))} && exec {script}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    if process.stdout.readline() != "ready\n":
        process.kill()
        process.communicate()
        raise RuntimeError("the hammer did not start (its requests were never answered)")
    return Hammer(process)
