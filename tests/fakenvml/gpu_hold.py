#!/usr/bin/env python3
"""Hold fake GPU memory the way a CUDA process does, for the fake libnvidia-ml.so.1.

Opens ``STATE/dev/nvidiactl``, ``STATE/dev/nvidia-uvm`` and ``STATE/dev/nvidia<minor>`` per GPU
(kept open and inherited by children), registers one allocation file per GPU in
``STATE/allocs/``, and starts a detached watcher that marks the allocations released once every
process holding the "context" is gone, like the driver tearing down its client when the last fd
closes. When ready it prints one JSON line to stdout and closes stdout. Standard library only;
see README.md for the options and the state format.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path

_PR_SET_NAME = 15  # prctl(2): set the calling thread's comm (15 bytes + NUL)
_COMM_LEN = 15
_TICK_S = 0.05
_STOP_WAIT_S = 5.0  # how long the parent waits for the children it terminated


def _parse_gpus(text: str) -> list[int]:
    try:
        minors = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of minors: {text!r}"
        ) from None
    if not minors or any(minor < 0 for minor in minors) or len(set(minors)) != len(minors):
        raise argparse.ArgumentTypeError(f"need distinct non-negative minors: {text!r}")
    return minors


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Hold fake GPU memory like a CUDA process (for the fake libnvidia-ml.so.1)."
    )
    parser.add_argument("--state", required=True, type=Path, help="the FAKENVML_STATE directory")
    parser.add_argument("--gpus", default=[0], type=_parse_gpus, help="GPU minors, e.g. 0,1")
    parser.add_argument("--mib", default=1000, type=_non_negative_int, help="MiB held per GPU")
    parser.add_argument("--kind", default="compute", choices=["compute", "graphics", "mps"])
    parser.add_argument("--name", help="look like NAME in /proc/PID/cmdline and comm")
    parser.add_argument("--children", default=0, type=_non_negative_int, help="children to fork")
    parser.add_argument("--child-name", help="children's name, {i} = child index")
    parser.add_argument(
        "--leave-child", action="store_true", help="on SIGTERM leave the last child running"
    )
    parser.add_argument(
        "--child-invocation",
        help="the children's own INVOCATION_ID (as `systemd-run --scope` gives a moved worker)",
    )
    parser.add_argument(
        "--ignore-sigterm", action="store_true", help="ignore SIGTERM (children too)"
    )
    parser.add_argument(
        "--drain", default=0.0, type=_non_negative_float, help="seconds to wait after SIGTERM"
    )
    parser.add_argument(
        "--no-usage", action="store_true", help="NVML reports usedGpuMemory as not available"
    )
    # Internal: how the parent re-executes itself and its children.
    parser.add_argument("--renamed", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--as-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    return parser


def _set_comm(name: str) -> None:
    """Set /proc/self/comm (what ps and psutil show as the name) via prctl(PR_SET_NAME)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:_COMM_LEN]), 0, 0, 0)


def _exec_as(name: str, args: list[str], invocation: str | None = None) -> None:
    """Replace this process with this script whose argv[0] (cmdline) is ``name``.

    ``invocation``: its INVOCATION_ID, instead of the one it inherits.
    """
    env = dict(os.environ)
    if invocation is not None:
        env["INVOCATION_ID"] = invocation
    # With an argv[0] that is not on PATH the interpreter cannot find itself; point it home.
    if sys.base_prefix == sys.base_exec_prefix:
        env.setdefault("PYTHONHOME", sys.base_prefix)
    else:
        env.setdefault("PYTHONHOME", f"{sys.base_prefix}:{sys.base_exec_prefix}")
    script = str(Path(__file__).resolve())
    os.execve("/proc/self/exe", [name, script, *args], env)  # noqa: S606 - re-exec of this script


