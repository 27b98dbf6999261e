#!/usr/bin/env python3
"""A fake SGLang server for gpuguard's end-to-end tests: the real one where it matters.

What it shares with ``python -m sglang.launch_server --tp-size N`` (README.md beside it):

* Options: ``--model-path`` (required), ``--tp-size``/``--tp``, ``--mem-fraction-static``,
  ``--port``, ``--host``; anything else is a usage error, exit 2, like argparse in SGLang.
* Start: it "loads the model" (``--fake-load-s`` seconds: the ~100 s of a real start, short in
  tests), then checks the GPUs through the **real pynvml** (here over the fake
  ``libnvidia-ml.so.1``) before allocating, the way PyTorch and SGLang do. When another process
  holds the memory it needs, it prints SGLang's errors - ``torch.OutOfMemoryError: CUDA out of
  memory. Tried to allocate …`` from the rank that cannot allocate, ``RuntimeError: The memory
  capacity is unbalanced. Some GPUs may be occupied by other processes.`` from the others - and
  exits 1.
* Otherwise the main process creates a small context on each GPU and spawns one TP worker per
  GPU, named ``sglang::scheduler_TP0`` … (cmdline and comm, as setproctitle makes them), each
  holding ``mem-fraction-static`` of its GPU and the ``/dev/nvidia*`` stand-ins open; then it
  prints ``The server is fired up and ready to roll!``.
* Start phases as SGLang logs them: ``Load weight begin`` / ``Load weight end``, ``Capture cuda
  graph begin`` / ``end`` (``--fake-graph-s`` seconds between them), then ready.
* Engine death (``--fake-engine-death-s N``): N seconds after ready, the TP0 scheduler "hits an
  exception" (``Scheduler hit an exception: …``) and dies, while the main process keeps running
  and serving nothing, as SGLang's HTTP server outlives its scheduler; with
  ``--fake-exit-0-after-death`` the main process then shuts down and exits 0, as vLLM's did in
  its issue #48966. ``--fake-death-marker PATH`` makes the death happen once (PATH is created).
  ``--fake-silent-death``: the scheduler dies without a line (only ``[fake] engine died
  silently``, which no server prints and gpuguard does not read), as an engine killed from
  outside or wedged would.
* HTTP ``GET /health`` on ``--host``:``--port``, as SGLang's (``http_server.py``): 503 while
  starting, 200 once ready, 503 once the engine died; any other path is 404.
* SIGTERM: it drains pending requests for ``--fake-drain-s`` seconds (SGLang's drain has no upper
  bound), then terminates its workers and exits 0. ``--fake-stubborn-worker I`` (or
  ``FAKE_SGLANG_STUBBORN_WORKER=I`` in the unit's environment) makes worker I ignore SIGTERM,
  like a worker stuck in a collective.
* ``--fake-exit-137-after-drain`` (or ``FAKE_SGLANG_EXIT_137=1``): the drain ends as SGLang's
  does (``python/sglang/srt/managers/tokenizer_manager.py``, ``sigterm_watchdog``): once no
  request is left, ``kill_process_tree(os.getpid(), include_parent=True)``: SIGKILL to the
  workers, then to the main process itself, which dies of it (status=9/KILL, exit 137): a clean
  stop that systemd reports as "Failed with result 'signal'".
* ``--fake-orphan-workers`` (or ``FAKE_SGLANG_ORPHAN_WORKERS=1``): each TP worker is started
  through a launcher that exits at once, so the worker is reparented (to PID 1, or the nearest
  subreaper) while it runs: SGLang's schedulers away from the launcher (sgl-project/sglang
  issue 23627, pull request 31645). The server signals them by PID.
* ``--fake-watchdog-s N`` (or ``FAKE_SGLANG_WATCHDOG_S``): N seconds after ready the TP0
  scheduler hangs and its watchdog fires (``python/sglang/srt/utils/watchdog.py``): it logs
  ``Scheduler watchdog timeout (self.watchdog_timeout=300, self.soft=False)`` and sends SIGQUIT
  to the server, whose running-phase handler (``tokenizer_manager.py``,
  ``SignalHandler.running_phase_sigquit_handler``) logs ``SIGQUIT received. signum=3, frame=….
  It usually means one child failed.`` and kills the tree, itself included (exit 137).
* ``--fake-scope-workers`` (or ``FAKE_SGLANG_SCOPE_WORKERS=1``): each TP worker is started
  through ``systemd-run --scope --unit=tp-worker-<rank>-<id>``, so it lives in its own transient
  scope with that scope's ``INVOCATION_ID`` (not the unit's) while the server runs: the shape of
  workers that left the unit's cgroup (gpuguard issue 22). A stop that ends in SIGKILL then
  leaves every worker alive, holding its GPU.

GPU memory is allocated through the fake driver (``fakegpu_driver.py``): each process's socket to
it is its CUDA context, freed when the process is gone. Device files and allocations live in
``$FAKENVML_STATE`` (``--fake-state``). Standard library plus pynvml.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

MIB = 1 << 20
GIB = 1 << 30
READY_LINE = "The server is fired up and ready to roll!"
_PR_SET_NAME = 15
_WORKER_FLAG = "--fake-worker"
_EXEC_AS = "--fake-exec-as"
_WORKER_STOP_S = 5.0
_ORPHAN_FLAG = "--fake-orphan-launch"
_WATCHDOG_TIMEOUT_S = 300  # SGLang's default --watchdog-timeout, as its line prints it
_UNBALANCED = 0.9  # SGLang: min free memory of all ranks below 90 % of a rank's own is refused


def _stamp(rank: int | None = None) -> str:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    return f"[{now} TP{rank}]" if rank is not None else f"[{now}]"


def log(text: str, rank: int | None = None, *, err: bool = False) -> None:
    """One SGLang-style log line (stdout, or stderr for errors), flushed for the journal."""
    stream = sys.stderr if err else sys.stdout
    stream.write(f"{_stamp(rank)} {text}\n")
    stream.flush()


def _set_comm(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def _open_devices(state: Path, minors: list[int]) -> list[int]:
    """Open the device stand-ins a CUDA process keeps open (inheritable, like CUDA's)."""
    fds = []
    for name in ("nvidiactl", "nvidia-uvm", *(f"nvidia{minor}" for minor in minors)):
        fd = os.open(state / "dev" / name, os.O_RDWR)
        os.set_inheritable(fd, True)  # noqa: FBT003 - positional-only in os
        fds.append(fd)
    return fds


def _create_context(driver: Path, allocations: list[tuple[int, int]]) -> socket.socket:
    """Connect to the fake driver and allocate ``(minor, mib)`` pairs; the socket is the context."""
    ctx = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ctx.connect(str(driver))
    reader = ctx.makefile("r", encoding="utf-8")
    for minor, mib in allocations:
        ctx.sendall(f"alloc {minor} {mib}\n".encode())
        reply = reader.readline().strip()
        if not reply.startswith("ok "):
            raise RuntimeError(f"fake driver refused {mib} MiB on GPU {minor}: {reply}")
    return ctx


# --- the TP worker ---------------------------------------------------------------------------


def worker_main(argv: list[str]) -> None:
    """A TP worker: hold its GPU's memory and the device files until terminated."""
    parser = argparse.ArgumentParser(prog="sglang::scheduler")
    parser.add_argument(_WORKER_FLAG, dest="rank", type=int, required=True)
    parser.add_argument("--fake-gpu", type=int, required=True)
    parser.add_argument("--fake-mib", type=int, required=True)
    parser.add_argument("--fake-ready-fd", type=int, required=True)
    parser.add_argument("--fake-state", type=Path, required=True)
    parser.add_argument("--fake-driver", type=Path, required=True)
    parser.add_argument("--fake-ignore-sigterm", action="store_true")
    parser.add_argument("--fake-server-pid", type=int, required=True)
    parser.add_argument("--fake-watchdog-s", type=float, default=-1.0)
    args = parser.parse_args(argv)
    _set_comm(f"sglang::scheduler_TP{args.rank}")
    if args.fake_ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _open_devices(args.fake_state, [args.fake_gpu])
    context = _create_context(args.fake_driver, [(args.fake_gpu, args.fake_mib)])
    log(
        f"KV Cache is allocated. GPU {args.fake_gpu}: {args.fake_mib / 1024:.2f} GB in use",
        args.rank,
    )
    os.write(args.fake_ready_fd, b"ok")
    os.close(args.fake_ready_fd)
    if args.fake_watchdog_s >= 0:
        time.sleep(args.fake_watchdog_s)  # then the forward pass hangs: no progress
        log(
            f"Scheduler watchdog timeout (self.watchdog_timeout={_WATCHDOG_TIMEOUT_S}, "
            "self.soft=False)",
            args.rank,
            err=True,
        )
        # SGLang's hard watchdog signals its parent; an orphan names the server by its PID.
        with contextlib.suppress(ProcessLookupError):
            os.kill(args.fake_server_pid, signal.SIGQUIT)
    while context.fileno() >= 0:
        signal.pause()


def orphan_launch(argv: list[str]) -> None:
    """Start the worker ``argv[1:]`` describes, write its PID to fd ``argv[0]``, and exit.

    The worker inherits the ready pipe (and stdout, stderr: the journal), never the PID pipe;
    once this launcher is gone it is reparented.
    """
    said = int(argv[0])
    os.set_inheritable(said, False)  # noqa: FBT003 - positional-only in os
    worker = subprocess.Popen(
        argv[1:], executable=sys.executable, close_fds=False, stdin=subprocess.DEVNULL
    )
    os.write(said, f"{worker.pid}\n".encode())
    os._exit(0)


# --- the server (main process) ---------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launch_server.py",
        description="Fake SGLang server (gpuguard e2e). Options not starting with --fake- are "
        "SGLang's.",
    )
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=1)
    parser.add_argument("--mem-fraction-static", type=float, default=0.85)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--fake-load-s", type=float, default=2.0, help="model load time")
    parser.add_argument("--fake-drain-s", type=float, default=0.0, help="drain time on SIGTERM")
    parser.add_argument("--fake-pending", type=int, default=12, help="requests left to drain")
    parser.add_argument("--fake-main-mib", type=int, default=512, help="main context per GPU")
    parser.add_argument(
        "--fake-stubborn-worker",
        type=int,
        default=int(os.environ.get("FAKE_SGLANG_STUBBORN_WORKER", "-1")),
        help="this TP worker ignores SIGTERM (default: $FAKE_SGLANG_STUBBORN_WORKER)",
    )
    parser.add_argument(
        "--fake-state", type=Path, default=Path(os.environ.get("FAKENVML_STATE", "/nonexistent"))
    )
    parser.add_argument("--fake-driver", type=Path, default=Path("/run/fakegpu/driver.sock"))
    parser.add_argument(
        "--fake-graph-s",
        type=float,
        default=float(os.environ.get("FAKE_SGLANG_GRAPH_S", "0")),
        help="CUDA-graph capture time (default: $FAKE_SGLANG_GRAPH_S or 0)",
    )
    parser.add_argument(
        "--fake-engine-death-s",
        type=float,
        default=float(os.environ.get("FAKE_SGLANG_ENGINE_DEATH_S", "-1")),
        help="the TP0 scheduler dies this long after ready (default: "
        "$FAKE_SGLANG_ENGINE_DEATH_S; negative: never)",
    )
    parser.add_argument(
        "--fake-exit-0-after-death",
        action="store_true",
        default=os.environ.get("FAKE_SGLANG_EXIT_0_AFTER_DEATH") == "1",
        help="after the engine death, shut down and exit 0 ($FAKE_SGLANG_EXIT_0_AFTER_DEATH=1)",
    )
    parser.add_argument(
        "--fake-death-marker",
        type=Path,
        default=Path(os.environ["FAKE_SGLANG_DEATH_MARKER"])
        if os.environ.get("FAKE_SGLANG_DEATH_MARKER")
        else None,
        help="die only when this file does not exist yet, and create it "
        "($FAKE_SGLANG_DEATH_MARKER)",
    )
    parser.add_argument(
        "--fake-silent-death",
        action="store_true",
        default=os.environ.get("FAKE_SGLANG_SILENT_DEATH") == "1",
        help="the engine death prints no line; only /health says it ($FAKE_SGLANG_SILENT_DEATH=1)",
    )
    parser.add_argument(
        "--fake-hang-when-busy",
        action="store_true",
        default=os.environ.get("FAKE_SGLANG_HANG_WHEN_BUSY") == "1",
        help="when another process holds the memory a rank needs, hang in the weight load "
        "instead of failing ($FAKE_SGLANG_HANG_WHEN_BUSY=1)",
    )
    parser.add_argument(
        "--fake-exit-137-after-drain",
        action="store_true",
        default=os.environ.get("FAKE_SGLANG_EXIT_137") == "1",
        help="end the drain in SGLang's own SIGKILL of its tree, itself included "
        "($FAKE_SGLANG_EXIT_137=1)",
    )
    parser.add_argument(
        "--fake-orphan-workers",
        action="store_true",
        default=os.environ.get("FAKE_SGLANG_ORPHAN_WORKERS") == "1",
        help="start each TP worker through a launcher that exits: reparented "
        "($FAKE_SGLANG_ORPHAN_WORKERS=1)",
    )
    parser.add_argument(
        "--fake-watchdog-s",
        type=float,
        default=float(os.environ.get("FAKE_SGLANG_WATCHDOG_S", "-1")),
        help="TP0 hangs this long after ready and its watchdog SIGQUITs the server "
        "($FAKE_SGLANG_WATCHDOG_S; negative: never)",
    )
    parser.add_argument(
        "--fake-scope-workers",
        action="store_true",
        default=os.environ.get("FAKE_SGLANG_SCOPE_WORKERS") == "1",
        help="start each TP worker in its own transient scope (systemd-run --scope)",
    )
    return parser


