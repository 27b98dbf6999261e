"""The man page (docs/gpuguard.8.md, the CLI reference) and the docs agree with the parser.

The parser is walked: every command and every option it accepts must appear in the man page's
SYNOPSIS and be described, and every command's exit codes must be the same in its --help, in
the man page's EXIT STATUS and in its docs/ page, so help, man page and docs cannot drift apart.
"""

from __future__ import annotations

import argparse
import configparser
import re
from pathlib import Path

import pytest

from gpuguard import cli
from gpuguard.core.exits import EX_CONFIG, EX_USAGE

ROOT = Path(__file__).resolve().parents[2]
MAN = (ROOT / "docs" / "gpuguard.8.md").read_text()
# The docs/ page that documents each command's exit status in prose.
PAGES = {
    "status": "status.md",
    "gate": "gate.md",
    "reap": "reap.md",
    "run": "daemon.md",
    "doctor": "doctor.md",
}
GLOBAL_CODES = {EX_USAGE, EX_CONFIG}
_CODE = re.compile(r"(?:^|[;:,(|]|\*\*|\s-)\s*(\d{1,3})\b(?!\s*(?:s\b|MiB|KiB|%))", re.MULTILINE)


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """The long options a parser accepts, without --help and the global options."""
    return {
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option not in {"--help", "--config"}
    }