def _keep_across_exec(fd: int) -> None:
    """Python opens fds close-on-exec (PEP 446); a CUDA process's fds are inherited."""
    os.set_inheritable(fd, True)  # noqa: FBT003 - the flag is positional-only in os


def _redirect_to_devnull(*fds: int) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:
        os.dup2(null, fd)
    if null not in fds:
        os.close(null)


# --------------------------------------------------------------------------------------------
# The watcher: releases the allocations when the context pipe reaches EOF.
# --------------------------------------------------------------------------------------------


def _watch(read_fd: int, allocs: list[Path]) -> None:
    """Run in the detached grandchild: wait for EOF, then append released_at_ms and exit."""
    try:
        os.closerange(0, read_fd)
        os.closerange(read_fd + 1, os.sysconf("SC_OPEN_MAX"))
        _redirect_to_devnull(0, 1, 2)
        os.chdir("/")
        _set_comm("gpu_hold_watch")
        while os.read(read_fd, 4096):
            pass
        # Rounded up: the release delay then counts from no earlier than the last close.
        line = f"released_at_ms={-(-time.time_ns() // 1_000_000)}\n".encode()
        for path in allocs:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_APPEND)  # never create: it may be gone
            except OSError:
                continue
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
    finally:
        os._exit(0)


def _start_watcher(read_fd: int, allocs: list[Path]) -> int:
    """Double fork + setsid so the watcher belongs to nobody; returns its PID."""
    info_r, info_w = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(info_r)
            os.setsid()
            watcher = os.fork()
            if watcher == 0:
                _watch(read_fd, allocs)
            os.write(info_w, str(watcher).encode())
        finally:
            os._exit(0)
    os.close(info_w)
    os.waitpid(middle, 0)
    with os.fdopen(info_r, "rb") as info:
        return int(info.read())


# --------------------------------------------------------------------------------------------
# Allocation files
# --------------------------------------------------------------------------------------------


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="ascii")
    tmp.replace(path)


def _nvml_pid(state: Path) -> int:
    """The PID the driver knows us by: the host's, like NVIDIA's driver (no PID namespaces).

    ``STATE/host-proc``, where present, is the host's procfs seen from inside a PID namespace
    (bound in by the test harness): its ``self`` names us by our host PID.
    """
    host_proc = state / "host-proc"
    if host_proc.is_dir():
        return int((host_proc / "self").readlink().name)
    return os.getpid()


def _alloc_text(pid: int, minor: int, args: argparse.Namespace) -> str:
    lines = [f"pid={pid}", f"minor={minor}", f"mib={args.mib}", f"kind={args.kind}"]
    if args.no_usage:
        lines.append("report_usage=0")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Parent and children
# --------------------------------------------------------------------------------------------


def _child_argv(args: argparse.Namespace, index: int, ready_fd: int) -> list[str]:
    argv = ["--state", str(args.state), "--as-child", str(index), "--ready-fd", str(ready_fd)]
    if args.ignore_sigterm:
        argv.append("--ignore-sigterm")
    return argv


def _child_name(args: argparse.Namespace, index: int) -> str:
    template = args.child_name or f"{args.name or 'gpu_hold'}_TP{{i}}"
    return str(template).replace("{i}", str(index))


def _fork_children(args: argparse.Namespace) -> list[int]:
    """Fork the children; return once each has named itself (it closes its end of a pipe)."""
    ready_r, ready_w = os.pipe()
    _keep_across_exec(ready_w)
    children: list[int] = []
    for index in range(args.children):
        pid = os.fork()
        if pid == 0:
            try:
                os.close(ready_r)
                _redirect_to_devnull(0, 1)
                _exec_as(
                    _child_name(args, index),
                    _child_argv(args, index, ready_w),
                    args.child_invocation,
                )
            finally:
                os._exit(127)
        children.append(pid)
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as ready:
        ready.read()  # EOF once every child has exec'ed and closed its copy
    return children


