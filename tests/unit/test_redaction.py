"""Secrets never reach our output; command lines print as one safe line."""

from __future__ import annotations

import string
import time
from typing import TYPE_CHECKING

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpuguard.core.redaction import REDACTED, display_command, redact_cmdline

if TYPE_CHECKING:
    from collections.abc import Callable

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


# -- the forms added for issue 10, and hostile input -----------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["curl", "-H", "Authorization: Bearer abc123", "http://x"],
            ("curl", "-H", f"Authorization: Bearer {REDACTED}", "http://x"),
        ),
        (["-H", "Authorization:Bearer", "abc"], ("-H", "Authorization:Bearer", REDACTED)),
        (["-H", "X-Api-Key: k1"], ("-H", f"X-Api-Key: {REDACTED}")),
        (
            ["--header=Authorization: Basic dXNlcg=="],
            (f"--header=Authorization: Basic {REDACTED}",),
        ),
        (["-H", "auth:xyz"], ("-H", f"auth:{REDACTED}")),
        (["Bearer", "tok"], ("Bearer", REDACTED)),
        (["--upstream", "authserver:8080"], ("--upstream", "authserver:8080")),
        (["--max-tokens:512"], ("--max-tokens:512",)),
    ],
)
def test_secret_headers_lose_their_credential(argv: list[str], expected: tuple[str, ...]) -> None:
    """`Authorization: Bearer …`, `X-Api-Key: …`: the scheme stays, the credential goes."""
    assert redact_cmdline(argv) == expected


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "https://h/x?token=abc&page=2&api_key=zz#frag",
            f"https://h/x?token={REDACTED}&page=2&api_key={REDACTED}#frag",
        ),
        (
            "--url=https://u:pw@h/p?access_token=q",
            f"--url=https://u:{REDACTED}@h/p?access_token={REDACTED}",
        ),
        ("http://h/?max_tokens=100&sig=1", "http://h/?max_tokens=100&sig=1"),
        ("http://h/?redirect=http://i/?key=k", f"http://h/?redirect=http://i/?key={REDACTED}"),
        ("http://h/?q=tokenizer", "http://h/?q=tokenizer"),
    ],
)
def test_secret_query_parameters_lose_their_value(url: str, expected: str) -> None:
    """`?token=…`, `&api_key=…` in a URL are hidden; counters and ordinary parameters stay."""
    assert redact_cmdline([url]) == (expected,)


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        (
            '{"hf_token": "hf_abc", "load_format": "auto"}',
            f'{{"hf_token": "{REDACTED}", "load_format": "auto"}}',
        ),
        (
            '--model-loader-extra-config={"hf_token":"hf_abc","max_tokens":100}',
            f'--model-loader-extra-config={{"hf_token":"{REDACTED}","max_tokens":100}}',
        ),
        ("{'api_key': 'x y z', 'ok': 1}", f"{{'api_key': '{REDACTED}', 'ok': 1}}"),
        ('{"password": 12345}', f'{{"password": {REDACTED}}}'),
        (
            '{"extra": "{\\"hf_token\\": \\"abc\\"}"}',
            f'{{"extra": "{{\\"hf_token\\": \\"{REDACTED}\\"}}"}}',
        ),
        ('{"token": "unterminated', f'{{"token": "{REDACTED}'),
        ('{"tokenizer": "/models/x"}', '{"tokenizer": "/models/x"}'),
    ],
)
def test_secret_json_values_are_hidden(arg: str, expected: str) -> None:
    """A JSON (or dict) value under a secret key is hidden, even escaped inside a string."""
    assert redact_cmdline(["vllm", "--model-loader-extra-config", arg]) == (
        "vllm",
        "--model-loader-extra-config",
        expected,
    )


