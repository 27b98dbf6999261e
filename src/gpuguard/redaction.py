"""Remove secrets from command lines before anyone sees them, and print them safely.

Inference servers take credentials on the command line (``--api-key``, ``HF_TOKEN=…`` through
``env``), and gpuguard writes command lines to the journal, to ``/run/gpuguard`` and to the
terminal: a leaked key there is readable by every operator. Everything here is pure.

The rule, applied to each argument in turn:

1. A flag is *secret* when a word of its name (split on ``-``, ``_`` and ``.``) is a secret
   word: it is or ends with ``key``, ``token``, ``secret``, ``password``, ``passwd``, ``pwd``,
   ``passphrase``, ``credential(s)``, ``creds`` or ``cookie`` (plural forms included, so
   ``--apikey``, ``--hf-token``, ``--db-password``), or starts with ``secret``, ``auth``,
   ``passw`` or ``credential`` (``--authorization``, ``--secretfile``). Whole words only:
   ``--tokenizer`` and ``--monkeypatch`` are not secret.
2. Exception, for counters: when the only secret words are ``key``/``token`` forms (LLM servers
   count *tokens*) and the name also has a limit word (``max``, ``min``, ``num``, ``total``,
   ``limit``, ``budget``, ``size``, ``len``, ``count``, ``chunk``, ``batch``, ``prefill``, …),
   the value is kept *if it is a number*: ``--max-total-tokens 4096`` stays, while
   ``--max-tokens sk-abc`` is still redacted. ``password``/``secret``/``auth`` names never get
   the exception.
3. ``--flag=value`` becomes ``--flag=<redacted>``; ``--flag value`` redacts the next argument,
   unless that argument starts with ``--`` (then the secret flag was a switch and the next
   argument is a flag of its own, processed normally).
4. ``NAME=value`` (an environment assignment, as passed to ``env`` or ``docker run -e``) is
   redacted when ``NAME`` is secret by rules 1 and 2 (``HF_TOKEN=…``, ``OPENAI_API_KEY=…``).
5. ``scheme://user:password@host`` keeps the user and loses the password.
6. An argument containing whitespace (``sh -c "… --api-key X"``, or a process that rewrote its
   argv with setproctitle) is split on whitespace and the same rules apply to its words.
   Shell quoting inside it is not parsed, so a quoted secret containing spaces may leak its
   tail: the cost of not guessing at shell syntax.

Redaction keeps the number of arguments and is idempotent.
"""

from __future__ import annotations

import re
import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

REDACTED = "<redacted>"

_EXACT_OR_SUFFIX = (
    "key",
    "keys",
    "token",
    "tokens",
    "secret",
    "secrets",
    "password",
    "passwords",
    "passwd",
    "pwd",
    "passphrase",
    "credential",
    "credentials",
    "creds",
    "cookie",
    "cookies",
)
_PREFIXES = ("secret", "auth", "passw", "credential")
# Secret words that are also ordinary LLM-server vocabulary (token counts, cache keys).
_AMBIGUOUS = frozenset({"key", "keys", "token", "tokens"})
_LIMIT_WORDS = frozenset(
    {
        "max",
        "min",
        "num",
        "number",
        "total",
        "limit",
        "limits",
        "budget",
        "size",
        "len",
        "length",
        "count",
        "chunk",
        "chunked",
        "batch",
        "prefill",
        "per",
        "threshold",
        "ratio",
        "window",
        "context",
        "ctx",
        "reserve",
        "reserved",
    }
)
_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_WORD_SPLIT = re.compile(r"[-_.]+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/:@\s]*:)[^/@\s]+(?P<at>@)")
_WHITESPACE = re.compile(r"(\s+)")


def _secret_words(name: str) -> list[str]:
    """Return the words of a flag or variable name that make it look secret."""
    found: list[str] = []
    for word in _WORD_SPLIT.split(name.lower()):
        if not word:
            continue
        if word.endswith(_EXACT_OR_SUFFIX) or word.startswith(_PREFIXES):
            found.append(word)
    return found


