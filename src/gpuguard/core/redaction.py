"""Remove secrets from command lines before anyone sees them, and print them safely.

Inference servers take credentials on the command line (``--api-key``, ``HF_TOKEN=…`` through
``env``, a JSON ``--model-loader-extra-config``, a URL with ``?token=``), and gpuguard writes
command lines to the journal, to ``/run/gpuguard`` and to the terminal: a leaked key there is
readable by every operator. Everything here is pure; which names are secret (rules 1 and 2)
is secretnames.py's, the rest is here.

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
   argument is a flag of its own, processed normally). A next argument that is itself a
   secret flag (``--api-key -token x``) is hidden *and* hides the one after it.
4. ``NAME=value`` (an environment assignment, as passed to ``env`` or ``docker run -e``) is
   redacted when ``NAME`` is secret by rules 1 and 2 (``HF_TOKEN=…``, ``OPENAI_API_KEY=…``).
5. ``scheme://user:password@host`` keeps the user and loses the password; in a query string
   (``?token=…``, ``&api_key=…``) a secret parameter loses its value.
6. HTTP headers with a secret name (``Authorization: Bearer x``, ``X-Api-Key: x``) lose their
   value; an authentication scheme word (``Bearer``, ``Basic``, …) stays and the credential
   after it goes. ``Bearer`` alone hides the next word too.
7. In JSON or Python-dict text (``{"hf_token": "x"}``, also escaped inside another string), a
   secret key's value is hidden, under rules 1 and 2.
8. A PEM block (``-----BEGIN RSA PRIVATE KEY-----`` … ``-----END RSA PRIVATE KEY-----``) is
   hidden from its BEGIN label to its END marker, in one argument or spread over several:
   ``-----BEGIN<redacted>-----END RSA PRIVATE KEY-----``; an unterminated one to the end.
9. ``-p VALUE`` (the short password option of sshpass and others) hides VALUE unless it looks
   like a port or port mapping (digits, ``.``, ``:``, ``[``, ``]``, ``-``, ``/tcp``), or a path
   (``mkdir -p /x``): a password of digits only is shown. Glued forms (``-pSECRET``) are not
   recognised: ``find -print`` and ``-perm`` look the same.
10. An argument containing whitespace (``sh -c "… --api-key X"``, or a process that rewrote its
    argv with setproctitle) is split on whitespace and the same rules apply to its words.
    Shell quoting inside it is not parsed, so a quoted secret containing spaces may leak its
    tail: the cost of not guessing at shell syntax.
11. The work is bounded: a command line gets 10,000 pieces inspected one by one (a word that
    may hold a secret, a nested ``=``, a JSON key, a query parameter; a real command line has
    a few hundred). Past that, the rest of the argument being inspected and every later word
    that would need a look are hidden whole. A word with none of the rules' trigger texts
    (``key``, ``token``, ``secret``, ``pass``, ``pwd``, ``cred``, ``cookie``, ``auth``,
    ``bearer``, ``://``, a lone ``-p``) costs a few substring scans and is shown as it is.

Redaction keeps the number of arguments and is idempotent. It is linear in the length of the
command line: no recursion, and every regular expression is anchored at a delimiter and bounded
or possessive, so a hostile argument (``-a=-a=…``, 128 KiB of ``a`` ending in ``://``) costs what
its length costs, and rule 11 caps what that is.
"""

from __future__ import annotations

import re
import shlex
from typing import TYPE_CHECKING

from gpuguard.core.escaping import escape
from gpuguard.core.secretnames import SHORT_VALUE, hides, is_number, secret_words, takes_value

if TYPE_CHECKING:
    from collections.abc import Sequence

REDACTED = "<redacted>"

