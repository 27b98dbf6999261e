"""Journal entries → typed unit lifecycle events (pure: no I/O, no clock).

systemd (PID 1) reports each run of a unit in the journal; this module turns one
``journalctl -o json`` entry into a ``UnitEvent`` or ``None``. What is at risk: acting on a
forged entry. Everything in a journal entry without a leading underscore (``MESSAGE``,
``MESSAGE_ID``, ``UNIT``, ``N_RESTARTS``, ``INVOCATION_ID``…) can be sent by any local user, so a
lifecycle event counts only when journald's trusted fields say PID 1 wrote it (``is_trusted``).

The unit's own output is a second, weaker source: it can only ever yield ``gpu-oom-output``,
when a line matches what servers print when GPU memory is already taken (``GPU_OOM_PATTERNS``),
and ``engine-fatal`` / ``start-phase`` for the lines of ``core.enginelines`` (docs/liveness.md).
``_SYSTEMD_UNIT`` proves which unit wrote the line, but the text itself is free: such an event is
evidence about the run that printed it (``_SYSTEMD_INVOCATION_ID``), never about another (the
detector uses OOM lines only to explain runs that PID 1 reported as failed; core.liveness judges
only the run that printed a line).

Facts: docs/facts.md §4 (trusted fields, MESSAGE_IDs, restart sequences), docs/daemon.md;
golden samples in tests/journal_samples (systemd 252 and 257).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from gpuguard.core import startfailure
from gpuguard.core.enginelines import match_line
from gpuguard.core.escaping import escape
from gpuguard.core.values import StrEnum

if TYPE_CHECKING:
    from gpuguard.core.startfailure import FailureClass


class EventKind(StrEnum):
    """What happened to a unit, as systemd (or, for ``gpu-oom-output``, the unit) said it."""

    STARTING = "starting"
    """``Starting …`` (UNIT_STARTING); absent for Type=simple units without ExecStartPre=."""
    STARTED = "started"
    """``Started …`` (UNIT_STARTED): the start job finished."""
    START_FAILED = "start-failed"
    """``Failed to start …`` (UNIT_FAILED): the start job failed; ``result`` is JOB_RESULT."""
    STOPPING = "stopping"
    """``Stopping …`` (UNIT_STOPPING)."""
    STOPPED = "stopped"
    """``Stopped …`` (UNIT_STOPPED); 252 also logs it between automatic restarts, 257 does not."""
    MAIN_EXITED = "main-exited"
    """``Main process exited, code=…, status=…`` (UNIT_PROCESS_EXIT of the main process only)."""
    FAILED = "failed"
    """``Failed with result '…'`` (UNIT_FAILURE_RESULT): the run ended in failure."""
    DEACTIVATED = "deactivated"
    """``Deactivated successfully.`` (UNIT_SUCCESS): the run ended cleanly."""
    RESTART_SCHEDULED = "restart-scheduled"
    """``Scheduled restart job, restart counter is at N.`` (UNIT_RESTART_SCHEDULED)."""
    STOP_TIMED_OUT = "stop-timed-out"
    """``State 'stop-sigterm' timed out. Killing.`` (text only; ``final`` for final-sigterm)."""
    SURVIVED_SIGKILL = "survived-sigkill"
    """``Processes still around after (final) SIGKILL.`` (text only)."""
    LEFT_OVER_PROCESS = "left-over-process"
    """``Found left-over process N (comm) in control group while starting unit.`` (text only)."""
    START_LIMIT_HIT = "start-limit-hit"
    """``Start request repeated too quickly.`` (text only; systemd stops restarting the unit)."""
    GPU_OOM_OUTPUT = "gpu-oom-output"
    """The unit's own output says GPU memory was not available: evidence, never a trigger."""
    ENGINE_FATAL = "engine-fatal"
    """The unit's own output says its engine died (core.enginelines; ``line`` names which)."""
    START_PHASE = "start-phase"
    """The unit's own output marks a phase of its start (core.enginelines; ``line``)."""


