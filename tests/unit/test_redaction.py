"""Secrets never reach our output; command lines print as one safe line."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.escaping import escape
from gpuguard.redaction import REDACTED, display_command, redact_cmdline

SECRET_FLAGS = [
    "--api-key",
    "--hf-token",
    "--token",
    "--password",
    "--passwd",
    "--secret",
    "--secret-file-contents",
    "--auth",
    "--authorization",
    "--openai-api-key",
    "--apikey",
    "--db-password",
    "--aws-secret-access-key",
    "--credentials",
    "--hf_token",
    "-token",
]


@pytest.mark.parametrize("flag", SECRET_FLAGS)
def test_secret_flag_value_is_redacted_in_both_forms(flag: str) -> None:
    """A secret flag's value is hidden whether it follows as an argument or after '='."""
    assert redact_cmdline([flag, "s3cr3t"]) == (flag, REDACTED)
    assert redact_cmdline([f"{flag}=s3cr3t"]) == (f"{flag}={REDACTED}",)


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-total-tokens", "4096"],
        ["--max-tokens=512"],
        ["--max-prefill-tokens", "16384"],
        ["--num-tokens", "7"],
        ["--chunked-prefill-size", "8192"],
        ["--tokenizer", "/models/llama"],
        ["--tokenizer-mode", "auto"],
        ["--skip-tokenizer-init"],
        ["--port", "30000"],
        ["--kv-cache-dtype", "fp8"],
        ["--monkeypatch", "yes"],
        ["MAX_TOKENS=100"],
        ["PATH=/usr/bin"],
        ["--context-length=32768"],
    ],
)
def test_ordinary_flags_and_counters_are_kept(argv: list[str]) -> None:
    """Limits like --max-total-tokens 4096 and words like --tokenizer are not secrets."""
    assert redact_cmdline(argv) == tuple(argv)


def test_counter_flag_with_a_non_number_is_still_redacted() -> None:
    """A token-counting flag keeps only numbers: anything else under it is hidden."""
    assert redact_cmdline(["--max-tokens", "sk-abc"]) == ("--max-tokens", REDACTED)
    assert redact_cmdline(["--max-tokens=sk-abc"]) == (f"--max-tokens={REDACTED}",)


def test_password_flags_never_get_the_counter_exception() -> None:
    """A password is hidden even when its name has a limit word and its value is a number."""
    assert redact_cmdline(["--max-password", "1234"]) == ("--max-password", REDACTED)


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        ("HF_TOKEN=hf_abc", f"HF_TOKEN={REDACTED}"),
        ("OPENAI_API_KEY=sk-1", f"OPENAI_API_KEY={REDACTED}"),
        ("HUGGING_FACE_HUB_TOKEN=x", f"HUGGING_FACE_HUB_TOKEN={REDACTED}"),
        ("AWS_SECRET_ACCESS_KEY=abc", f"AWS_SECRET_ACCESS_KEY={REDACTED}"),
        ("-e=HF_TOKEN=abc", f"-e=HF_TOKEN={REDACTED}"),
        ("CUDA_VISIBLE_DEVICES=0,1", "CUDA_VISIBLE_DEVICES=0,1"),
    ],
)
def test_secret_environment_assignments_are_redacted(arg: str, expected: str) -> None:
    """NAME=value arguments (env, docker -e) lose the value when NAME looks secret."""
    assert redact_cmdline([arg]) == (expected,)


def test_env_flag_followed_by_secret_assignment_is_redacted() -> None:
    """A `docker run -e HF_TOKEN=x` hides the token but keeps the variable name."""
    argv = ["docker", "run", "-e", "HF_TOKEN=hf_x", "img"]
    assert redact_cmdline(argv) == ("docker", "run", "-e", f"HF_TOKEN={REDACTED}", "img")


