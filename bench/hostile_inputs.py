#!/usr/bin/env python3
"""Benchmark: what each parser of foreign text costs per MiB of hostile input, at three sizes.

Every parser gpuguard runs over text another user chose (command lines, process and cgroup
names, journal entries and unit output, systemctl's output, state and cache files) must be
total and linear. For each parser and each worst-case shape (long runs of a pattern's prefix,
``-a=`` repeats, ``://`` tails, control-character floods, deep nesting), this measures the cost
per MiB at 1 KiB, 64 KiB and 2 MiB; it flags a parser whose cost per MiB at 2 MiB exceeds
``--factor`` (3) times its cost at 64 KiB (superlinear) - unless it stays under NOISE_FLOOR_S per
MiB, where copying 2 MiB costs more than parsing it - and one that raises (not total).

Baseline, measured on the same input in the same run: ``json.dumps`` of it, one pass in C that
gpuguard's ``--json`` output makes of such text anyway. Each measurement runs in a child process
with a time limit (``--limit``, 60 s), so a quadratic parser is reported as a lower bound
instead of stalling the run. Run: ``.venv/bin/python bench/hostile_inputs.py``; ``--floods``
then measures root's ``status`` under a descriptor flood and a mapping flood against a quiet
host (bench/proc_floods.py); ``--slots`` a watched unit's gate under a flood of other users'
requests against a quiet server (bench/slot_flood.py).
"""

from __future__ import annotations

import argparse
import atexit
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

KIB = 1024
MIB = 1024 * KIB
SIZES = (KIB, 64 * KIB, 2 * MIB)
ARG_MAX = 128 * KIB - 1  # the kernel's limit on one argument, less its NUL


