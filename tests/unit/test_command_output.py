"""Commands return typed results; one renderer prints them (commands/output.py).

The results are checked as values, without capturing anything; only the renderer's own tests
read what it wrote. install-gate's choice of the file its drop-in runs is checked on real files
and directories (ownership and modes set by root; skipped without it where it needs it).
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

import pytest

from gpuguard.adapters.unitfacts import own_environment
from gpuguard.commands import explain, install_gate
from gpuguard.commands.output import Said, render
from gpuguard.config import Settings
from gpuguard.core.cgroup import Attribution
from gpuguard.core.gate.auth import Caller
from gpuguard.unitsettings import UnitSettings

if TYPE_CHECKING:
    from pathlib import Path


class _Documented:
    """A result with a document, as reap, explain, status and doctor have."""

    exit_status = 2
    notices = ("careful",)

    def to_text(self) -> str:
        return "text\n"

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": 1}


def test_render_writes_text_then_each_notice_on_one_escaped_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A notice quoting foreign text cannot forge a second line or reach the terminal raw."""
    said = Said(1, ("a.service: removed",), ("gpuguard: x\nOK: all idle\x1b[2K",))
    assert render(said) == 1
    written = capsys.readouterr()
    assert written.out == "a.service: removed\n"
    assert written.err == "gpuguard: x\\nOK: all idle\\x1b[2K\n"


def test_render_prints_the_document_under_json_and_the_text_otherwise(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--json prints the document instead of the text; the notices go to stderr either way."""
    assert render(_Documented(), as_json=True) == 2
    written = capsys.readouterr()
    assert json.loads(written.out) == {"schema_version": 1}
    assert written.err == "careful\n"
    assert render(_Documented()) == 2
    assert capsys.readouterr().out == "text\n"


def test_render_prints_text_under_json_when_there_is_no_document(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`status --prometheus --json` prints the metrics; a usage error under --json prints none."""
    assert render(Said(0, ("metric 1",)), as_json=True) == 0
    assert render(Said(64, notices=("usage",)), as_json=True) == 64
    written = capsys.readouterr()
    assert written.out == "metric 1\n"
    assert written.err == "usage\n"


def test_install_gate_refuses_a_name_that_is_no_service_as_a_usage_error() -> None:
    """Exit 64 before anything is asked or written; the name is shown by repr."""
    result = install_gate.run("sglang\n.socket", install=True)
    assert result.exit_status == 64
    assert result.lines == ()
    assert result.notices == (
        "gpuguard: 'sglang\\n.socket' is not a service unit name such as sglang.service",
    )


def _mode(path: Path, mode: int) -> None:
    path.chmod(mode)  # the modes under test, some deliberately too open


def _script(directory: Path) -> Path:
    directory.mkdir(exist_ok=True)
    _mode(directory, 0o755)  # exactly this mode, whatever the umask
    script = directory / "gpuguard"
    script.write_text("#!/bin/sh\n")
    _mode(script, 0o755)
    return script


def _refusal(result: str | Said) -> str:
    assert isinstance(result, Said), result
    assert result.exit_status == 1
    (notice,) = result.notices
    assert notice.startswith("gpuguard install-gate: not installed: the drop-in would run ")
    return notice


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the path must be root's alone")
def test_drop_in_runs_the_gpuguard_that_was_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """argv[0] named gpuguard, root's alone: that path, as given (a link is not resolved)."""
    script = _script(tmp_path / "bin")
    link = tmp_path / "gpuguard"
    link.symlink_to(script)
    monkeypatch.setattr(sys, "argv", [str(script), "install-gate"])
    assert install_gate.own_executable() == str(script)
    monkeypatch.setattr(sys, "argv", [str(link), "install-gate"])
    assert install_gate.own_executable() == str(link)


def test_python_m_gpuguard_runs_the_script_beside_its_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m gpuguard``: never a gpuguard found through PATH, which may be another one."""
    beside = _script(tmp_path / "venv")
    elsewhere = _script(tmp_path / "elsewhere")
    monkeypatch.setattr(sys, "argv", ["/x/gpuguard/__main__.py", "install-gate"])
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "python"))
    monkeypatch.setenv("PATH", str(elsewhere.parent))
    assert install_gate.own_executable() == str(beside)
    (tmp_path / "venv" / "gpuguard").unlink()
    notice = _refusal(install_gate.own_executable())
    assert f"{beside}: no such file" in notice


@pytest.mark.parametrize("directory", ["my env", "100%", "a\nExecStartPre=x", "$HOME", "b'c"])
def test_drop_in_path_is_written_only_when_systemd_reads_it_as_is(
    directory: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """White space, %, $, quotes or a newline would split, expand or add to the drop-in line."""
    script = _script(tmp_path / directory)
    monkeypatch.setattr(sys, "argv", [str(script)])
    assert "a path systemd would split or expand" in _refusal(install_gate.own_executable())


def test_drop_in_never_runs_a_file_someone_else_could_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group- or world-writable file or directory, another owner, not executable: refused."""
    if os.geteuid() != 0:
        pytest.skip("needs root: files of another owner, and install-gate's own rule (root's)")
    script = _script(tmp_path / "bin")
    monkeypatch.setattr(sys, "argv", [str(script)])
    _mode(script, 0o775)
    assert "writable by group or others" in _refusal(install_gate.own_executable())
    _mode(script, 0o644)
    assert f"{script}: not executable" in _refusal(install_gate.own_executable())
    _mode(script, 0o755)
    os.chown(script, 65534, 65534)
    assert "owned by uid 65534" in _refusal(install_gate.own_executable())
    os.chown(script, 0, 0)
    _mode(script.parent, 0o777)
    assert "directory writable by group or others" in _refusal(install_gate.own_executable())
    _mode(script.parent, 0o755)
    assert install_gate.own_executable() == str(script)


@pytest.mark.parametrize(
    ("unit", "since", "notice"),
    [
        (
            None,
            None,
            "gpuguard explain: name the unit with --unit (the configuration watches 2 units)",
        ),
        ("-x\x1b.service", None, "gpuguard explain: not a unit name: -x\\x1b.service"),
        ("a.service", "1h; rm", "gpuguard explain: --since 1h; rm: use journalctl's forms"),
    ],
)
def test_explain_usage_errors_are_results(unit: str | None, since: str | None, notice: str) -> None:
    """Decided before the journal is read: exit 64, one notice, nothing for stdout."""
    settings = Settings(units={"a.service": UnitSettings(), "b.service": UnitSettings()})
    result = explain.run(settings, unit, since)
    assert isinstance(result, Said)
    assert result.exit_status == 64
    assert result.to_text() == ""
    (said,) = result.notices
    assert said.startswith(notice)


def test_unit_environment_that_cannot_be_recorded_is_a_notice(tmp_path: Path) -> None:
    """The gate's caller runs in the unit: its environment is used, the failed record said."""
    if os.geteuid() != 0:
        pytest.skip("only root records the unit's GPU variables")
    blocked = tmp_path / "file"
    blocked.write_text("")
    environment = {"CUDA_VISIBLE_DEVICES": "1"}
    caller = Caller(4242, 1000, Attribution(unit="a.service"), environment)
    assert own_environment(caller, "a.service", tmp_path / "run") == (environment, None)
    found, problem = own_environment(caller, "a.service", blocked / "run")
    assert found == environment
    assert problem is not None
    assert problem.startswith("gpuguard: cannot record a.service's GPU variables: ")
    outside = Caller(4242, 1000, Attribution(unit="b.service"), environment)
    assert own_environment(outside, "a.service", blocked / "run") == (None, None)
