"""The timeline shown: the table and story as ``gpuguard explain`` prints them, and its JSON.

Times are UTC wall-clock stamps journald took (for people), the ``+s`` column the journal's
monotonic clock from the first row of the same boot; a long middle (a loop of hundreds of failed
starts) is elided in the text, while ``--json`` (format ``JSON_FORMAT``) has every row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from gpuguard.core.escaping import escape
from gpuguard.core.timeline.model import Row, Timeline, clock

if TYPE_CHECKING:
    from collections.abc import Sequence


_HEAD_ROWS: Final = 40
_TAIL_ROWS: Final = 40
_STORY_ITEMS: Final = 10
JSON_FORMAT: Final = 1


def render_text(timeline: Timeline, *, since: str | None) -> str:
    """The timeline as docs/e2e.md's tables read: time, seconds since the first row, who, what.

    Times are UTC wall-clock stamps journald took (for people); the ``+s`` column is the
    journal's monotonic clock, from the first row of the same boot. A long middle (a loop of
    hundreds of failed starts) is elided; ``--json`` has every row.
    """
    unit = escape(timeline.unit)
    span = f" since {escape(since, 80)}" if since else " (this boot)"
    if not timeline.rows:
        return f"gpuguard explain: {unit}: nothing in the journal{span}\n"
    lines = [
        f"gpuguard explain: {unit}{span}: {len(timeline.rows)} rows",
        (
            "  systemd = PID 1 (journald's trusted fields); unit = the unit's own output, its "
            "word only; gpuguard = gpuguard.service or gpuguard-gate.service as root, or its "
            "release log; "
            "kernel = Xids; would = gpuguard's detector replayed"
        ),
        "",
        f"  {'TIME (UTC)':<12} {'+S':>8}  {'SOURCE':<8}  {'KIND':<22}  TEXT",
    ]
    rendered = _table(timeline.rows)
    if len(rendered) > _HEAD_ROWS + _TAIL_ROWS:
        hidden = len(rendered) - _HEAD_ROWS - _TAIL_ROWS
        rendered = [
            *rendered[:_HEAD_ROWS],
            f"  {'':12} … {hidden} more rows (see --json) …",
            *rendered[-_TAIL_ROWS:],
        ]
    lines += rendered
    lines += ["", *_story_lines(timeline)]
    return "\n".join(lines) + "\n"


def _table(rows: Sequence[Row]) -> list[str]:
    first: dict[str | None, float] = {}
    out: list[str] = []
    for row in rows:
        base = first.setdefault(row.boot_id, row.monotonic_s)
        out.append(
            f"  {clock(row.realtime_s):<12} {row.monotonic_s - base:>+8.2f}  {row.source:<8}  "
            f"{row.kind:<22}  {row.text}"
        )
    return out


def _block(lines: list[str], title: str, items: Sequence[str], none: str | None) -> None:
    """One block of the story; ``none``: what an empty block says (None: nothing)."""
    if not items:
        if none is not None:
            lines.append(f"  {title}: {none}")
        return
    lines.append(f"  {title}: {len(items)}")
    lines.extend(f"    {item}" for item in items[:_STORY_ITEMS])
    if len(items) > _STORY_ITEMS:
        lines.append(f"    … {len(items) - _STORY_ITEMS} more (see --json)")


def _story_lines(timeline: Timeline) -> list[str]:
    story = timeline.story
    lines = ["What happened:"]

    def block(title: str, items: Sequence[str], none: str | None) -> None:
        _block(lines, title, items, none)

    block("stops that timed out", story.stop_timeouts, "none")
    # systemd names each task it kills "process": on cgroup v2 its SIGKILL walks cgroup.procs,
    # then cgroup.threads (facts.md §4.9), so a vLLM's threads (pt_gloo_runloop, ZMQbg/Reaper)
    # are lines of their own: tasks, not processes.
    block("tasks systemd SIGKILLed (processes and their threads)", story.sigkilled, "none")
    if story.survivors and story.survivor_pids != len(story.survivors):
        # Not counted: lines without a PID (systemd's "Processes still around after SIGKILL"),
        # and the PIDs only the server's own out-of-memory lines name (its word).
        counted = story.survivor_pids
        lines.append(f"  survivors and left-overs: {counted} PID{'' if counted == 1 else 's'}")
        lines.extend(f"    {item}" for item in story.survivors[:_STORY_ITEMS])
        if len(story.survivors) > _STORY_ITEMS:
            lines.append(f"    … {len(story.survivors) - _STORY_ITEMS} more (see --json)")
    else:
        block("survivors and left-overs", story.survivors, "none seen in the journal")
    block("failed starts", story.failed_starts, "none")
    block("crashes after the server was ready (no failed start)", story.crashes, None)
    if story.start_limit:
        block("systemd ended a restart loop (start limit)", story.start_limit, "")
    block("stopped on request (never a loop)", story.operator, "none")
    if story.findings:
        block("findings (no loop)", story.findings, "")
    if timeline.gpuguard_seen:
        block("what gpuguard decided and did", story.gpuguard, "only verdicts and signals")
    else:
        lines.append("  gpuguard: left no line in this journal (not installed or not running)")
        looping = story.verdict.startswith("restart loop")
        block(
            "what gpuguard would have done",
            story.would,
            "nothing" if looping or story.start_limit else "nothing: no restart loop",
        )
    block("GPU memory released after a reap", story.released, "none in the release log")
    block(
        "failed starts gpuguard prevented",
        (story.prevented or "",)[: bool(story.prevented)],
        "none",
    )
    lines.append(f"  verdict (gpuguard's detector on these entries): {story.verdict}")
    if story.disagreements:
        block("where the daemon's logged verdict differs", story.disagreements, "")
    lines.append(f"  healthy: {story.healthy or 'no run started and stayed up in the journal'}")
    return lines


def to_json(timeline: Timeline, *, since: str | None) -> dict[str, object]:
    """The timeline for tools: every row, and the story."""
    story = timeline.story
    return {
        "format": JSON_FORMAT,
        "unit": timeline.unit,
        "since": since,
        "gpuguard_seen": timeline.gpuguard_seen,
        "rows": [
            {
                "realtime_s": row.realtime_s,
                "monotonic_s": row.monotonic_s,
                "boot_id": row.boot_id,
                "source": row.source,
                "kind": row.kind,
                "run": row.run,
                "text": row.text,
            }
            for row in timeline.rows
        ],
        "story": {
            "stop_timeouts": list(story.stop_timeouts),
            "sigkilled": list(story.sigkilled),
            "survivors": list(story.survivors),
            "survivor_pids": story.survivor_pids,
            "failed_starts": list(story.failed_starts),
            "crashes": list(story.crashes),
            "gpuguard": list(story.gpuguard),
            "would": list(story.would),
            "healthy": story.healthy,
            "start_limit": list(story.start_limit),
            "operator": list(story.operator),
            "findings": list(story.findings),
            "verdict": story.verdict,
            "disagreements": list(story.disagreements),
            "released": list(story.released),
            "prevented": story.prevented,
        },
    }