@dataclass(frozen=True, slots=True)
class UnitEvent:
    """One lifecycle event of a unit, with the journal position it came from.

    ``invocation_id`` names the run: ``INVOCATION_ID`` on PID 1's entries (the *old* run for
    "Failed with result", "Scheduled restart job" and "Stopped"; the *new* one for
    "Starting"/"Started" and the left-over warning), ``_SYSTEMD_INVOCATION_ID`` on output.
    ``message`` is the decoded text, ANSI sequences removed, control characters escaped and cut
    to about 300 characters: for people, never for decisions.

    Time is the journal's per-boot monotonic stamp with ``boot_id``, never the wall clock: a wall
    that steps (NTP, a wrong RTC) would age events that just happened, or keep old ones young.
    """

    kind: EventKind
    unit: str
    monotonic_s: float
    """Where the entry sits on its boot's timeline (``__MONOTONIC_TIMESTAMP``): decisions use it."""
    realtime_s: float | None
    """The wall clock when journald stored it (``__REALTIME_TIMESTAMP``): only shown to people."""
    cursor: str
    invocation_id: str | None
    boot_id: str | None
    message: str = ""
    exit_code: str | None = None
    """main-exited: ``exited``, ``killed`` or ``dumped`` (EXIT_CODE)."""
    exit_status: int | None = None
    """main-exited: the exit status, or the signal number when killed/dumped (EXIT_STATUS)."""
    signal: str | None = None
    """main-exited when killed/dumped: the signal's name without ``SIG`` (``KILL``)."""
    result: str | None = None
    """failed: UNIT_RESULT (``exit-code``, ``signal``, ``timeout``…); start-failed: JOB_RESULT."""
    n_restarts: int | None = None
    """restart-scheduled: systemd's restart counter (N_RESTARTS)."""
    pid: int | None = None
    """left-over-process: the left-over PID."""
    comm: str | None = None
    """left-over-process: its command name."""
    final: bool = False
    """stop-timed-out / survived-sigkill: the final-sigterm / final SIGKILL variant."""
    job_type: str | None = None
    """stopping / stopped: the job that stops the unit (JOB_TYPE): ``stop`` is a stop job someone
    asked for (an operator, a conflict, gpuguard), ``restart`` systemd's or a restart request."""
    device: int | None = None
    """gpu-oom-output: the CUDA device the line names (``cuda:1``, ``GPU 3``), numbered as the
    process saw its devices (after CUDA_VISIBLE_DEVICES), not NVML's index."""
    failure: FailureClass | None = None
    """gpu-oom-output: what the line says about the cause (startfailure.py)."""
    knob: str | None = None
    """gpu-oom-output: the server's setting the line names as the way to make it fit."""
    signature: str | None = None
    """gpu-oom-output: the signature ``startfailure.classify`` picked, as ``server: phrase``
    (the most specific match, the one the daemon judges by; the phrase is the unit's text)."""
    line: str | None = None
    """engine-fatal / start-phase: the key of the line matched (core.enginelines.BY_KEY)."""
    sender_pid: int | None = None
    """engine-fatal / start-phase: the entry's trusted ``_PID`` (journald's: the writer, or on a
    stdout stream before systemd 256 the process that opened the stream), which says whose line
    it is where ``_SYSTEMD_INVOCATION_ID`` cannot: journald stamps that with the unit's current
    run, also on a left-over's line (docs/facts.md §4.8)."""
    sender_stream: str | None = None
    """engine-fatal / start-phase: the entry's ``_STREAM_ID`` (journald's, one per stdout stream
    a run's process opened): with ``sender_pid``, a writer even once its PID is reused."""


OUTPUT_KINDS: Final = frozenset(
    {EventKind.GPU_OOM_OUTPUT, EventKind.ENGINE_FATAL, EventKind.START_PHASE}
)
"""The kinds read from the unit's own output, not from systemd."""


# MESSAGE_IDs from sd-messages.h (identical in systemd 252, 254 and 257; docs/facts.md §4.1).
MESSAGE_IDS: Final[Mapping[str, EventKind]] = {
    "7d4958e842da4a758f6c1cdc7b36dcc5": EventKind.STARTING,
    "39f53479d3a045ac8e11786248231fbf": EventKind.STARTED,
    "be02cf6855d2428ba40df7e9d022f03d": EventKind.START_FAILED,
    "de5b426a63be47a7b6ac3eaac82e2f6f": EventKind.STOPPING,
    "9d1aaa27d60140bd96365438aad20286": EventKind.STOPPED,
    "98e322203f7a4ed290d09fe03c09fe15": EventKind.MAIN_EXITED,
    "d9b373ed55a64feb8242e02dbe79a49c": EventKind.FAILED,
    "7ad2d189f7e94e70a38c781354912448": EventKind.DEACTIVATED,
    "5eb03494b6584870a536b337290809b3": EventKind.RESTART_SCHEDULED,
}


