"""The unprivileged side of the gate: send one request to the gate server, relay its answer.

Runs as the watched unit's ``ExecStartPre=``/``ExecStopPost=`` (no ``+``), before every start,
in the unit's environment and with its user's rights. So it does nothing but talk: no NVML, no
/proc, no configuration (except to learn ``gate_unreachable`` when the server cannot be
reached), and it imports only the standard library's socket support and the wire format.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from gpuguard.core.gate.proto import MAX_FRAME_BYTES, encode_request, parse_frame

if TYPE_CHECKING:
    from typing import TextIO

    from gpuguard.core.gate.proto import Request

CONNECT_TIMEOUT_S = 10.0
#: C0 controls, DEL and C1 controls as visible escapes: relayed text never forges journal lines.
_CONTROLS = {code: f"\\x{code:02x}" for code in (*range(32), *range(127, 160))}


class UnreachableError(Exception):
    """No connection to the gate server; the message says why (one short phrase)."""


def ask(request: Request, path: str, out: TextIO, err: TextIO) -> int:
    """Send ``request``, copy the server's lines to ``out``/``err``, return its exit status.

    Raises UnreachableError when no connection can be made. A connection that ends without a
    verdict, or a line that is not the protocol's, ends with one line on ``err`` and 1.
    """
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        conn.settimeout(CONNECT_TIMEOUT_S)
        try:
            conn.connect(path)
        except OSError as error:
            raise UnreachableError(error.strerror or str(error)) from None
        conn.settimeout(None)  # the gate may wait gate_timeout_s; TimeoutStartSec= bounds us
        try:
            conn.sendall(encode_request(request))
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # hung up on before the request (a busy server): what it said is still to read
        return _relay(conn, out, err)
    finally:
        conn.close()


def _relay(conn: socket.socket, out: TextIO, err: TextIO) -> int:
    streams = {1: out, 2: err}
    with conn.makefile("rb") as reader:
        while True:
            try:
                line = reader.readline(MAX_FRAME_BYTES + 1)
            except OSError as error:
                err.write(f"gpuguard: lost the gate server ({error.strerror or error})\n")
                return 1
            if not line:
                err.write("gpuguard: the gate server ended without a verdict\n")
                return 1
            frame = parse_frame(line)
            if frame is None:
                err.write("gpuguard: the gate server sent a line that is not its protocol\n")
                return 1
            if frame.exit is not None:
                out.flush()
                err.flush()
                return frame.exit
            stream = streams[frame.fd]
            stream.write(frame.text.translate(_CONTROLS) + "\n")
            stream.flush()
