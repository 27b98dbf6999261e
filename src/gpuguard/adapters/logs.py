"""Structured logging: JSON lines for journald (daemon, gate), a readable form for operators.

structlog costs about 120 ms to import, more than the whole gate fast path may spend, so it is
imported inside these functions only: importing this module (or ``gpuguard.adapters.reaper``,
which uses it) pulls in nothing heavy, and structlog loads the first time something is actually
logged.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from gpuguard.core.escaping import escape

if TYPE_CHECKING:
    from typing import TextIO

    from structlog.typing import EventDict, FilteringBoundLogger, Processor, WrappedLogger

_INFO = 20  # logging.INFO, spelled out so that the stdlib logging module need not be imported
# A text field's length in a log line. journald splits a line longer than LineMax (48K) into
# entries of their own, and the second would start with text a process chose.
FIELD_LIMIT = 2048


def escape_fields(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
    """Escape every text field, and every text in a list field, and bound its length.

    Fields carry command lines, process and unit names and reasons built from them; in the
    readable form they would reach the terminal raw, and in both forms an overlong one would
    let journald split the line.
    """
    for key, value in event.items():
        if isinstance(value, str):
            event[key] = escape(value, FIELD_LIMIT)
        elif isinstance(value, list | tuple):
            event[key] = [escape(v, FIELD_LIMIT) if isinstance(v, str) else v for v in value]
    return event


# Keys the readable form puts first, before every other (sorted): values gpuguard chose (the
# reaper's outcome and the PID it is about), so nothing a process chose comes before them on the
# line, and a reader of the line (explain, of the gate server's copy) takes them from there.
LEADING_FIELDS = ("outcome", "pid")


def lead_with_own_fields(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
    """Order the fields for the readable form: LEADING_FIELDS first, then the rest sorted."""
    first = {key: event[key] for key in LEADING_FIELDS if key in event}
    return first | {key: event[key] for key in sorted(event) if key not in first}


def configure_logging(json: bool, stream: TextIO | None = None) -> None:
    """Send every gpuguard log line to ``stream`` (standard error when None, looked up now).

    ``json=True`` writes one JSON object per line, which journald stores as the message and
    tools can parse; ``json=False`` writes ``key=value`` lines for a person at a terminal, the
    LEADING_FIELDS first.
    Lines below INFO are dropped. Text fields are escaped and bounded (``escape_fields``) in
    both forms, so a log line is one line whatever a process chose to call itself.
    """
    import structlog  # noqa: PLC0415 - structlog is slow to import; load it only when used

    out = sys.stderr if stream is None else stream
    processors: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        escape_fields,
    ]
    if json:
        processors += [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    else:
        processors += [
            lead_with_own_fields,
            structlog.dev.ConsoleRenderer(colors=out.isatty(), sort_keys=False),
        ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_INFO),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        # Not cached: tests swap the configuration (structlog.testing.capture_logs) at run time.
        cache_logger_on_first_use=False,
    )


def get_logger() -> FilteringBoundLogger:
    """Return the gpuguard logger as ``configure_logging`` set it up (else structlog's default)."""
    import structlog  # noqa: PLC0415 - structlog is slow to import; load it only when used

    logger: FilteringBoundLogger = structlog.get_logger("gpuguard")
    return logger