# Pieces of one command line inspected one by one (rule 11): each costs a few microseconds of
# Python, a real command line has a few hundred, a hostile 2 MiB one could have a million.
_BUDGET = 10_000
_PORTISH = re.compile(r"[0-9.:\[\]-]+(?:/(?:tcp|udp|sctp))?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_WHITESPACE = re.compile(r"(\s+)")
# Every rule needs one of these in the (lower-cased) text: a word without any is kept as it is
# after a few substring scans in C, which keeps ordinary long arguments cheap.
_TRIGGERS = ("key", "token", "secret", "pass", "pwd", "cred", "cookie", "auth", "bearer", "://")
_SHORT_P = re.compile(r"(?:^|\s)-p(?:\s|$)")
_ANY_WHITESPACE = re.compile(r"\s")
# No possessive quantifiers (Python 3.10's re has none, so Ubuntu 22.04 would fail at import):
# each repeated class below excludes the character that must follow it, or ends the pattern, so
# a plain greedy repeat can give nothing back that would match: the same matches, the same cost.
# "://", user, ":", password, "@". Neither part can hold "/", so the spans that two "://" in
# one argument scan never overlap: linear, unlike a pattern that also matched the scheme.
_URL_PASSWORD = re.compile(r"://[^/:@\s]*:(?P<password>[^/@\s]+)@")
# Query parameters: the name is bounded and cannot hold the separators that start another.
_QUERY_KEY = re.compile(r"[?&](?P<name>[A-Za-z0-9_.\[\]-]{1,128})=")
_QUERY_VALUE = re.compile(r"[^&#\s]*")
# A JSON or dict key (possibly inside an escaped string: \"hf_token\") and its colon.
_JSON_KEY = re.compile(r"""(?P<quote>["'])(?P<name>[A-Za-z0-9_.-]{1,128})\\*(?P=quote)\s*:\s*""")
_JSON_BARE_VALUE = re.compile(r"""[^\s,}\]"'\\]*""")
# A header word: an optional "--flag=" or shell quote in front, the name, a colon, the rest.
# A word starting with "-" can only be read with the flag, any other only without: one reading.
_HEADER = re.compile(
    r"""(?:-[A-Za-z0-9_-]{0,127}=)?["']?(?P<name>[A-Za-z][A-Za-z0-9-]{0,127}):(?P<rest>.*)""",
    re.DOTALL,
)
_AUTH_SCHEMES = frozenset({"bearer", "basic", "digest", "token", "negotiate", "apikey"})
_PATH_START = ("/", "./", "../", "~")
_PEM_BEGIN = "-----BEGIN"
_PEM_END = "-----END"


class _BudgetSpentError(Exception):
    """The budget of one command line is spent: what is being inspected is hidden whole."""


class _Budget:
    """How many more pieces of one command line may be inspected one by one (rule 11)."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = _BUDGET

    def spend(self) -> None:
        """Count one piece; raise _BudgetSpentError once there were too many."""
        self.left -= 1
        if self.left < 0:
            raise _BudgetSpentError


# A word that announces a secret next word: its kind ("flag", "header", "credential", "short")
# and the name the value is given under.
_Pending = tuple[str, str]


def _redact_assignment(arg: str, budget: _Budget) -> str | None:
    """Redact a whole ``--flag=value`` or ``NAME=value`` argument; None when it is not secret.

    ``-e=HF_TOKEN=x`` nests: while the name is a flag that is not secret, its value is looked
    at as an assignment of its own. A loop over positions, so ``-a=-a=…`` costs its length.
    A name with whitespace in it is no name (rule 10 looks at the words): without this stop,
    ``-p =x -a=-a=…`` would cost 2 pieces but its redaction ``-p <redacted> -a=-a=…`` one per
    ``=``, and a second pass could run out of budget where the first did not (not idempotent).
    """
    pos = 0
    while True:
        equals = arg.find("=", pos)
        if equals < 0 or _ANY_WHITESPACE.search(arg, pos, equals) is not None:
            return None
        budget.spend()
        start = equals + 1
        name = arg[pos:equals]
        numeric = is_number(arg, start)
        if not name.startswith("-"):
            secret = _ENV_NAME.fullmatch(name) is not None and hides(name, numeric)
            return arg[:start] + REDACTED if secret else None
        if hides(name.lstrip("-"), numeric):
            return arg[:start] + REDACTED
        pos = start


def _redact_json(arg: str, budget: _Budget) -> str:
    """Hide the values of secret keys in JSON or dict text (rule 7).

    A key that is not secret consumes only itself, so a value holding more JSON is searched too.
    """
    pieces: list[str] = []
    done = 0
    pos = 0
    while (match := _JSON_KEY.search(arg, pos)) is not None:
        budget.spend()
        pos = match.end()
        name = match["name"]
        if not secret_words(name):
            continue
        start, end, after = _json_value(arg, pos)
        if end == start or not hides(name, is_number(arg, start, end)):
            continue
        if arg[start:end] != REDACTED:
            pieces += (arg[done:start], REDACTED)
            done = end
        pos = after
    if not pieces:
        return arg
    pieces.append(arg[done:])
    return "".join(pieces)


def _json_value(arg: str, pos: int) -> tuple[int, int, int]:
    """The span of the value that starts at ``pos`` and where scanning resumes after it.

    A quoted value ends at the next quote of its kind (backslashes that escape that quote stay
    outside the span); an unterminated one runs to the end. A bare value (number, ``true``) ends
    at whitespace, a comma, a bracket or a quote.
    """
    quote_at = pos
    while quote_at < len(arg) and arg[quote_at] == "\\":
        quote_at += 1
    if quote_at < len(arg) and arg[quote_at] in "\"'":
        start = quote_at + 1
        close = arg.find(arg[quote_at], start)
        end = len(arg) if close < 0 else close
        after = end
        while end > start and arg[end - 1] == "\\":
            end -= 1
        return start, end, after
    bare = _JSON_BARE_VALUE.match(arg, pos)
    end = pos if bare is None else bare.end()
    return pos, end, end


def _redact_url(word: str, budget: _Budget) -> str:
    """Hide URL passwords and secret query parameters in one word (rule 5)."""
    if "://" in word:
        word = _replace_spans(word, _url_password_spans(word))
    if "=" in word and ("?" in word or "&" in word):
        word = _replace_spans(word, _query_spans(word, budget))
    return word


def _url_password_spans(word: str) -> list[tuple[int, int]]:
    return [match.span("password") for match in _URL_PASSWORD.finditer(word)]


def _query_spans(word: str, budget: _Budget) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    pos = 0
    while (match := _QUERY_KEY.search(word, pos)) is not None:
        budget.spend()
        pos = match.end()
        value = _QUERY_VALUE.match(word, pos)
        end = pos if value is None else value.end()
        if hides(match["name"], is_number(word, pos, end)):
            spans.append((pos, end))
            pos = end
    return spans


def _replace_spans(text: str, spans: list[tuple[int, int]]) -> str:
    """``text`` with each (ordered, disjoint) non-empty span replaced by REDACTED."""
    pieces: list[str] = []
    done = 0
    for start, end in spans:
        if end > start:
            pieces += (text[done:start], REDACTED)
            done = end
    pieces.append(text[done:])
    return "".join(pieces)


def _redact_arg(arg: str, budget: _Budget) -> str:
    """Redact one argument on its own (without looking at its neighbours)."""
    whole = _redact_assignment(arg, budget)
    if whole is not None:
        return whole
    if "'" in arg or '"' in arg:
        arg = _redact_json(arg, budget)
    if _ANY_WHITESPACE.search(arg):
        return _redact_spaced(arg, budget)
    return _redact_url(arg, budget)


def _header(word: str) -> tuple[str, _Pending | None] | None:
    """A secret header in ``word`` (rule 6): the word to show and what the next word is.

    None when ``word`` is no secret header. The pending value is ("header", name) when the
    value follows in the next word, ("credential", "") after a scheme word, None when the word
    held it all.
    """
    match = _HEADER.match(word)
    if match is None or not secret_words(match["name"]):
        return None
    name, rest = match["name"], match["rest"]
    if not rest:
        return word, ("header", name)
    if rest.lower() in _AUTH_SCHEMES:
        return word, ("credential", "")
    # auth://…, authserver:8080, and counters (max-tokens:512) are no credentials.
    if rest.startswith("/") or rest.isdecimal() or not hides(name, is_number(rest)):
        return None
    return word[: match.start("rest")] + REDACTED, None


def _keeps_short_value(value: str) -> bool:
    """Whether the value after ``-p`` is shown: a port, a port mapping or a path (rule 9)."""
    if value.startswith(_PATH_START):
        return True
    short = len(value) <= SHORT_VALUE
    return short and _PORTISH.fullmatch(value) is not None and any(c.isdigit() for c in value)


def _pending_hides(kind: str, name: str, word: str) -> bool:
    """Whether ``word``, following a word that announced a value of ``kind``, is hidden."""
    if kind == "credential":
        return True
    if kind == "short":
        return not _keeps_short_value(word)
    return hides(name, is_number(word))


def _redact_words(words: Sequence[str], budget: _Budget) -> list[str]:
    """Apply the rules to a list of arguments, where some words announce a secret next one.

    Once the budget is spent, every word left is hidden without a look (rule 11).
    """
    out: list[str] = []
    pending: _Pending | None = None
    for index, word in enumerate(words):
        if pending is None and not _may_hide(word):
            out.append(word)
            continue
        try:
            budget.spend()
            if pending is not None and _consumes(pending, word):
                shown, pending = _value_word(pending, word)
            else:
                shown, pending = _word(word, budget)
        except _BudgetSpentError:
            out.extend(REDACTED if rest else rest for rest in words[index:])
            break
        out.append(shown)
    return out


def _may_hide(word: str) -> bool:
    """Whether any rule could hide something in ``word`` (else it is shown as it is)."""
    lower = word.lower()
    return any(trigger in lower for trigger in _TRIGGERS) or (
        "-p" in word and _SHORT_P.search(word) is not None
    )


def _consumes(pending: _Pending, word: str) -> bool:
    """Whether ``word`` is the value an earlier word announced (a ``--flag`` never is)."""
    return bool(word) and not word.startswith("-" if pending[0] == "short" else "--")


def _value_word(pending: _Pending, word: str) -> tuple[str, _Pending | None]:
    """Show an announced value, and what it announces in turn."""
    kind, name = pending
    if kind == "header" and word.lower() in _AUTH_SCHEMES:
        return word, ("credential", "")
    shown = REDACTED if _pending_hides(kind, name, word) else word
    # `--api-key -token x`: "-token" is hidden as a value and still hides "x" as a flag.
    return shown, ("flag", word.lstrip("-")) if takes_value(word) else None


def _word(word: str, budget: _Budget) -> tuple[str, _Pending | None]:
    """Show a word no earlier word announced, and what it announces."""
    if takes_value(word):
        return word, ("flag", word.lstrip("-"))
    if _ANY_WHITESPACE.search(word):
        return _redact_arg(word, budget), None
    if word == "-p":
        return word, ("short", "")
    if word.lower().lstrip("'\"") == "bearer":
        return word, ("credential", "")
    header = _header(word)
    if header is not None:
        return header
    return _redact_arg(word, budget), None


def _redact_spaced(arg: str, budget: _Budget) -> str:
    """Redact inside one argument that holds a whole command line (``sh -c``, setproctitle)."""
    parts = _WHITESPACE.split(arg)
    # Even indexes are words (possibly empty at the ends), odd ones the whitespace between them.
    parts[0::2] = _redact_words(parts[0::2], budget)
    return "".join(parts)


def _redact_pem(args: Sequence[str]) -> list[str]:
    """Hide what lies between -----BEGIN and -----END, in one argument or across several.

    The label goes with the body: a rule that hid it would need a marker (its closing dashes)
    that the other rules, applied after this one, could hide in turn. The two markers this
    needs cannot be: a body is hidden up to its -----END before any other rule looks, and a
    word starting with "--" is never taken as a value.
    """
    out: list[str] = []
    inside = False
    for arg in args:
        if not inside and _PEM_BEGIN not in arg:
            out.append(arg)
            continue
        pieces: list[str] = []
        done = 0
        pos = 0
        while True:
            if not inside:
                found = arg.find(_PEM_BEGIN, pos)
                if found < 0:
                    break
                pos, inside = found + len(_PEM_BEGIN), True
                continue
            found = arg.find(_PEM_END, pos)
            end = len(arg) if found < 0 else found
            if end > pos:
                pieces += (arg[done:pos], REDACTED)
                done = end
            if found < 0:
                break
            pos, inside = found + len(_PEM_END), False
        pieces.append(arg[done:])
        out.append("".join(pieces))
    return out


def redact_cmdline(argv: Sequence[str]) -> tuple[str, ...]:
    """Return ``argv`` with the values of secret-looking flags and variables replaced.

    The result has exactly as many elements as ``argv``; see the module docstring for the rule.
    """
    return tuple(_redact_words(_redact_pem(argv), _Budget()))


def display_command(argv: Sequence[str], limit: int | None = None) -> str:
    """Join a (redacted again, to be safe) command line into one printable line for humans.

    Arguments are shell-quoted where needed, then escaped (gpuguard.core.escaping), so the result
    never contains a newline or a terminal escape sequence; ``limit`` bounds its length.
    """
    return escape(" ".join(shlex.quote(arg) for arg in redact_cmdline(argv)), limit)