def test_url_password_is_redacted() -> None:
    """A password in a URL's user-info is hidden; user and host stay for diagnosis."""
    assert redact_cmdline(["--db=postgres://bob:hunter2@db:5432/x"]) == (
        f"--db=postgres://bob:{REDACTED}@db:5432/x",
    )


def test_secret_switch_followed_by_a_flag_consumes_nothing() -> None:
    """A secret-named switch followed by another --flag leaves that flag to be parsed itself."""
    argv = ["--use-auth", "--api-key", "k", "--port", "1"]
    assert redact_cmdline(argv) == ("--use-auth", "--api-key", REDACTED, "--port", "1")


def test_single_argument_command_lines_are_redacted_inside() -> None:
    """Both `sh -c` strings and setproctitle names are searched word by word."""
    argv = ["sh", "-c", "exec python -m sglang --api-key sk-1 --port 30000"]
    assert redact_cmdline(argv)[2] == f"exec python -m sglang --api-key {REDACTED} --port 30000"
    assert redact_cmdline(["sglang::scheduler --hf-token=x  "]) == (
        f"sglang::scheduler --hf-token={REDACTED}  ",
    )


def test_whole_argument_assignment_with_spaces_is_hidden_entirely() -> None:
    """A secret assignment whose value has spaces is hidden as a whole, not word by word."""
    assert redact_cmdline(["--api-key=a b c"]) == (f"--api-key={REDACTED}",)
    assert redact_cmdline(["HF_TOKEN=a b"]) == (f"HF_TOKEN={REDACTED}",)


_ARG = st.text(alphabet=string.printable + "é\u2028", max_size=20)
_VALUE = st.text(min_size=1, max_size=30).filter(lambda v: not v.startswith("--"))


@given(
    prefix=st.lists(_ARG, max_size=5),
    flag=st.sampled_from(SECRET_FLAGS),
    value=_VALUE,
    suffix=st.lists(_ARG, max_size=5),
)
def test_secret_flag_value_never_leaks(
    prefix: list[str], flag: str, value: str, suffix: list[str]
) -> None:
    """Whatever surrounds it, the argument after a secret flag is replaced."""
    out = redact_cmdline([*prefix, flag, value, *suffix])
    assert out[len(prefix) + 1] == REDACTED
    assert len(out) == len(prefix) + 2 + len(suffix)


@given(flag=st.sampled_from(SECRET_FLAGS), value=st.text(max_size=30))
def test_secret_flag_equals_value_never_leaks(flag: str, value: str) -> None:
    """A secret `--flag=value` never shows the value."""
    out = redact_cmdline([f"{flag}={value}"])
    assert out == (f"{flag}={REDACTED}",)


@given(st.lists(_ARG, max_size=8))
def test_redaction_is_idempotent_and_keeps_length(argv: list[str]) -> None:
    """Redacting twice changes nothing more, and the argument count never changes."""
    once = redact_cmdline(argv)
    assert len(once) == len(argv)
    assert redact_cmdline(once) == once


def test_display_command_escapes_newlines_and_terminal_escapes() -> None:
    """A hostile argv cannot start a new line or colour the terminal in our output."""
    text = display_command(["python", "x\nERROR forged line", "\x1b[31mred", "a b", "\u202e"])
    assert "\n" not in text
    assert "\x1b" not in text
    assert "\u202e" not in text
    assert text == "python 'x\\nERROR forged line' '\\x1b[31mred' 'a b' '\\u202e'"


def test_display_command_redacts() -> None:
    """display_command never shows a secret even when given an unredacted argv."""
    assert display_command(["srv", "--api-key", "sk-1"]) == f"srv --api-key '{REDACTED}'"


@given(st.lists(st.text(max_size=20), max_size=6))
def test_display_command_is_always_one_printable_line(argv: list[str]) -> None:
    """Any argv at all renders as a single line of printable characters."""
    assert display_command(argv).isprintable()


@given(st.text())
def test_escape_output_is_printable(text: str) -> None:
    """Escape always returns printable text."""
    assert escape(text).isprintable()