def fill(piece: str, size: int) -> str:
    """``piece`` repeated to exactly ``size`` characters."""
    return (piece * (size // len(piece) + 1))[:size]


def as_argv(text: str) -> list[str]:
    """``text`` cut into arguments of at most 128 KiB, as execve would take them."""
    return [text[i : i + ARG_MAX] for i in range(0, len(text), ARG_MAX)] or [""]


def _redaction(piece: str) -> Callable[[int], Callable[[], object]]:
    def make(size: int) -> Callable[[], object]:
        from gpuguard.core.redaction import redact_cmdline  # noqa: PLC0415 - timed in the child

        argv = as_argv(fill(piece, size))
        return lambda: redact_cmdline(argv)

    return make


def _tail(prefix: str, tail: str) -> Callable[[int], Callable[[], object]]:
    def make(size: int) -> Callable[[], object]:
        from gpuguard.core.redaction import redact_cmdline  # noqa: PLC0415

        each = min(size, ARG_MAX)
        argv = [fill(prefix, each - len(tail)) + tail for _ in range(max(1, size // ARG_MAX))]
        return lambda: redact_cmdline(argv)

    return make


def _escape(piece: str) -> Callable[[int], Callable[[], object]]:
    def make(size: int) -> Callable[[], object]:
        from gpuguard.core.escaping import escape  # noqa: PLC0415

        text = fill(piece, size)
        return lambda: escape(text)

    return make


def _cgroup(piece: str, head: str = "0::/") -> Callable[[int], Callable[[], object]]:
    def make(size: int) -> Callable[[], object]:
        from gpuguard.core.cgroup import attribute, parse_cgroup  # noqa: PLC0415

        text = head + fill(piece, size - len(head))
        return lambda: attribute(parse_cgroup(text))

    return make


def _stat(piece: str) -> Callable[[int], Callable[[], object]]:
    def make(size: int) -> Callable[[], object]:
        from gpuguard.adapters.procread import parse_stat  # noqa: PLC0415

        data = b"1234 (" + fill(piece, size).encode("utf-8", "surrogateescape") + b") S 1 1 1 0"
        data += b" -1 4194560" + b" 0" * 12 + b" 20 0 1 0 4242 0 0"
        return lambda: parse_stat(data)

    return make


def _cmdline(piece: str) -> Callable[[int], Callable[[], object]]:
    def make(size: int) -> Callable[[], object]:
        from gpuguard.adapters.procread import split_cmdline  # noqa: PLC0415 - the parser itself

        data = fill(piece, size).encode("utf-8", "surrogateescape")
        return lambda: split_cmdline(data)

    return make


def _fd_size(piece: str) -> Callable[[int], Callable[[], object]]:
    def make(size: int) -> Callable[[], object]:
        from gpuguard.adapters.procread import parse_fd_size  # noqa: PLC0415 - the parser itself

        data = b"Name:\t" + fill(piece, size).encode("utf-8", "surrogateescape") + b"\n"
        return lambda: parse_fd_size(data)

    return make


def _entry(message: object) -> dict[str, object]:
    return {
        "__CURSOR": "s=1;i=1",
        "__REALTIME_TIMESTAMP": "1764000000000000",
        "__MONOTONIC_TIMESTAMP": "86400000000",
        "_BOOT_ID": "0123456789abcdef0123456789abcdef",
        "_SYSTEMD_UNIT": "sglang.service",
        "_TRANSPORT": "stdout",
        "_PID": "4242",
        "MESSAGE": message,
    }


def _journal(piece: str, *, as_bytes: bool = False) -> Callable[[int], Callable[[], object]]:
    def make(size: int) -> Callable[[], object]:
        from gpuguard.core.events import parse_entry  # noqa: PLC0415

        text = fill(piece, size)
        message: object = list(text.encode("utf-8", "surrogateescape")) if as_bytes else text
        entry = _entry(message)
        return lambda: parse_entry(entry, "sglang.service")

    return make


def _oom(piece: str) -> Callable[[int], Callable[[], object]]:
    def make(size: int) -> Callable[[], object]:
        import re  # noqa: PLC0415

        from gpuguard.core.events import GPU_OOM_REGEX  # noqa: PLC0415

        pattern = re.compile(GPU_OOM_REGEX)
        text = fill(piece, size)
        return lambda: pattern.search(text)

    return make


def _show(piece: str, head: str = "") -> Callable[[int], Callable[[], object]]:
    def make(size: int) -> Callable[[], object]:
        from gpuguard.core.unitstate import parse_show  # noqa: PLC0415

        text = head + fill(piece, size - len(head))
        return lambda: parse_show("sglang.service", text)

    return make


def _state(piece: str, head: str = "") -> Callable[[int], Callable[[], object]]:
    def make(size: int) -> Callable[[], object]:
        from gpuguard.adapters.state import read_json  # noqa: PLC0415

        directory = tempfile.TemporaryDirectory()
        atexit.register(directory.cleanup)
        path = Path(directory.name) / "state.json"
        path.write_text(head + fill(piece, size - len(head)), encoding="utf-8")
        return lambda: read_json(path)

    return make


def _xid(
    piece: str, head: str = "NVRM: Xid (PCI:0000:3b:00): "
) -> Callable[[int], Callable[[], object]]:
    def make(size: int) -> Callable[[], object]:
        from gpuguard.core.xid.events import parse_kernel_entry  # noqa: PLC0415

        entry = {"_TRANSPORT": "kernel", "MESSAGE": head + fill(piece, size - len(head))}
        return lambda: parse_kernel_entry(entry)

    return make


def _env_file(piece: str) -> Callable[[int], Callable[[], object]]:
    def make(size: int) -> Callable[[], object]:
        from gpuguard.core.unitconfig import parse_environment_file  # noqa: PLC0415

        data = fill(piece, size).encode("utf-8", "surrogateescape")
        return lambda: parse_environment_file(data)

    return make


def _unit_show(piece: str, head: str = "") -> Callable[[int], Callable[[], object]]:
    def make(size: int) -> Callable[[], object]:
        from gpuguard.core.unitconfig import parse_show  # noqa: PLC0415

        text = head + fill(piece, size - len(head))
        return lambda: parse_show("sglang.service", text)

    return make


def _environ(piece: str) -> Callable[[int], Callable[[], object]]:
    def make(size: int) -> Callable[[], object]:
        from gpuguard.adapters.procread import parse_invocation_id  # noqa: PLC0415

        data = fill(piece, size).encode("utf-8", "surrogateescape")
        return lambda: parse_invocation_id(data)

    return make


def _invocations(piece: str) -> Callable[[int], Callable[[], object]]:
    def make(size: int) -> Callable[[], object]:
        from gpuguard.adapters.systemd import parse_invocations  # noqa: PLC0415

        text = fill(piece, size)
        return lambda: parse_invocations(text, "sglang.service")

    return make


def _exec_start(piece: str, head: str) -> Callable[[int], Callable[[], object]]:
    def make(size: int) -> Callable[[], object]:
        from gpuguard.core.unitconfig import exec_argvs  # noqa: PLC0415
        from gpuguard.core.unitcontainers import claim_from_exec  # noqa: PLC0415

        text = head + fill(piece, size - len(head))
        return lambda: [claim_from_exec(argv) for argv in exec_argvs(text)]

    return make


def _run_argv(piece: str) -> Callable[[int], Callable[[], object]]:
    def make(size: int) -> Callable[[], object]:
        from gpuguard.core.unitcontainers import claim_from_exec  # noqa: PLC0415

        argv = ["/usr/bin/docker", "run", *fill(piece, size).split(), "--name", "n", "img"]
        return lambda: claim_from_exec(argv)

    return make


def _inspect(piece: str, head: str = "") -> Callable[[int], Callable[[], object]]:
    def make(size: int) -> Callable[[], object]:
        from gpuguard.core.unitcontainers import parse_inspect  # noqa: PLC0415

        text = head + fill(piece, size - len(head))

        def run() -> object:
            try:
                return parse_inspect(json.loads(text))
            except (ValueError, RecursionError):  # what engineapi turns into EngineError
                return None

        return run

    return make


NOISE_FLOOR_S = 0.01
"""Seconds per MiB below which no ratio is flagged: a slice of a 2 MiB string costs about this."""


CASES: dict[str, dict[str, Callable[[int], Callable[[], object]]]] = {
    "redaction": {
        "-a= repeats": _redaction("-a="),
        "key-a= repeats": _redaction("key-a="),
        "a… ending in ://": _tail("a", "://"),
        "a… ending in ?token=": _tail("a", "?token="),
        '"k": repeats (JSON keys)': _redaction('"k":'),
        "'key': repeats": _redaction("'key':"),
        "key words": _redaction("key "),
        "-p words": _redaction("-p "),
        "auth:x words": _redaction("auth:x "),
        "-----BEGIN repeats": _redaction("-----BEGIN"),
        "plain words (best case)": _redaction("word "),
    },
    "escaper": {
        "ESC flood": _escape("\x1b"),
        "surrogateescape flood": _escape("\udcff"),
        "CJK and ESC": _escape("中\x1b"),
        "tag characters and letters": _escape("\U000e0001a"),
        "printable ASCII (best case)": _escape("abc "),
    },
    "cgroup (parse_cgroup + attribute)": {
        "deep path of units": _cgroup("a.service/"),
        "machine- components": _cgroup("machine-aaaa/"),
        "docker- hex components": _cgroup("docker-0123456789abcdef0/"),
        "\\r-separated lines": _cgroup("\r0::/x.service"),
        "name=systemd lines": _cgroup("\n1:name=systemd:/a", head="0::/"),
    },
    "procfs": {
        "stat: comm of ')'": _stat(")"),
        "stat: comm of ') S 1 ('": _stat(") S 1 ("),
        "cmdline: NUL-separated args": _cmdline("a\0"),
        "cmdline: undecodable bytes": _cmdline("\udcff\0"),
        "status: FDSize: lines": _fd_size("\nFDSize:\t9"),
    },
    "journal entry (events.parse_entry)": {
        "vLLM pattern prefix repeats": _journal("Free memory on device "),
        "vLLM prefix + long tail": _journal("Free memory on device " + "x" * 64),
        "ANSI OSC openers": _journal("\x1b]"),
        "ANSI CSI openers": _journal("\x1b[0;"),
        "MESSAGE as byte array": _journal("\x1b[31m\xff", as_bytes=True),
        "plain text (best case)": _journal("Decode batch. #running-req: 1 "),
    },
    "OOM/output patterns (GPU_OOM_REGEX)": {
        "vLLM prefix repeats": _oom("Free memory on device "),
        "torch. repeats": _oom("torch."),
        "CUDA repeats": _oom("CUDA "),
        "plain text (best case)": _oom("Decode batch. "),
    },
    "systemctl show (unitstate.parse_show)": {
        "many lines": _show("X=y\n"),
        "Environment= quotes": _show("A='b ", head="Environment="),
        "Environment= backslashes": _show('"\\', head="Environment="),
    },
    "kernel Xid lines (xid.events.parse_kernel_entry)": {
        "NVRM: Xid prefix repeats": _xid("NVRM: Xid (", head=""),
        "long name=": _xid("a", head="NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name="),
        "long detail": _xid("x, ", head="NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=a, "),
    },
    "environment (unitconfig: EnvironmentFile=, Environment=)": {
        "file: backslash-continued lines": _env_file("A=b\\\n"),
        "file: quotes": _env_file('A="\\"\n'),
        "show: Environment= backslash-space": _unit_show("a\\ ", head="Environment="),
        "show: many ExecStartPre= lines": _unit_show("ExecStartPre={ path=/x }\n"),
    },
    "container engines (unitcontainers: ExecStart=, inspect answers)": {
        "show: ExecStart= argv[] repeats": _exec_start("argv[]=x ", head="ExecStart={ "),
        "show: docker run options": _exec_start(
            "-e X=1 ", head="{ path=/usr/bin/docker ; argv[]=/usr/bin/docker run "
        ),
        "argv: value options": _run_argv("-e X=1 "),
        "argv: short flag clusters": _run_argv("-itditdit "),
        "inspect: deep nesting [": _inspect("["),
        "inspect: many labels": _inspect(
            '"k": "v", ', head='{"Id": "' + "a" * 64 + '", "State": {}, "Config": {"Labels": {'
        ),
    },
    "provenance (environ INVOCATION_ID, journal invocations)": {
        "environ: many INVOCATION_ID=": _environ("INVOCATION_ID=0\0"),
        "environ: NUL flood": _environ("\0"),
        "journal lines: not JSON": _invocations("{\n"),
        "journal lines: PID 1 entries": _invocations(
            '{"_PID": "1", "UNIT": "sglang.service", "INVOCATION_ID": "0"}\n'
        ),
    },
    "state/cache JSON (state.read_json)": {
        "deep nesting [": _state("["),
        "long string": _state("a", head='{"planner": "'),
        "many keys": _state('"k": 1, ', head="{"),
    },
}


def _seconds(run: Callable[[], object], minimum: float = 0.05) -> float:
    """Time per call: repeat small cases until ``minimum`` seconds have passed, best of rounds.

    One untimed call first: a lazily built table (the escaper's) is paid once per process, not
    per input.
    """
    run()
    best = float("inf")
    rounds = 0
    spent = 0.0
    while rounds < 3 and (spent < minimum or rounds == 0):
        calls = 0
        started = time.perf_counter()
        while True:
            run()
            calls += 1
            elapsed = time.perf_counter() - started
            if elapsed >= minimum / 3 or calls >= 1000:
                break
        best = min(best, elapsed / calls)
        spent += elapsed
        rounds += 1
    return best


def measure_one(parser: str, shape: str, size: int) -> dict[str, object]:
    """In the child: the parser's and the baseline's seconds per call on one input."""
    try:
        run = CASES[parser][shape](size)
        seconds = _seconds(run)
    except Exception as err:  # noqa: BLE001 - a parser that raises is what this reports
        return {"error": f"{type(err).__name__}: {str(err)[:80]}"}
    text = fill("x", size)
    baseline = _seconds(lambda: json.dumps(text))
    return {"seconds": seconds, "baseline": baseline}


def run_child(parser: str, shape: str, size: int, limit: float) -> dict[str, object]:
    """Measure in a fresh interpreter, killed after ``limit`` seconds."""
    command = [sys.executable, __file__, "--one", parser, shape, str(size)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit, check=False)
    except subprocess.TimeoutExpired:
        return {"timeout": limit}
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1][:100] if done.stderr else "died"}
    result: dict[str, object] = json.loads(done.stdout)
    return result


def _per_mib(result: dict[str, object], size: int) -> float | None:
    seconds = result.get("seconds")
    return float(seconds) / (size / MIB) if isinstance(seconds, float) else None


def _cell(result: dict[str, object], size: int) -> str:
    if "timeout" in result:
        return f">{float(result['timeout']) / (size / MIB):.3g}"  # type: ignore[arg-type]
    if "error" in result:
        return "raises"
    per = _per_mib(result, size)
    return f"{per:.4f}" if per is not None else "?"


def _loads(*, floods: bool, slots: bool) -> list[str]:
    """Run the chosen load benchmarks (root); the names of those that missed their targets."""
    missed = []
    for wanted, name in ((floods, "proc_floods.py"), (slots, "slot_flood.py")):
        script = Path(__file__).with_name(name)
        if wanted and subprocess.run([sys.executable, str(script)], check=False).returncode:
            missed.append(name)
    return missed


def main() -> int:
    """Measure every parser and shape; print the table and the flags; 1 if any was flagged."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=float, default=60.0, help="seconds per measurement")
    parser.add_argument("--factor", type=float, default=3.0, help="2 MiB vs 64 KiB flag ratio")
    parser.add_argument("--only", help="measure only parsers whose name contains this")
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument(
        "--floods", action="store_true", help="then the /proc floods (bench/proc_floods.py, root)"
    )
    parser.add_argument(
        "--slots", action="store_true", help="then the gate slot flood (bench/slot_flood.py, root)"
    )
    args = parser.parse_args()
    if args.one:
        name, shape, size = args.one
        sys.stdout.write(json.dumps(measure_one(name, shape, int(size))))
        return 0
    print(
        "hostile inputs: seconds per MiB of input at 1 KiB / 64 KiB / 2 MiB; baseline json.dumps "
        f"of the same input; flagged when 2 MiB costs > {args.factor:g}x per MiB what 64 KiB does"
    )
    header = f"  {'shape':34} {'1 KiB':>9} {'64 KiB':>9} {'2 MiB':>9} {'2M/64K':>7} {'x base':>8}"
    flagged: list[str] = []
    for name, shapes in CASES.items():
        if args.only and args.only not in name:
            continue
        print(f"{name}\n{header}")
        for shape in shapes:
            results = [run_child(name, shape, size, args.limit) for size in SIZES]
            cells = [_cell(result, size) for result, size in zip(results, SIZES, strict=True)]
            mid, big = _per_mib(results[1], SIZES[1]), _per_mib(results[2], SIZES[2])
            ratio = f"{big / mid:.1f}" if mid and big else "-"
            base = results[2].get("baseline")
            versus = f"{big / (float(base) / 2):.0f}x" if big and isinstance(base, float) else "-"
            note = ""
            errors = [str(r["error"]) for r in results if "error" in r]
            if errors:
                note = f"  NOT TOTAL: {errors[0]}"
            elif "timeout" in results[2] or (
                mid and big and big > args.factor * mid and big > NOISE_FLOOR_S
            ):
                note = "  SUPERLINEAR"
            if note:
                flagged.append(f"{name}: {shape}:{note}")
            row = f"  {shape:34} {cells[0]:>9} {cells[1]:>9} {cells[2]:>9} {ratio:>7} {versus:>8}"
            print(row + note)
    print("flagged:" if flagged else "flagged: none")
    for line in flagged:
        print(f"  {line}")
    flagged.extend(_loads(floods=args.floods, slots=args.slots))
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