def _section(text: str, heading: str) -> str:
    """The body of a ``# HEADING`` section of the man page."""
    match = re.search(rf"^# {heading}\n(.*?)(?=^# |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"no section {heading!r} in docs/gpuguard.8.md"
    return match.group(1)


def _entries(section: str) -> dict[str, str]:
    """A definition list (``**name**`` line, then ``:   text``) by each name its heading has."""
    entries: dict[str, str] = {}
    for block in re.split(r"\n(?=[^\s:])", section.strip()):
        heading, _, body = block.partition("\n")
        for name in re.findall(r"\*\*([a-z-]+)\*\*", heading) or [heading.strip()]:
            entries[name] = heading + "\n" + body
    return entries


def _codes(text: str) -> set[int]:
    return {int(code) for code in _CODE.findall(text)}


def _help_exit_codes(parser: argparse.ArgumentParser) -> set[int]:
    """The codes in the 'Exit status' paragraph of a command's --help."""
    description = parser.description or ""
    start = description.index("Exit status")
    return _codes(description[start:].split("\n\n")[0])


def _page_exit_codes(page: str) -> set[int]:
    """The codes in a docs/ page's 'Exit status' section or paragraph."""
    text = (ROOT / "docs" / page).read_text()
    match = re.search(r"^## Exit status\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    if match:
        return _codes(match.group(1))
    start = text.index("Exit status:")
    return _codes(text[start:].split("\n\n")[0])


COMMANDS = sorted(_commands())


def test_the_parser_has_the_commands_this_test_walks() -> None:
    """A positive control: the walk below sees every command (a renamed one fails here)."""
    assert set(COMMANDS) >= {"status", "gate", "reap", "run", "doctor", "install-gate"}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_of_a_command_is_in_its_synopsis_line(name: str) -> None:
    """The SYNOPSIS line naming the command lists each option the parser accepts for it."""
    lines = [
        line
        for line in _section(MAN, "SYNOPSIS").splitlines()
        if re.search(rf"\*\*{re.escape(name)}\*\*", line)
    ]
    assert lines, f"{name} is missing from SYNOPSIS"
    for option in _options(_commands()[name]):
        assert any(f"**{option}**" in line for line in lines), f"{name} {option} not in SYNOPSIS"


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_and_option_is_described(name: str) -> None:
    """Each command has a COMMANDS entry; each of its options is explained there or in OPTIONS."""
    entries = _entries(_section(MAN, "COMMANDS"))
    assert name in entries, f"{name} has no entry under COMMANDS"
    options = _section(MAN, "OPTIONS")
    for option in _options(_commands()[name]):
        described = f"**{option}**" in entries[name] or f"**{option}**" in options
        assert described, f"{name} {option} is described nowhere in the man page"


def test_the_global_options_are_described() -> None:
    """--config, --version and --help are in OPTIONS, --config also after the command."""
    options = _section(MAN, "OPTIONS")
    for option in ("--config", "--version", "--help"):
        assert f"**{option}**" in options
    assert "after the command" in " ".join(options.split())


@pytest.mark.parametrize("name", COMMANDS)
def test_exit_codes_agree_between_help_and_man_page(name: str) -> None:
    """A command's --help and its EXIT STATUS entry name the same codes (64 and 78 for all)."""
    entries = _entries(_section(MAN, "EXIT STATUS"))
    assert _codes(entries["all commands"]) == GLOBAL_CODES
    assert name in entries, f"{name} has no entry under EXIT STATUS"
    man = _codes(entries[name].partition("\n")[2]) | GLOBAL_CODES
    assert _help_exit_codes(_commands()[name]) | GLOBAL_CODES == man


@pytest.mark.parametrize("name", sorted(PAGES))
def test_exit_codes_agree_between_man_page_and_docs(name: str) -> None:
    """The docs/ page of a command names the codes its EXIT STATUS entry names."""
    entries = _entries(_section(MAN, "EXIT STATUS"))
    man = _codes(entries[name].partition("\n")[2]) | GLOBAL_CODES
    assert _page_exit_codes(PAGES[name]) | GLOBAL_CODES == man


def test_the_code_extraction_can_tell_codes_apart() -> None:
    """A positive control for the comparison above: different lists give different sets."""
    assert _codes("Exit status: 0 idle; 1 busy; 77 not root.") == {0, 1, 77}
    assert _codes("**0** OK, **2** CRITICAL; waits 10 s") == {0, 2}
    assert _codes("| 3 | UNKNOWN | at most 64 KiB |") == {3}
    assert _codes("the worst finding - 0 OK, 1 WARNING") == {0, 1}


@pytest.mark.parametrize(
    "argv",
    [["--bogus"], ["status", "--bogus"], ["gate"], ["reap", "--scope", "everything"], []],
)
def test_a_usage_error_exits_64(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Errors argparse finds exit 64 like gpuguard's own (no command at all prints the help)."""
    try:
        status: int | str | None = cli.main(argv)
    except SystemExit as exited:
        status = exited.code
    assert status == EX_USAGE
    out, err = capsys.readouterr()
    assert "usage: gpuguard" in (err if argv else out)


def test_config_is_accepted_after_the_command_too(tmp_path: Path) -> None:
    """``gpuguard status --config FILE`` reads FILE; before the command it still wins if alone."""
    parser = cli.build_parser()
    after = parser.parse_args(["status", "--config", str(tmp_path / "a.toml")])
    before = parser.parse_args(["--config", str(tmp_path / "b.toml"), "status", "--json"])
    neither = parser.parse_args(["status"])
    assert after.config == tmp_path / "a.toml"
    assert before.config == tmp_path / "b.toml"
    assert neither.config is None


def test_the_daemon_unit_does_not_restart_on_usage_or_config_errors() -> None:
    """gpuguard.service's RestartPreventExitStatus= holds the codes the CLI uses for both."""
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(ROOT / "systemd" / "gpuguard.service")
    prevented = {int(code) for code in unit["Service"]["RestartPreventExitStatus"].split()}
    assert prevented >= GLOBAL_CODES


def test_no_help_line_is_cut_mid_sentence() -> None:
    """A command's one-line help in the command list is a whole phrase, never a cut sentence."""
    parser = cli.build_parser()
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for choice in action._choices_actions:
        text = choice.help or ""
        assert text, f"{choice.dest} has no help"
        assert not re.search(r"\b(?:and|or|then|the|a|to|of|run|for|that)$", text), text


def test_the_help_points_at_installed_documentation() -> None:
    """No help text sends an operator to the source tree's docs/ folder."""
    texts = [cli.build_parser().format_help()]
    texts += [command.format_help() for command in _commands().values()]
    for text in texts:
        assert "source tree" not in text
        assert not re.search(r"(?<![/\w])docs/", text), text