def _visible_gpus(tp_size: int) -> list[int]:
    """NVML indices of the GPUs this server uses: CUDA_VISIBLE_DEVICES (indices) or 0..tp-1."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    indices = [int(x) for x in visible.split(",") if x.strip()] if visible else list(range(64))
    if len(indices) < tp_size:
        log(f"RuntimeError: tp_size={tp_size} but only {len(indices)} GPUs visible", err=True)
        sys.exit(1)
    return indices[:tp_size]


@dataclass(frozen=True)
class GpuFacts:
    """One GPU as the server sees it through NVML before it allocates."""

    rank: int
    index: int
    minor: int
    total: int
    free: int
    need: int
    processes: tuple[tuple[int, int | None], ...]

    @property
    def short(self) -> bool:
        """Whether the memory this rank needs is not free."""
        return self.free < self.need


def gpu_facts(gpus: list[int], fraction: float, main_mib: int) -> list[GpuFacts]:
    """Free memory and the processes on each GPU, through pynvml (like torch.cuda.mem_get_info)."""
    import pynvml  # noqa: PLC0415, TID251 - the real bindings, as SGLang and PyTorch use them

    pynvml.nvmlInit()
    try:
        facts = []
        for rank, index in enumerate(gpus):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            facts.append(
                GpuFacts(
                    rank=rank,
                    index=index,
                    minor=int(pynvml.nvmlDeviceGetMinorNumber(handle)),
                    total=int(memory.total),
                    free=int(memory.free),
                    need=int(memory.total * fraction) + main_mib * MIB,
                    processes=tuple((int(p.pid), p.usedGpuMemory) for p in processes),
                )
            )
    finally:
        pynvml.nvmlShutdown()
    return facts


def _report_oom(facts: list[GpuFacts], tp_size: int) -> None:
    """What SGLang's ranks print when the GPUs are taken, then the main process's last words.

    The rank that cannot allocate fails in PyTorch; with TP > 1 the other ranks refuse first,
    because the smallest free memory of all ranks is under 90 % of their own.
    """
    min_free = min(fact.free for fact in facts)
    for fact in facts:
        if fact.short:
            holders = " ".join(
                f"Process {pid} has {(used or 0) / GIB:.2f} GiB memory in use."
                for pid, used in fact.processes
            )
            log(
                "Scheduler hit an exception: Traceback (most recent call last):",
                fact.rank,
                err=True,
            )
            log(
                f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                f"{fact.need / GIB:.2f} GiB. GPU {fact.index} has a total capacity of "
                f"{fact.total / GIB:.2f} GiB of which {fact.free / GIB:.2f} GiB is free. "
                f"{holders} Of the allocated memory 0 bytes is allocated by PyTorch, and 0 bytes "
                "is reserved by PyTorch but unallocated.",
                fact.rank,
                err=True,
            )
        elif tp_size > 1 and min_free < fact.free * _UNBALANCED:
            log(
                "Scheduler hit an exception: Traceback (most recent call last):",
                fact.rank,
                err=True,
            )
            log(
                "RuntimeError: The memory capacity is unbalanced. Some GPUs may be occupied by "
                f"other processes. min_per_gpu_memory={min_free / GIB:.2f}, "
                f"local_gpu_memory={fact.free / GIB:.2f}, "
                f"local_gpu_memory * 0.9={fact.free * _UNBALANCED / GIB:.2f}",
                fact.rank,
                err=True,
            )
    log("Received sigquit from a child process. It usually means the child failed.", err=True)


class _Stop:
    requested = False


def _worker_args(rank: int, fact: GpuFacts, args: argparse.Namespace, ready_w: int) -> list[str]:
    """The worker's own options (after the script's path)."""
    argv = [
        _WORKER_FLAG,
        str(rank),
        "--fake-gpu",
        str(fact.minor),
        "--fake-mib",
        str(fact.need // MIB - args.fake_main_mib),
        "--fake-ready-fd",
        str(ready_w),
        "--fake-state",
        str(args.fake_state),
        "--fake-driver",
        str(args.fake_driver),
    ]
    if rank == args.fake_stubborn_worker:
        argv.append("--fake-ignore-sigterm")
    argv += ["--fake-server-pid", str(os.getpid())]
    if rank == 0 and args.fake_watchdog_s >= 0:
        argv += ["--fake-watchdog-s", str(args.fake_watchdog_s)]
    return argv


class _Orphan:
    """A worker reparented away from the server: signalled and awaited by PID, not waited for."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def poll(self) -> int | None:
        """None while it runs; 0 once gone (its new parent reaps it: the status is not ours)."""
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            return 0
        return 0 if state in {"Z", "X"} else None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.05)
        return 0

    @property
    def returncode(self) -> int | None:
        return self.poll()