# The start-failure signatures are data of their own (startfailure.py); named here too, where
# the journal's readers have always found them.
START_FAILURE_SIGNATURES: Final = startfailure.START_FAILURE_SIGNATURES
GPU_OOM_PATTERNS: Final = startfailure.GPU_OOM_PATTERNS
GPU_OOM_REGEX: Final = startfailure.GPU_OOM_REGEX

FIELDS_READ: Final = (
    "MESSAGE",
    "MESSAGE_ID",
    "UNIT",
    "INVOCATION_ID",
    "N_RESTARTS",
    "EXIT_CODE",
    "EXIT_STATUS",
    "UNIT_RESULT",
    "JOB_RESULT",
    "JOB_TYPE",
    "COMMAND",
    "_PID",
    "_UID",
    "_SYSTEMD_CGROUP",
    "_SYSTEMD_UNIT",
    "_SYSTEMD_INVOCATION_ID",
    "_TRANSPORT",
    "_STREAM_ID",
    "_BOOT_ID",
)
"""Every field parse_entry reads (journalctl adds __CURSOR, __REALTIME_TIMESTAMP and
__MONOTONIC_TIMESTAMP itself): the
follower asks journalctl for these only, which halves what Python has to json.loads."""

_GPU_OOM = re.compile(GPU_OOM_REGEX)
# The CUDA device a start-failure line names: "cuda:1", "GPU 3 has a total capacity", "(GPU 0;",
# "device 2".
_PID_TEXT = re.compile(r"[1-9][0-9]{0,9}")
_DEVICE = re.compile(r"(?:\bcuda:|\bGPU |\bdevice )(\d{1,3})(?![\d.])")

# Text-only PID-1 messages (systemd sets no MESSAGE_ID on them; docs/facts.md §4.1, §4.7).
_LEFT_OVER = re.compile(
    r"Found left-over process (?P<pid>\d{1,10}) \((?P<comm>.{0,64})\) "
    r"in control group while starting"
)
_STOP_TIMEOUT = re.compile(r"State '(?P<state>(?:stop|final)-sigterm)' timed out\.")
_SURVIVED = re.compile(r"Processes still around after (?P<final>final )?SIGKILL\.")
_START_LIMIT = "Start request repeated too quickly."
_MAIN_EXIT = "Main process exited"
# Before systemd 248 (unit_log_process_exit, unit_log_failure) these two had no MESSAGE_ID:
# service.c logged "Main process exited, code=%s, status=%i/%s" with EXIT_CODE= and
# EXIT_STATUS= only ("main process exited" in 219), and "Failed with result '%s'." as a plain
# warning without UNIT_RESULT= (docs/facts.md §4.1, tests/journal_public/README.md).
_MAIN_EXIT_TEXT = re.compile(
    r"[Mm]ain process exited, code=(?P<code>exited|killed|dumped), status=(?P<status>\d{1,10})/"
)
_FAILED_TEXT = re.compile(r"Failed with result '(?P<result>[a-z][a-z-]{0,39})'\.")
_OTHER_EXIT = re.compile(r"(?:Control|Condition check) process exited")

_OUTPUT_TRANSPORTS: Final = frozenset({"stdout", "journal", "syslog"})
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
_INT = re.compile(r"[+-]?\d{1,18}")
MESSAGE_LIMIT: Final = 300
"""Characters of MESSAGE kept on an event."""
OUTPUT_SCAN_CHARS: Final = 64 * 1024
"""Characters of a MESSAGE examined at all: a server's out-of-memory phrase comes in its first
line; what a hostile unit prints past this costs nothing (a 1 MiB line is cut, not scanned)."""
_PID1_SCAN_CHARS: Final = 4096
"""PID 1's messages are short; the text matched against them is cut to this (linear anyway)."""
_MAX_REALTIME_US: Final = 253_402_300_799_999_999
"""9999-12-31T23:59:59.999999Z: past it, no datetime can show the stamp (it is left out)."""