def test_pem_blocks_are_hidden_in_one_argument_or_across_several() -> None:
    """A private key passed inline is hidden from its BEGIN label to its END marker."""
    inline = "-----BEGIN PRIVATE KEY-----\nMIIEabc\ndef\n-----END PRIVATE KEY-----"
    assert redact_cmdline(["--ssl-keyfile-data", inline]) == (
        "--ssl-keyfile-data",
        f"-----BEGIN{REDACTED}-----END PRIVATE KEY-----",
    )
    spread = ["echo", "-----BEGIN", "RSA", "PRIVATE", "KEY-----", "MIIE", "abc", "-----END"]
    assert redact_cmdline([*spread, "RSA", "PRIVATE", "KEY-----", "done"]) == (
        "echo",
        "-----BEGIN",
        *[REDACTED] * 5,
        "-----END",
        "RSA",
        "PRIVATE",
        "KEY-----",
        "done",
    )
    assert redact_cmdline(["-----BEGIN EC PRIVATE KEY-----MIIE", "more"]) == (
        f"-----BEGIN{REDACTED}",
        REDACTED,
    )


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["sshpass", "-p", "SECRET", "ssh", "h"], ("sshpass", "-p", REDACTED, "ssh", "h")),
        (["docker", "run", "-p", "8080:80"], ("docker", "run", "-p", "8080:80")),
        (["-p", "127.0.0.1:9000:9000/tcp"], ("-p", "127.0.0.1:9000:9000/tcp")),
        (["ssh", "-p", "2222", "h"], ("ssh", "-p", "2222", "h")),
        (["mkdir", "-p", "/var/run/x"], ("mkdir", "-p", "/var/run/x")),
        (["mkdir", "-p", "-v", "x"], ("mkdir", "-p", "-v", "x")),
        (["sh", "-c", "sshpass -p hunter2 ssh h"], ("sh", "-c", f"sshpass -p {REDACTED} ssh h")),
    ],
)
def test_short_password_option_is_hidden_but_ports_and_paths_stay(
    argv: list[str], expected: tuple[str, ...]
) -> None:
    """`-p SECRET` is hidden; `-p 8080:80` (ports) and `mkdir -p /x` (paths) are not secrets."""
    assert redact_cmdline(argv) == expected


def test_a_secret_flag_as_the_value_of_another_hides_both_readings() -> None:
    """`--api-key -token x`: "-token" may be the key or a flag of its own; both are hidden."""
    assert redact_cmdline(["--api-key", "-token", "x"]) == ("--api-key", REDACTED, REDACTED)