def _spawn_worker(args: argparse.Namespace, fact: GpuFacts) -> subprocess.Popen[bytes] | _Orphan:
    """Start the TP worker of ``fact.rank``, named like SGLang's; return once it holds memory."""
    rank = fact.rank
    ready_r, ready_w = os.pipe()
    argv = [
        f"sglang::scheduler_TP{rank}",
        str(Path(__file__).resolve()),
        *_worker_args(rank, fact, args, ready_w),
    ]
    # argv[0] is not a path, so the interpreter cannot find its prefix itself: point it home.
    env = {**os.environ, "PYTHONHOME": sys.base_prefix, "CUDA_VISIBLE_DEVICES": str(fact.index)}
    executable = sys.executable
    if args.fake_scope_workers:
        # systemd-run execs the worker itself (same PID, still our child) once it sits in the
        # new scope; the scope, not the unit, names its INVOCATION_ID.
        env.pop("INVOCATION_ID", None)
        scope = f"--unit=tp-worker-{rank}-{os.getpid()}-{time.monotonic_ns() % 10**6}"
        argv = ["systemd-run", "--scope", "--quiet", "--collect", scope, "--", sys.executable]
        argv += [str(Path(__file__).resolve()), _EXEC_AS, f"sglang::scheduler_TP{rank}"]
        argv += _worker_args(rank, fact, args, ready_w)
        executable = "/usr/bin/systemd-run"
    proc: subprocess.Popen[bytes] | _Orphan
    if args.fake_orphan_workers:
        pid_r, pid_w = os.pipe()
        launcher = [sys.executable, str(Path(__file__).resolve()), _ORPHAN_FLAG, str(pid_w)]
        subprocess.run(
            [*launcher, *argv], pass_fds=(ready_w, pid_w), env=env, stdin=subprocess.DEVNULL,
            check=True,
        )  # fmt: skip
        os.close(pid_w)
        with os.fdopen(pid_r, "rb") as said:
            proc = _Orphan(int(said.read().split()[0]))
    else:
        proc = subprocess.Popen(
            argv, executable=executable, pass_fds=(ready_w,), env=env, stdin=subprocess.DEVNULL
        )
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as ready:
        ready.read()  # EOF: the worker holds its memory (or died)
    if proc.poll() is not None:
        log(f"TP worker {rank} exited with {proc.returncode} during start", err=True)
        sys.exit(1)
    return proc