def _is_counter(name: str, secret_words: list[str]) -> bool:
    """Whether a key/token name is a limit (``--max-total-tokens``) rather than a credential."""
    if any(word not in _AMBIGUOUS for word in secret_words):
        return False
    words = _WORD_SPLIT.split(name.lower())
    return any(word in _LIMIT_WORDS for word in words)


def _is_secret_name(name: str, value: str) -> bool:
    """Whether ``value`` given under ``name`` must be hidden."""
    words = _secret_words(name)
    if not words:
        return False
    return not (_is_counter(name, words) and _NUMBER.fullmatch(value) is not None)


def _takes_value(arg: str) -> bool:
    """Whether ``arg`` is a bare ``--flag`` (or ``-flag``) whose name looks secret."""
    if not arg.startswith("-") or "=" in arg:
        return False
    return bool(_secret_words(arg.lstrip("-")))


def _redact_assignment(arg: str) -> str | None:
    """Redact a whole ``--flag=value`` or ``NAME=value`` argument; None when it is not secret."""
    name, equals, value = arg.partition("=")
    if not equals or value == REDACTED:
        return None
    if not name.startswith("-"):
        secret = _ENV_NAME.fullmatch(name) is not None and _is_secret_name(name, value)
        return f"{name}={REDACTED}" if secret else None
    if _is_secret_name(name.lstrip("-"), value):
        return f"{name}={REDACTED}"
    # ``-e=HF_TOKEN=x``: the value may be a secret assignment of its own.
    inner = _redact_assignment(value)
    return None if inner is None else f"{name}={inner}"


def _redact_arg(arg: str) -> str:
    """Redact one argument on its own (without looking at its neighbours)."""
    whole = _redact_assignment(arg)
    if whole is not None:
        return whole
    if any(ch.isspace() for ch in arg):
        return _redact_spaced(arg)
    if "://" in arg:
        return _URL_PASSWORD.sub(lambda m: f"{m['head']}{REDACTED}{m['at']}", arg)
    return arg


def _redact_words(words: Sequence[str]) -> list[str]:
    """Apply the rules to a list of arguments, where a bare secret flag hides the next one."""
    out: list[str] = []
    pending_flag: str | None = None
    for word in words:
        if pending_flag is not None and word and not word.startswith("--"):
            out.append(REDACTED if _is_secret_name(pending_flag, word) else word)
            pending_flag = None
            continue
        pending_flag = None
        if _takes_value(word):
            pending_flag = word.lstrip("-")
            out.append(word)
        else:
            out.append(_redact_arg(word))
    return out


def _redact_spaced(arg: str) -> str:
    """Redact inside one argument that holds a whole command line (``sh -c``, setproctitle)."""
    parts = _WHITESPACE.split(arg)
    # Even indexes are words (possibly empty at the ends), odd ones the whitespace between them.
    parts[0::2] = _redact_words(parts[0::2])
    return "".join(parts)


def redact_cmdline(argv: Sequence[str]) -> tuple[str, ...]:
    """Return ``argv`` with the values of secret-looking flags and variables replaced.

    The result has exactly as many elements as ``argv``; see the module docstring for the rule.
    """
    return tuple(_redact_words(list(argv)))


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\x1b": "\\e"}


def _escape_char(ch: str) -> str:
    """Escape one non-printable character as a C-style escape."""
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def escape_control(text: str) -> str:
    """Return ``text`` with control, format and line-separator characters escaped.

    A process chooses its own name and argv: unescaped, a newline or terminal escape in them
    could forge lines in our journal entries, status screens and reports.
    """
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape_char(ch) for ch in text)


def display_command(argv: Sequence[str]) -> str:
    """Join a (redacted again, to be safe) command line into one printable line for humans.

    Arguments are shell-quoted where needed, then control characters are escaped, so the
    result never contains a newline or a terminal escape sequence.
    """
    return " ".join(escape_control(shlex.quote(arg)) for arg in redact_cmdline(argv))
