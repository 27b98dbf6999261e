"""The container-engine adapter: docker's Engine API (podman's compatible one) on root's socket.

Two calls only: ``GET /containers/NAME/json`` and ``POST /containers/ID/stop?t=GRACE``. A small
HTTP/1.1 client on stdlib ``http.client`` rather than the ``docker`` SDK: the SDK brings
``requests`` and ``urllib3`` into the package's own environment (and into the gate's import
time) for two requests, and would take the socket path as a URL, without the checks below.

Whoever answers on the socket decides what root stops, so the socket must be root's: every
directory above it is checked as adapters/files checks them, the socket itself must be owned
by root (or us), it is connected through the checked directory's descriptor (nothing can be
swapped in between), and the process listening must run as root (or us; ``SO_PEERCRED``).
Answers are bounded in size and time; their JSON is parsed by the pure core.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import stat
import struct
from pathlib import Path
from typing import Final
from urllib.parse import quote

from gpuguard.adapters import files
from gpuguard.core.unitcontainers import NAME, Engine

SOCKETS: Final = {
    Engine.DOCKER: Path("/run/docker.sock"),
    Engine.PODMAN: Path("/run/podman/podman.sock"),
}
"""Root's engine sockets (podman's is its ``podman.socket`` unit's compatible API)."""
MAX_ANSWER: Final = 1024 * 1024  # an inspect answer is a few KiB; a larger one is refused
_TIMEOUT_S: Final = 10.0
_STOP_MARGIN_S: Final = 30.0  # the engine's own SIGKILL and wait after the grace
_UCRED = struct.Struct("3i")


class EngineError(Exception):
    """The engine could not be asked or did not answer as documented; the message says why."""


class EngineClient:
    """One engine behind one socket; every call opens a fresh, checked connection."""

    def __init__(self, engine: Engine, path: Path | None = None) -> None:
        """Talk to ``engine`` at ``path`` (its root socket in SOCKETS when None)."""
        self.engine = engine
        self.path = SOCKETS[engine] if path is None else path

    def inspect(self, name: str) -> object:
        """The decoded ``container inspect`` answer for ``name``; None when there is none."""
        if not NAME.fullmatch(name):
            raise EngineError(f"{name!r} is not a container name")
        status, body = self._request("GET", f"/containers/{quote(name)}/json", _TIMEOUT_S)
        if status == http.HTTPStatus.NOT_FOUND:
            return None
        if status != http.HTTPStatus.OK:
            raise EngineError(f"{self.engine} inspect {name}: HTTP {status}")
        try:
            return json.loads(body)
        except (ValueError, RecursionError):
            raise EngineError(f"{self.engine} inspect {name}: not JSON") from None

    def stop(self, container_id: str, grace_s: float) -> str:
        """Stop a container: its stop signal, ``grace_s``, then SIGKILL, by the engine itself.

        Returns what happened ("stopped", "already stopped", "gone"); blocks until the engine
        says so, at most the grace plus a margin.
        """
        if not NAME.fullmatch(container_id):
            raise EngineError(f"{container_id!r} is not a container id")
        grace = math.ceil(grace_s)
        status, _ = self._request(
            "POST", f"/containers/{container_id}/stop?t={grace}", grace + _STOP_MARGIN_S
        )
        outcomes = {
            http.HTTPStatus.NO_CONTENT: "stopped",
            http.HTTPStatus.NOT_MODIFIED: "already stopped",
            http.HTTPStatus.NOT_FOUND: "gone",
        }
        if status not in outcomes:
            raise EngineError(f"{self.engine} stop {container_id[:12]}: HTTP {status}")
        return outcomes[http.HTTPStatus(status)]

    def _request(self, method: str, target: str, timeout_s: float) -> tuple[int, bytes]:
        connection = _Connection(self._connect(timeout_s))
        try:
            connection.request(method, target, headers={"Host": "engine"})
            response = connection.getresponse()
            body = response.read(MAX_ANSWER + 1)
        except (OSError, http.client.HTTPException) as err:
            raise EngineError(f"{self.engine} at {self.path}: {err}") from None
        finally:
            connection.close()
        if len(body) > MAX_ANSWER:
            raise EngineError(f"{self.engine} at {self.path}: answer over {MAX_ANSWER} bytes")
        return response.status, body

    def _connect(self, timeout_s: float) -> socket.socket:
        """A connection to the checked socket whose listener runs as root (or us)."""
        try:
            directory = files.open_directory(self.path.parent)
        except OSError as err:
            raise EngineError(f"{self.engine}: {self.path.parent}: {err}") from None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            problem = _socket_problem(
                os.stat(self.path.name, dir_fd=directory, follow_symlinks=False)
            )
            if problem is None:
                sock.settimeout(timeout_s)
                sock.connect(f"/proc/self/fd/{directory}/{self.path.name}")
                _pid, uid, _gid = _UCRED.unpack(
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
                )
                problem = None if uid in {0, os.geteuid()} else f"its listener runs as uid {uid}"
        except OSError as err:
            problem = err.strerror or str(err)
        finally:
            os.close(directory)
        if problem is not None:
            sock.close()
            raise EngineError(f"{self.engine}: {self.path}: {problem}")
        return sock


def _socket_problem(info: os.stat_result) -> str | None:
    """Why a file is not an engine socket root may talk to (a socket of root's or ours)."""
    if not stat.S_ISSOCK(info.st_mode):
        return "not a socket"
    if info.st_uid not in {0, os.geteuid()}:
        return f"owned by uid {info.st_uid}, not root"
    return None


class _Connection(http.client.HTTPConnection):
    """HTTP/1.1 over an already connected unix socket."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__("engine")
        self.sock = sock

    def connect(self) -> None:
        """Never reconnects: a closed connection is an error for the caller."""
        raise OSError("the engine closed the connection")