def test_nested_assignments_need_no_recursion() -> None:
    """`-a=-a=…` 128 KiB deep once raised RecursionError (status exit 1, every gate refused)."""
    deep = "-a=" * (128 * 1024 // 3)
    assert redact_cmdline([deep]) == (deep,)
    assert redact_cmdline(["-a=" * 1000 + "HF_TOKEN=x"]) == ("-a=" * 1000 + f"HF_TOKEN={REDACTED}",)
    # 43,690 levels to look at are past the budget: hidden whole rather than inspected.
    assert redact_cmdline([deep + "HF_TOKEN=x", "next"]) == (REDACTED, REDACTED)


def test_past_the_budget_everything_left_is_hidden() -> None:
    """Work is bounded: past 10,000 pieces inspected, whatever would need a look is hidden."""
    words = " ".join(["key"] * 12_000)
    out = redact_cmdline(["sh", "-c", words, "--port", "1", "--api-key", "k"])
    assert out[:2] == ("sh", "-c")
    shown = out[2].split(" ")
    assert len(shown) == 12_000
    assert set(shown[:9_000]) == {"key"}
    assert set(shown[-1_000:]) == {REDACTED}
    assert out[3:] == ("--port", "1", REDACTED, REDACTED)  # nothing to hide in the first two
    assert redact_cmdline(out) == out


def test_hostile_arguments_cost_their_length() -> None:
    """2 MiB of the inputs that were quadratic (128 KiB ending in "://", 83 s for status).

    Generous bound for a loaded machine: about 0.3 s here; the old pattern needed minutes.
    """
    arg = "a" * (128 * 1024 - 3) + "://"
    hostile = [arg, "x " + arg, '"k":' * 32768, "?token=" * 18724, "Authorization:" * 9362]
    started = time.perf_counter()
    out = redact_cmdline(hostile * 3)
    assert time.perf_counter() - started < 10
    assert out[:2] == (arg, "x " + arg)


_SECRET = st.text(alphabet=string.ascii_letters + string.digits, min_size=8, max_size=40).map(
    lambda tail: f"S3cr3t{tail}"
)
SECRET_FORMS: list[Callable[[str], list[str]]] = [
    lambda s: ["--api-key", s],
    lambda s: [f"--hf-token={s}"],
    lambda s: ["env", f"HF_TOKEN={s}", "python"],
    lambda s: ["docker", "run", "-e", f"OPENAI_API_KEY={s}"],
    lambda s: ["curl", "-H", f"Authorization: Bearer {s}"],
    lambda s: ["curl", "-H", f"X-Api-Key: {s}"],
    lambda s: [f"--header=Authorization: Basic {s}"],
    lambda s: [f"https://h/v1/models?token={s}&x=1"],
    lambda s: [f"https://h/?a=1&api_key={s}#f"],
    lambda s: [f"postgres://user:{s}@db:5432/x"],
    lambda s: ["--model-loader-extra-config", f'{{"hf_token": "{s}", "n": 1}}'],
    lambda s: [f"--cfg={{'api_key':'{s}'}}"],
    lambda s: [
        "--ssl-keyfile-data",
        f"-----BEGIN PRIVATE KEY-----\n{s}\n-----END PRIVATE KEY-----",
    ],
    lambda s: [
        "echo",
        "-----BEGIN",
        "RSA",
        "PRIVATE",
        "KEY-----",
        s,
        "-----END",
        "RSA",
        "KEY-----",
    ],
    lambda s: ["sshpass", "-p", s, "ssh", "h"],
    lambda s: ["sh", "-c", f"exec srv --api-key {s} --port 1"],
    lambda s: ["sh", "-c", f"curl -H 'Authorization: Bearer {s}' http://x/?key={s}"],
]
# Pieces that once made redaction recurse or backtrack, or that look like the start of a rule.
_HOSTILE_PIECES = [
    "-a=",
    "://",
    "a",
    '"k":',
    "'",
    '"',
    "\\",
    "?token=",
    "&key=",
    "-----BEGIN",
    "-----",
    "Authorization:",
    "Bearer ",
    "-p ",
    "key ",
    "{",
    ":",
    "@",
    "=",
    " ",
    "\n",
    "\x1b",
    "\udcff",
]
_PIECE = st.lists(st.sampled_from(_HOSTILE_PIECES), min_size=1, max_size=6).map("".join)
_HOSTILE_ARG = st.one_of(
    st.text(max_size=40),
    st.builds(
        lambda piece, size: (piece * (size // len(piece) + 1))[:size],
        _PIECE,
        st.integers(min_value=0, max_value=128 * 1024),
    ),
)
_HOSTILE_ARGV = st.lists(_HOSTILE_ARG, max_size=6)


@settings(max_examples=80, deadline=None)
@given(
    form=st.sampled_from(SECRET_FORMS),
    secret=_SECRET,
    prefix=_HOSTILE_ARGV,
    suffix=_HOSTILE_ARGV,
)
def test_secrets_never_appear_whatever_surrounds_them(
    form: Callable[[str], list[str]], secret: str, prefix: list[str], suffix: list[str]
) -> None:
    """Every supported form hides its secret among hostile arguments, redacted and displayed."""
    argv = [*prefix, *form(secret), *suffix]
    out = redact_cmdline(argv)
    assert len(out) == len(argv)
    assert not any(secret in arg for arg in out)
    assert secret not in display_command(argv)


# The smallest hostile argument whose redaction cost more budget than itself (rule 11): the
# first pass spent 4 pieces, the second one per "=" of "-p <redacted> -a=-a=…" and ran out.
_COSTLIER_AFTER_REDACTION = ["-p =x " + "-a=" * 9998]


def test_redaction_never_costs_more_budget_than_its_input() -> None:
    """A second pass over a redacted argument spends no more budget, so it hides nothing more."""
    once = redact_cmdline(_COSTLIER_AFTER_REDACTION)
    assert once == ("-p <redacted> " + "-a=" * 9998,)
    assert redact_cmdline(once) == once


@settings(max_examples=60, deadline=None)
@given(_HOSTILE_ARGV)
@example(_COSTLIER_AFTER_REDACTION)
def test_hostile_argv_is_total_idempotent_and_keeps_its_length(argv: list[str]) -> None:
    """Hostile arguments up to 128 KiB: no exception, same count, a second pass changes nothing."""
    once = redact_cmdline(argv)
    assert len(once) == len(argv)
    assert redact_cmdline(once) == once
    shown = display_command(argv, limit=1000)
    assert shown.isprintable()
    assert len(shown) <= 1000


@settings(max_examples=5, deadline=None)
@given(st.lists(_PIECE, min_size=1, max_size=3), st.sampled_from(SECRET_FORMS), _SECRET)
def test_two_mebibyte_command_lines_are_redacted(
    pieces: list[str], form: Callable[[str], list[str]], secret: str
) -> None:
    """16 arguments of 128 KiB (a 2 MiB command line) with a secret in the middle."""
    size = 128 * 1024 - 1
    filler = [(piece * (size // len(piece) + 1))[:size] for piece in pieces]
    argv = [*(filler * 8)[:8], *form(secret), *(filler * 8)[:8]]
    out = redact_cmdline(argv)
    assert len(out) == len(argv)
    assert not any(secret in arg for arg in out)
    assert display_command(argv).isprintable()
