"""systemctl show and EnvironmentFile= parsing: what systemd prints, what a hostile file holds."""

from __future__ import annotations

import time

import pytest

from gpuguard.core.unitconfig import (
    ENV_FILE_MAX_BYTES,
    parse_environment_file,
    parse_show,
    parse_timespan,
)

# As systemd 252 prints it for a unit with the gate drop-in and an environment file.
SHOW = """\
LoadState=loaded
User=sglang
Type=notify
KillMode=process
TimeoutStopUSec=1min 30s
TimeoutStartUSec=10min
Restart=always
RestartUSec=100ms
StartLimitIntervalUSec=10s
StartLimitBurst=5
Environment=CUDA_VISIBLE_DEVICES=0,1 "PATH=/opt/venv/bin:/usr/bin" HF_HOME=/srv/hf
EnvironmentFiles=/etc/default/sglang (ignore_errors=no)
EnvironmentFiles=/srv/sglang/env (ignore_errors=yes)
ExecStartPre={ path=/usr/bin/gpuguard ; argv[]=/usr/bin/gpuguard gate --unit sglang.service ; \
ignore_errors=no ; start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; code=(null) ; status=0/0 }
DropInPaths=/etc/systemd/system/sglang.service.d/gpuguard-gate.conf \
/etc/systemd/system/sglang.service.d/override.conf
"""


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1min 30s", 90.0),
        ("100ms", 0.1),
        ("2h", 7200.0),
        ("5", 5.0),
        ("1d 2h 3min 4s 5ms", 93784.005),
        ("500us", 0.0005),
        ("1.5s", 1.5),
    ],
)
def test_timespans_systemd_prints_are_read(text: str, seconds: float) -> None:
    """Every unit systemd's format_timespan uses, alone and combined."""
    assert parse_timespan(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "infinity", "5 parsecs", "-1s", "s", "1min ;", "9" * 300])
def test_what_is_not_a_timespan_is_none(text: str) -> None:
    """No guess: an unknown unit or stray text makes the whole value unreadable."""
    assert parse_timespan(text) is None


def test_show_output_with_drop_ins_is_parsed() -> None:
    """Repeated keys (EnvironmentFiles=, ExecStartPre=) keep every value, in order."""
    config = parse_show("sglang.service", SHOW)
    assert config.load_state == "loaded"
    assert config.user == "sglang"
    assert config.kill_mode == "process"
    assert config.timeout_stop_s == 90.0
    assert config.timeout_start_s == 600.0
    assert config.restart == "always"
    assert config.restart_s == pytest.approx(0.1)
    assert config.start_limit_interval_s == 10.0
    assert config.start_limit_burst == 5
    assert config.environment == {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "PATH": "/opt/venv/bin:/usr/bin",
        "HF_HOME": "/srv/hf",
    }
    assert config.environment_files == (
        ("/etc/default/sglang", False),
        ("/srv/sglang/env", True),
    )
    assert config.exec_start_pre == (("/usr/bin/gpuguard", "gate", "--unit", "sglang.service"),)
    assert config.drop_in_paths == (
        "/etc/systemd/system/sglang.service.d/gpuguard-gate.conf",
        "/etc/systemd/system/sglang.service.d/override.conf",
    )
    assert config.unreadable == ()


def test_infinity_is_none_and_garbage_is_named() -> None:
    """TimeoutStopUSec=infinity means no timeout; an unreadable value is listed, not guessed."""
    config = parse_show("u.service", "TimeoutStopUSec=infinity\nRestartUSec=soon\n")
    assert config.timeout_stop_s is None
    assert config.restart_s is None
    assert config.unreadable == ("RestartUSec",)


def test_hostile_show_text_is_bounded_and_linear() -> None:
    """A megabyte Environment= and thousands of ExecStartPre= lines: cut, and fast."""
    text = "Environment=" + "A=" + "x" * 1_000_000 + "\n" + "ExecStartPre={ argv[]=/x }\n" * 10_000
    begun = time.perf_counter()
    config = parse_show("u.service", text)
    assert time.perf_counter() - begun < 2
    assert len(config.exec_start_pre) == 64
    assert len(config.environment["A"]) < 10_000


def test_environment_file_as_systemd_reads_it() -> None:
    """Comments, quotes, export, continuation lines; later assignments win."""
    data = (
        b"# comment\n"
        b"; also a comment\n"
        b"CUDA_VISIBLE_DEVICES=0\n"
        b"export PATH='/opt/venv/bin:/usr/bin'\n"
        b'LD_LIBRARY_PATH="/opt/lib \\"cuda\\""\n'
        b"LONG=one\\\n"
        b"two\n"
        b"not an assignment\n"
        b"1BAD=x\n"
        b"CUDA_VISIBLE_DEVICES=2,3\n"
    )
    assert parse_environment_file(data) == {
        "CUDA_VISIBLE_DEVICES": "2,3",
        "PATH": "/opt/venv/bin:/usr/bin",
        "LD_LIBRARY_PATH": '/opt/lib "cuda"',
        "LONG": "onetwo",
    }


def test_hostile_environment_file_is_total_and_bounded() -> None:
    """Invalid UTF-8, NULs, a file far over the limit, an endless continuation: no exception."""
    data = (
        b"\xff\xfe\x00A=\x1b[2J\n" + b"B=\\\n" * 100_000 + b"C=" + b"y" * (2 * ENV_FILE_MAX_BYTES)
    )
    begun = time.perf_counter()
    env = parse_environment_file(data)
    assert time.perf_counter() - begun < 2
    assert "C" not in env  # past ENV_FILE_MAX_BYTES: never read
    assert all(len(value) <= ENV_FILE_MAX_BYTES for value in env.values())
