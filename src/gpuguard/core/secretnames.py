"""Whether a name (a flag, a variable, a header, a JSON key, a query parameter) names a secret.

Rules 1 and 2 of redaction.py: a name is secret when one of its words (split on ``-``, ``_`` and
``.``) is or ends with a secret word, or starts with a secret prefix; a key/token name that
also has a limit word (``--max-total-tokens``) is a counter, and keeps its value when that
value is a number. Every other rule asks here before it hides anything.
"""

from __future__ import annotations

import re

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
# A value longer than this is never treated as a number (rule 2) or a port (rule 9).
SHORT_VALUE = 64
_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_WORD_SPLIT = re.compile(r"[-_.]+")


def secret_words(name: str) -> list[str]:
    """Return the words of a flag or variable name that make it look secret."""
    found: list[str] = []
    for word in _WORD_SPLIT.split(name.lower()):
        if not word:
            continue
        if word.endswith(_EXACT_OR_SUFFIX) or word.startswith(_PREFIXES):
            found.append(word)
    return found


def _is_counter(name: str, words: list[str]) -> bool:
    """Whether a key/token name is a limit (``--max-total-tokens``) rather than a credential."""
    if any(word not in _AMBIGUOUS for word in words):
        return False
    return any(word in _LIMIT_WORDS for word in _WORD_SPLIT.split(name.lower()))


def is_number(text: str, start: int = 0, end: int | None = None) -> bool:
    """Whether ``text[start:end]`` is a number; long texts never are (bounded work)."""
    stop = len(text) if end is None else end
    return stop - start <= SHORT_VALUE and _NUMBER.fullmatch(text, start, stop) is not None


def hides(name: str, numeric: bool) -> bool:
    """Whether a value given under ``name`` must be hidden (``numeric``: the value is a number)."""
    words = secret_words(name)
    if not words:
        return False
    return not (numeric and _is_counter(name, words))


def takes_value(arg: str) -> bool:
    """Whether ``arg`` is a bare ``--flag`` (or ``-flag``) whose name looks secret."""
    if not arg.startswith("-") or "=" in arg:
        return False
    return bool(secret_words(arg.lstrip("-")))