def _notify_ready() -> None:
    """READY=1 to systemd when the unit is Type=notify (sd_notify's datagram, no library)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(b"READY=1", address)


class _Health:
    """What ``GET /health`` answers: 503 starting, 200 serving, 503 once the engine died."""

    status = 503


class _HealthHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        code = _Health.status if self.path == "/health" else 404
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_args: object) -> None:
        """Quiet, unlike uvicorn: a health check every few seconds would flood the journal."""


def _serve_health(host: str, port: int) -> None:
    """Answer /health from a thread for as long as the process lives (uvicorn's part)."""
    try:
        server = http.server.ThreadingHTTPServer((host, port), _HealthHandler)
    except OSError as err:
        log(f"ERROR: [Errno {err.errno}] error while attempting to bind on {host}:{port}", err=True)
        return
    threading.Thread(target=server.serve_forever, daemon=True).start()


def server_main(argv: list[str]) -> None:
    """The main process: load, check, allocate, spawn workers, serve, drain on SIGTERM."""
    args = _parser().parse_args(argv)  # a bad flag exits 2 here, before any load
    log(
        f"server_args=ServerArgs(model_path='{args.model_path}', tp_size={args.tp_size}, "
        f"mem_fraction_static={args.mem_fraction_static}, host='{args.host}', port={args.port})"
    )
    _serve_health(args.host, args.port)
    gpus = _visible_gpus(args.tp_size)
    log(f"Load weight begin. GPUs {gpus}", 0)
    time.sleep(args.fake_load_s)
    if args.fake_hang_when_busy:
        busy = gpu_facts(gpus, args.mem_fraction_static, args.fake_main_mib)
        while any(fact.short for fact in busy):  # as a collective waits on a rank that is not
            time.sleep(3600)  # there: no line, no progress, until a signal ends it
    log("Loading safetensors checkpoint shards: 100% Completed", 0)
    log("Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16", 0)
    facts = gpu_facts(gpus, args.mem_fraction_static, args.fake_main_mib)
    if any(fact.short for fact in facts):
        _report_oom(facts, args.tp_size)
        sys.exit(1)
    _open_devices(args.fake_state, [fact.minor for fact in facts])
    context = _create_context(args.fake_driver, [(f.minor, args.fake_main_mib) for f in facts])
    workers: list[subprocess.Popen[bytes] | _Orphan] = []
    # A scheduler's watchdog may fire as soon as it runs: the handler is there before it is.
    signal.signal(signal.SIGQUIT, lambda signum, frame: _child_failed(workers, signum, frame))
    workers.extend(_spawn_worker(args, fact) for fact in facts)
    signal.signal(signal.SIGTERM, lambda *_: setattr(_Stop, "requested", True))
    log("Capture cuda graph begin. This can take up to several minutes.", 0)
    _serve_until(time.monotonic() + args.fake_graph_s)
    log(f"Capture cuda graph end. Time elapsed: {args.fake_graph_s:.2f} s.", 0)
    log(f"Uvicorn running on http://{args.host}:{args.port} (Press CTRL+C to quit)")
    log(READY_LINE)
    _Health.status = 200
    _notify_ready()
    if args.fake_engine_death_s >= 0 and _dies(args.fake_death_marker):
        _serve_until(time.monotonic() + args.fake_engine_death_s)
        if not _Stop.requested:
            _engine_dies(workers[0], silent=args.fake_silent_death)
            if args.fake_exit_0_after_death:
                _Stop.requested = True
    _serve_until(float("inf"))
    _shut_down(args, workers, context)


def _shut_down(
    args: argparse.Namespace,
    workers: list[subprocess.Popen[bytes] | _Orphan],
    context: socket.socket,
) -> None:
    """A stop: drain (unless the engine died first), then end the workers and exit."""
    if not args.fake_exit_0_after_death:
        _drain(args)
    if args.fake_exit_137_after_drain and not args.fake_exit_0_after_death:
        log("Gracefully exiting... Remaining number of requests 0.")  # SGLang's last, then:
        _kill_tree(workers)  # kill_process_tree(os.getpid(), include_parent=True)
    for proc in workers:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _WORKER_STOP_S
    for proc in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    context.close()
    log("Server shut down.")
    sys.exit(0)


def _kill_tree(workers: list[subprocess.Popen[bytes] | _Orphan]) -> None:
    """SGLang's ``kill_process_tree(os.getpid(), include_parent=True)``, itself included.

    SIGKILL to each child, then to the server, which dies of it (status=9/KILL, exit 137).
    """
    for proc in workers:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _child_failed(
    workers: list[subprocess.Popen[bytes] | _Orphan], signum: int, frame: object
) -> None:
    """SGLang's running-phase SIGQUIT handler: say it, then kill the tree, itself included."""
    log(f"SIGQUIT received. {signum=}, {frame=}. It usually means one child failed.", err=True)
    _kill_tree(workers)


def _serve_until(deadline: float) -> None:
    """Serve (do nothing) until ``deadline`` on the monotonic clock or a SIGTERM."""
    while not _Stop.requested and time.monotonic() < deadline:
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def _dies(marker: Path | None) -> bool:
    """Whether the engine dies in this run: always, or once per ``marker`` file."""
    if marker is None:
        return True
    try:
        marker.touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


def _engine_dies(scheduler: subprocess.Popen[bytes] | _Orphan, *, silent: bool) -> None:
    """The TP0 scheduler dies (with its exception's lines unless ``silent``); /health says 503.

    The main process lives on, serving nothing.
    """
    _Health.status = 503
    if silent:
        log("[fake] engine died silently")
    else:
        log("Scheduler hit an exception: Traceback (most recent call last):", 0, err=True)
        log("RuntimeError: CUDA error: an illegal memory access was encountered", 0, err=True)
    with contextlib.suppress(ProcessLookupError):
        scheduler.kill()
    scheduler.wait()


def _drain(args: argparse.Namespace) -> None:
    """SGLang's graceful exit: wait for the pending requests (here: ``--fake-drain-s``)."""
    pending = args.fake_pending
    deadline = time.monotonic() + args.fake_drain_s
    while True:
        log(f"Gracefully exiting... Remaining number of requests {pending}.")
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(1.0, left))
        pending = max(0, pending - 1)


def main() -> None:
    """Worker or server, by the first argument."""
    argv = sys.argv[1:]
    if argv[:1] == [_EXEC_AS] and len(argv) > 1:
        # Started through systemd-run, whose argv[0] is a path: take SGLang's process title.
        os.execv(sys.executable, [argv[1], str(Path(__file__).resolve()), *argv[2:]])  # noqa: S606 - our own interpreter
    if argv[:1] == [_ORPHAN_FLAG]:
        orphan_launch(argv[1:])
    elif argv[:1] == [_WORKER_FLAG]:
        worker_main(argv)
    else:
        server_main(argv)


if __name__ == "__main__":
    main()