def is_trusted(entry: Mapping[str, object], unit: str) -> bool:
    """Whether journald's trusted fields say systemd (PID 1) wrote this entry about ``unit``.

    ``_PID``/``_UID``/``_SYSTEMD_CGROUP`` are set by journald and cannot be sent by a client;
    ``_SYSTEMD_CGROUP=/init.scope`` is how systemd 257's own ``journalctl -u`` recognises the
    manager (and the helpers it forks). ``UNIT`` itself is forgeable, but only PID 1 is trusted
    to set it here.
    """
    if _string(entry.get("_UID")) != "0":
        return False
    if _string(entry.get("_PID")) != "1" and _string(entry.get("_SYSTEMD_CGROUP")) != "/init.scope":
        return False
    return _string(entry.get("UNIT")) == unit


def parse_entry(entry: Mapping[str, object], unit: str) -> UnitEvent | None:
    """The event a journal entry reports about ``unit``, or None (unknown, untrusted, malformed).

    Never raises: journalctl prints a MESSAGE as an array of byte values (ANSI escapes,
    non-UTF-8), ``null`` when it is over 4096 bytes without ``--all``, and a field sent twice as
    an array; anything else of the wrong type just makes the entry unrecognised.
    """
    if not isinstance(entry, Mapping):
        return None
    cursor = _string(entry.get("__CURSOR"))
    monotonic_s = _timestamp_s(entry.get("__MONOTONIC_TIMESTAMP"))
    if not cursor or monotonic_s is None:
        return None
    where = _Where(
        cursor,
        monotonic_s,
        _timestamp_s(entry.get("__REALTIME_TIMESTAMP")),
        _string(entry.get("_BOOT_ID")) or None,
    )
    if is_trusted(entry, unit):
        return _lifecycle_event(entry, unit, where)
    if _is_unit_output(entry, unit):
        return _output_event(entry, unit, where)
    return None


@dataclass(frozen=True, slots=True)
class _Where:
    """An entry's position: cursor, boot timeline, and the wall clock for people."""

    cursor: str
    monotonic_s: float
    realtime_s: float | None
    boot_id: str | None


def _lifecycle_event(entry: Mapping[str, object], unit: str, where: _Where) -> UnitEvent | None:
    """The event in an entry PID 1 wrote: by MESSAGE_ID, else by its fixed text.

    The kind and its fields are worked out first and the event is built once: building a
    placeholder and replace()-ing it cost half of the parse (bench/journal_throughput.py).
    """
    text = decode_message(entry.get("MESSAGE"), limit=_PID1_SCAN_CHARS)
    message_id = _string(entry.get("MESSAGE_ID"))
    if message_id:
        kind = MESSAGE_IDS.get(message_id.lower())
        fields = None if kind is None else _fields_by_id(kind, entry, text)
    else:
        fields = None if text is None else _fields_by_text(text, entry)
    if fields is None:
        return None
    return UnitEvent(
        unit=unit,
        monotonic_s=where.monotonic_s,
        realtime_s=where.realtime_s,
        cursor=where.cursor,
        invocation_id=_string(entry.get("INVOCATION_ID")) or None,
        boot_id=where.boot_id,
        message=_display(text),
        **fields,
    )


def _fields_by_id(
    kind: EventKind, entry: Mapping[str, object], text: str | None
) -> dict[str, Any] | None:
    """The kind with the structured fields systemd attaches to that MESSAGE_ID."""
    match kind:
        case EventKind.MAIN_EXITED:
            if not _is_main_process(entry, text):
                return None
            code = _string(entry.get("EXIT_CODE")) or None
            status = _integer(entry.get("EXIT_STATUS"))
            return {
                "kind": kind,
                "exit_code": code,
                "exit_status": status,
                "signal": _signal_name(status) if code in {"killed", "dumped"} else None,
            }
        case EventKind.FAILED | EventKind.START_FAILED:
            field = "UNIT_RESULT" if kind is EventKind.FAILED else "JOB_RESULT"
            return {"kind": kind, "result": _string(entry.get(field)) or None}
        case EventKind.RESTART_SCHEDULED:
            return {"kind": kind, "n_restarts": _integer(entry.get("N_RESTARTS"))}
        case EventKind.STOPPING | EventKind.STOPPED:
            return {"kind": kind, "job_type": _string(entry.get("JOB_TYPE")) or None}
        case _:
            return {"kind": kind}