def _run_child(args: argparse.Namespace) -> None:
    """A child: hold the inherited fds and context and sleep until killed."""
    _set_comm(_current_argv0())
    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_sigterm else signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN if args.ignore_sigterm else signal.SIG_DFL)
    if args.ready_fd is not None:
        os.close(args.ready_fd)
    while True:
        signal.pause()


def _current_argv0() -> str:
    """argv[0] as the kernel shows it (our re-exec put the process name there)."""
    return Path("/proc/self/cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")


class _Stop:
    """Set by the SIGTERM handler; the main loop acts on it."""

    requested = False


def _on_sigterm(_signum: int, _frame: object) -> None:
    _Stop.requested = True


def _reap(pids: set[int]) -> None:
    """Collect children that have exited (so none stays a zombie under us)."""
    for pid in list(pids):
        with contextlib.suppress(ChildProcessError):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done == 0:
                continue
        pids.discard(pid)


def _stop(args: argparse.Namespace, children: list[int], running: set[int]) -> None:
    """SIGTERM path: drain, terminate the children (but one with --leave-child), exit."""
    deadline = time.monotonic() + args.drain
    while time.monotonic() < deadline:
        time.sleep(min(_TICK_S, max(0.0, deadline - time.monotonic())))
    _reap(running)
    # Only children not yet reaped: a reaped PID may already belong to someone else.
    to_stop = [pid for pid in (children[:-1] if args.leave_child else children) if pid in running]
    for pid in to_stop:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    waiting = set(to_stop)
    deadline = time.monotonic() + _STOP_WAIT_S
    while waiting and time.monotonic() < deadline:
        _reap(waiting)
        time.sleep(_TICK_S / 5)
    sys.exit(0)


def _open_devices(state: Path, minors: list[int]) -> list[int]:
    names = ["nvidiactl", "nvidia-uvm", *(f"nvidia{minor}" for minor in minors)]
    fds = []
    for name in names:
        fd = os.open(state / "dev" / name, os.O_RDWR)  # no O_CREAT: the GPU must exist
        _keep_across_exec(fd)
        fds.append(fd)
    return fds


def _run_parent(args: argparse.Namespace) -> None:
    if args.name:
        _set_comm(args.name)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, _on_sigterm)
        signal.signal(signal.SIGINT, _on_sigterm)
    state: Path = args.state.resolve()
    try:
        _open_devices(state, args.gpus)
    except OSError as err:
        sys.stderr.write(f"gpu_hold: cannot open a device file: {err}\n")
        sys.exit(1)
    context_r, context_w = os.pipe()
    _keep_across_exec(context_w)
    pid = os.getpid()
    token = secrets.token_hex(4)
    allocs = [state / "allocs" / f"{pid}-gpu{minor}-{token}.alloc" for minor in args.gpus]
    watcher = _start_watcher(context_r, allocs)
    os.close(context_r)
    for minor, path in zip(args.gpus, allocs, strict=True):
        _write_atomically(path, _alloc_text(_nvml_pid(state), minor, args))
    children = _fork_children(args)
    report = {
        "pid": pid,
        "children": children,
        "allocs": [str(path) for path in allocs],
        "watcher": watcher,
    }
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()
    _redirect_to_devnull(sys.stdout.fileno())  # a reader of our stdout pipe now sees EOF
    running = set(children)
    while True:
        if _Stop.requested:
            _stop(args, children, running)
        _reap(running)
        time.sleep(_TICK_S)


def main(argv: list[str] | None = None) -> None:
    """Entry point: parse the options, rename if asked, then run as parent or child."""
    parser = _parser()
    raw = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(raw)
    if args.leave_child and args.children < 1:
        parser.error("--leave-child needs --children >= 1")
    if args.as_child is not None:
        _run_child(args)
        return
    if args.name and not args.renamed:
        _exec_as(args.name, [*raw, "--renamed"])
    _run_parent(args)


if __name__ == "__main__":
    main()