def _is_main_process(entry: Mapping[str, object], text: str | None) -> bool:
    """Whether a PROCESS_EXIT entry is about the main process, not a control/condition process.

    The text says which ("Main process exited" / "Control process exited"); COMMAND
    (``ExecStart``, ``ExecStartPre``…) decides when the text is missing or unfamiliar.
    """
    if text is not None:
        if _MAIN_EXIT in text:
            return True
        if _OTHER_EXIT.search(text):
            return False
    return _string(entry.get("COMMAND")) == "ExecStart"


def _fields_by_text(text: str, entry: Mapping[str, object]) -> dict[str, Any] | None:
    """The kind a PID-1 message without MESSAGE_ID reports, matched by its fixed text.

    systemd before 248 logged a main process's exit and a run's failure this way too: the
    structured fields it did attach (EXIT_CODE=, EXIT_STATUS=) win over the text's.
    """
    old = _pre_248_fields(text, entry)
    if old is not None:
        return old
    if match := _LEFT_OVER.search(text):
        return {
            "kind": EventKind.LEFT_OVER_PROCESS,
            "pid": int(match["pid"]),
            "comm": match["comm"],
        }
    if match := _STOP_TIMEOUT.search(text):
        return {"kind": EventKind.STOP_TIMED_OUT, "final": match["state"].startswith("final-")}
    if match := _SURVIVED.search(text):
        return {"kind": EventKind.SURVIVED_SIGKILL, "final": bool(match["final"])}
    if _START_LIMIT in text:
        return {"kind": EventKind.START_LIMIT_HIT}
    return None


def _pre_248_fields(text: str, entry: Mapping[str, object]) -> dict[str, Any] | None:
    """A main process's exit or a run's failure in the texts systemd logged before 248."""
    if match := _MAIN_EXIT_TEXT.search(text):
        code = _string(entry.get("EXIT_CODE")) or match["code"]
        status = _integer(entry.get("EXIT_STATUS"))
        status = int(match["status"]) if status is None else status
        return {
            "kind": EventKind.MAIN_EXITED,
            "exit_code": code,
            "exit_status": status,
            "signal": _signal_name(status) if code in {"killed", "dumped"} else None,
        }
    if match := _FAILED_TEXT.search(text):
        result = _string(entry.get("UNIT_RESULT")) or match["result"]
        return {"kind": EventKind.FAILED, "result": result}
    return None


def _is_unit_output(entry: Mapping[str, object], unit: str) -> bool:
    """Whether a process running in ``unit`` wrote this entry (stdout, journal or syslog)."""
    return (
        _string(entry.get("_SYSTEMD_UNIT")) == unit
        and _string(entry.get("_TRANSPORT")) in _OUTPUT_TRANSPORTS
        and _string(entry.get("_PID")) != "1"
    )


def _output_event(entry: Mapping[str, object], unit: str, where: _Where) -> UnitEvent | None:
    """A ``gpu-oom-output`` event when the unit's output says GPU memory was taken, else None."""
    text = decode_message(entry.get("MESSAGE"), limit=OUTPUT_SCAN_CHARS)
    if text is None:
        return None
    # One alternation first (cheap), then which signature it is (startfailure.classify).
    match = startfailure.classify(text) if _GPU_OOM.search(text) else None
    if match is None:
        return _engine_event(text, entry, unit, where)
    # The device is named near the message, before its phrases (vLLM) or after them (PyTorch);
    # a whole vLLM line matches its last fragment, so the window opens at its first (``first``).
    device = _DEVICE.search(text, max(0, match.first - 120), match.start + 400)
    # Keep the message in view when it sits late in a long line (tracebacks, log prefixes).
    start = max(0, match.first - 60)
    shown = text[start:] if start == 0 else "…" + text[start:]
    return UnitEvent(
        kind=EventKind.GPU_OOM_OUTPUT,
        unit=unit,
        monotonic_s=where.monotonic_s,
        realtime_s=where.realtime_s,
        cursor=where.cursor,
        invocation_id=_string(entry.get("_SYSTEMD_INVOCATION_ID")) or None,
        boot_id=where.boot_id,
        message=_display(shown),
        device=None if device is None else int(device.group(1)),
        failure=match.signature.failure,
        knob=match.signature.knob,
        signature=f"{match.signature.server}: {text[match.start : match.end]}",
    )


def _engine_event(
    text: str, entry: Mapping[str, object], unit: str, where: _Where
) -> UnitEvent | None:
    """An engine-fatal or start-phase event when the line is in core.enginelines, else None."""
    line = match_line(text)
    if line is None:
        return None
    return UnitEvent(
        kind=EventKind.START_PHASE if line.phase else EventKind.ENGINE_FATAL,
        unit=unit,
        monotonic_s=where.monotonic_s,
        realtime_s=where.realtime_s,
        cursor=where.cursor,
        invocation_id=_string(entry.get("_SYSTEMD_INVOCATION_ID")) or None,
        boot_id=where.boot_id,
        message=_display(text),
        line=line.key,
        sender_pid=_pid(entry.get("_PID")),
        sender_stream=_string(entry.get("_STREAM_ID")),
    )


def decode_message(value: object, *, limit: int | None = None) -> str | None:
    """The text of a MESSAGE as journalctl's JSON gives it, ANSI sequences removed; None if absent.

    A string stays a string; an array of byte values (non-printable or non-UTF-8 content) is
    decoded as UTF-8 with replacement characters; a field sent twice (an array of values) is
    joined with newlines; ``null`` (over 4096 bytes without ``--all``) and anything else is None.
    With ``limit``, only about the first ``limit`` characters are decoded and returned: the cost
    of a hostile megabyte line stays that of its first ``limit`` characters.
    """
    if isinstance(value, str):
        return _ANSI.sub("", value[:limit])[:limit]
    if isinstance(value, list) and value:
        head = value[: None if limit is None else 4 * limit]  # UTF-8: at most 4 bytes a char
        if all(_is_byte(item) for item in head):
            return _ANSI.sub("", bytes(head).decode("utf-8", errors="replace"))[:limit]
        parts = [decode_message(item, limit=limit) for item in value if not _is_byte(item)]
        if len(parts) == len(value) and all(part is not None for part in parts):
            return "\n".join(part for part in parts if part is not None)[:limit]
    return None


def _is_byte(item: object) -> bool:
    """Whether a JSON array element is a byte value (bool is an int in Python, and not one)."""
    return isinstance(item, int) and not isinstance(item, bool) and 0 <= item <= 255


def _display(text: str | None) -> str:
    """``text`` on one line for people: escaped (gpuguard.core.escaping), cut to MESSAGE_LIMIT."""
    return escape(text, MESSAGE_LIMIT) if text else ""


def _string(value: object) -> str | None:
    """A field's value when it is a single string (a field sent twice is an array: not trusted)."""
    return value if isinstance(value, str) else None


def _pid(value: object) -> int | None:
    """A ``_PID`` field as a PID (1 to 10 decimal digits), or None when absent or malformed."""
    text = _string(value)
    return int(text) if text is not None and _PID_TEXT.fullmatch(text) else None


def _integer(value: object) -> int | None:
    """A decimal field as an int, or None when absent or malformed."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and _INT.fullmatch(value):
        return int(value)
    return None


def _timestamp_s(value: object) -> float | None:
    """A journal timestamp (µs) in seconds; None when malformed, negative or past year 9999.

    Past 9999 no ``datetime`` can show it (``ValueError``), and no boot lasts that long.
    """
    micros = _integer(value)
    if micros is None or not 0 <= micros <= _MAX_REALTIME_US:
        return None
    return micros / 1_000_000


def _signal_name(number: int | None) -> str | None:
    """A signal number's name without ``SIG`` (``9`` → ``KILL``), None when unknown."""
    if number is None:
        return None
    try:
        return signal.Signals(number).name.removeprefix("SIG")
    except ValueError:
        return None
