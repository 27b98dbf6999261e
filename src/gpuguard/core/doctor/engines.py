"""Which inference server a unit's ExecStart= runs, and the settings of its own that doctor reads.

A server has its own clocks beside systemd's: vLLM drains for ``--shutdown-timeout`` seconds
after SIGTERM and gives its engine ``VLLM_ENGINE_READY_TIMEOUT_S`` to come up; SGLang drains
until no request is left, with ``--watchdog-timeout`` on a hung batch. doctor compares systemd's
timeouts with them (``enginechecks``), so it reads them here from the unit's effective
ExecStart= and environment, and only what it knows: each flag and default below with its
source. Anything else (a shell, a container, a ``--config`` file that may set a flag, a value
that is not a number, an unexpanded ``$VAR``) is said to be not understood, never guessed.

The command line is foreign text that may carry secrets (``--api-key``): it stays raw here and
is shown only through ``core.redaction.display_command``. Every parser is total and linear.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

VLLM: Final = "vLLM"
SGLANG: Final = "SGLang"

VLLM_SHUTDOWN_FLAGS: Final = ("--shutdown-timeout", "--shutdown_timeout")
"""vLLM's drain after SIGTERM, in whole seconds: "Shutdown timeout in seconds. 0 = abort, >0 =
wait. Default: 0" (vllm/engine/arg_utils.py, ``EngineArgs.shutdown_timeout: int = 0``; docs.vllm.ai
configuration/engine_args). vLLM's parser takes ``_`` for ``-`` in a flag's name."""
VLLM_SHUTDOWN_DEFAULT_S: Final = 0.0
VLLM_READY_VARIABLE: Final = "VLLM_ENGINE_READY_TIMEOUT_S"
"""How long vLLM's front end waits for its engine cores to be ready at a start, in whole
seconds, default 600 (vllm/envs.py: "Timeout in seconds for waiting for engine cores to become
ready during startup. Default is 600 seconds (10 minutes)."); past it the start fails."""
VLLM_READY_DEFAULT_S: Final = 600.0
SGLANG_WATCHDOG_FLAG: Final = "--watchdog-timeout"
"""SGLang: "If a forward batch takes longer than this, the server will crash to prevent
hanging", default 300 (python/sglang/srt/server_args.py, ``ServerArgs.watchdog_timeout``)."""
SGLANG_WATCHDOG_DEFAULT_S: Final = 300.0
SGLANG_FORCE_SHUTDOWN: Final = "SGL_FORCE_SHUTDOWN"
"""SGLang's drain (``TokenizerManager.sigterm_watchdog``, python/sglang/srt/managers/
tokenizer_manager.py) waits, polling every 5 s, until no request is left, with no bound of its
own; this variable set true makes it exit at once."""
CONFIG_FLAGS: Final = ("--config",)
"""Both servers read flags from a YAML file too (``--config FILE``): doctor does not."""

_PYTHON = re.compile(r"python(?:\d{1,2}(?:\.\d{1,3})?)?")
_PYTHON_SWITCHES: Final = frozenset({"-u", "-O", "-OO", "-B", "-E", "-s", "-S", "-I", "-P"})
_ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}=.*", re.DOTALL)
_WHOLE_SECONDS = re.compile(r"\d{1,7}")
_SECONDS = re.compile(r"\d{1,7}(?:\.\d{1,6})?")
_VARIABLE = re.compile(
    r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]{0,127})\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]{0,127}))"
)
_TRUE: Final = frozenset({"1", "true", "yes", "on"})


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting of the server: its value in seconds (None: not understood) and where from."""

    value_s: float | None
    source: str
    """Where the value comes from, for people: a flag on ExecStart=, a variable, a default."""
    default: bool = False


@dataclass(frozen=True, slots=True)
class Engine:
    """The server ExecStart= runs, as far as doctor understood it.

    ``name`` is None when doctor does not know the server (``unread`` says why); ``argv`` is the
    whole command (foreign: display it only through ``display_command``).
    """

    name: str | None
    argv: tuple[str, ...] = ()
    drain: Setting | None = None
    """vLLM's ``--shutdown-timeout``; None for SGLang (its drain has no bound of its own)."""
    ready: Setting | None = None
    """vLLM's engine ready timeout."""
    ready_settable: bool = True
    """A drop-in's ``Environment=`` would set the ready timeout: it is not set by an
    EnvironmentFile= or ``env`` on ExecStart= (both win over ``Environment=``)."""
    watchdog: Setting | None = None
    """SGLang's ``--watchdog-timeout``."""
    force_shutdown: bool = False
    """SGLang's SGL_FORCE_SHUTDOWN is set true: it skips its drain."""
    unread: tuple[str, ...] = ()
    """What doctor did not understand, each said as a sentence."""


def read_engine(
    commands: Sequence[Sequence[str]],
    environment: Mapping[str, str],
    unit_environment: Mapping[str, str],
) -> Engine:
    """The server of ExecStart= ``commands``, and the settings of its own doctor reads.

    ``environment`` is the unit's (EnvironmentFile= applied), ``unit_environment`` its
    ``Environment=`` alone (what a drop-in's line overrides).
    """
    if len(commands) != 1:
        return Engine(
            None,
            unread=(
                "systemd reported no ExecStart= command"
                if not commands
                else f"{len(commands)} ExecStart= commands: doctor reads a unit that runs one",
            ),
        )
    argv = tuple(commands[0])
    words = list(argv)
    env = dict(environment)
    from_env_command: set[str] = set()
    if words and _base(words[0]) == "env":
        words.pop(0)
        while words and _ENV_WORD.fullmatch(words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
            from_env_command.add(name)
        if words and words[0].startswith("-"):
            return Engine(None, argv, unread=("an option of env on ExecStart= is not understood",))
    found = _server(words)
    if isinstance(found, str):
        return Engine(None, argv, unread=(found,))
    name, args = found
    unread: list[str] = []
    has_config = any(_flag_value(args, (flag,)) is not None for flag in CONFIG_FLAGS)
    if name == VLLM:
        drain, problem = _flag_setting(args, _VLLM_DRAIN, env, has_config)
        unread.extend([problem] if problem else [])
        ready, settable = _ready(env, unit_environment, from_env_command, unread)
        return Engine(
            VLLM, argv, drain=drain, ready=ready, ready_settable=settable, unread=tuple(unread)
        )
    watchdog, problem = _flag_setting(args, _SGLANG_WATCHDOG, env, has_config)
    unread.extend([problem] if problem else [])
    force = env.get(SGLANG_FORCE_SHUTDOWN, "").strip().lower() in _TRUE
    return Engine(SGLANG, argv, watchdog=watchdog, force_shutdown=force, unread=tuple(unread))


def _base(word: str) -> str:
    return word.rsplit("/", 1)[-1]


def _server(words: list[str]) -> tuple[str, list[str]] | str:
    """(the server's name, its arguments), or why the command is not a server doctor knows."""
    if not words:
        return "ExecStart= has no command"
    program = _base(words[0])
    rest = words[1:]
    if program == "vllm" and rest[:1] == ["serve"]:
        return VLLM, rest[1:]
    if program == "sglang" and rest[:1] == ["serve"]:
        return SGLANG, rest[1:]
    if _PYTHON.fullmatch(program):
        return _python_module(rest)
    return (
        "not a server doctor knows: it reads vLLM (`vllm serve`, `python -m "
        "vllm.entrypoints.openai.api_server`) and SGLang (`python -m sglang.launch_server`, "
        "`sglang serve`), started directly or through `env`"
    )


def _python_module(words: list[str]) -> tuple[str, list[str]] | str:
    """``python [switches] -m MODULE args…`` → the server and its arguments."""
    at = 0
    while at < len(words) and words[at] in _PYTHON_SWITCHES:
        at += 1
    if at + 1 >= len(words) or words[at] != "-m":
        return "a Python command that does not run a module (`-m`) doctor knows"
    module, args = words[at + 1], words[at + 2 :]
    if module == "vllm.entrypoints.openai.api_server":
        return VLLM, args
    if module == "vllm.entrypoints.cli.main" and args[:1] == ["serve"]:
        return VLLM, args[1:]
    if module == "sglang.launch_server":
        return SGLANG, args
    return "a Python module doctor does not know as a server"


def _flag_value(args: Sequence[str], names: Sequence[str]) -> str | None:
    """The value of the last of ``names`` in ``args`` (``--flag value`` or ``--flag=value``)."""
    found: str | None = None
    for at, word in enumerate(args):
        for name in names:
            if word == name:
                found = args[at + 1] if at + 1 < len(args) else ""
            elif word.startswith(name + "="):
                found = word[len(name) + 1 :]
    return found


@dataclass(frozen=True, slots=True)
class _Flag:
    """A flag doctor reads: its names (the first is shown), its default, whole seconds or not."""

    names: tuple[str, ...]
    default_s: float
    whole: bool


def _flag_setting(
    args: Sequence[str], flag: _Flag, env: Mapping[str, str], has_config: bool
) -> tuple[Setting, str | None]:
    """A flag's value in seconds, the server's default when absent, or why not understood."""
    raw = _flag_value(args, flag.names)
    name = flag.names[0]
    if raw is None:
        if has_config:
            return Setting(None, f"{name} (perhaps in --config's file)"), (
                f"{name} is not on the command line and --config names a file that may set "
                "it: doctor reads only the command line"
            )
        return Setting(flag.default_s, f"the default {name}", default=True), None
    value = _expand(raw, env)
    pattern = _WHOLE_SECONDS if flag.whole else _SECONDS
    if value is None or not pattern.fullmatch(value):
        return Setting(None, f"{name} on ExecStart="), (
            f"the value of {name} is not understood"
            + (" (a variable the unit's environment does not set)" if value is None else "")
            + (": whole seconds expected" if flag.whole else ": seconds expected")
        )
    return Setting(float(value), f"{name} on ExecStart="), None


_VLLM_DRAIN: Final = _Flag(VLLM_SHUTDOWN_FLAGS, VLLM_SHUTDOWN_DEFAULT_S, whole=True)
_SGLANG_WATCHDOG: Final = _Flag((SGLANG_WATCHDOG_FLAG,), SGLANG_WATCHDOG_DEFAULT_S, whole=False)


def _expand(word: str, env: Mapping[str, str]) -> str | None:
    """A word as systemd's ExecStart= expands it, if doctor can tell; None if not.

    A word with no ``$`` is itself; one that is all ``$NAME`` or ``${NAME}`` is the variable's
    value in the unit's environment; anything else is None.
    """
    if "$" not in word:
        return word
    match = _VARIABLE.fullmatch(word)
    if match is None:
        return None
    return env.get(match["braced"] or match["bare"])


def _ready(
    env: Mapping[str, str],
    unit_environment: Mapping[str, str],
    from_env_command: set[str],
    unread: list[str],
) -> tuple[Setting, bool]:
    """The engine ready timeout of vLLM, and whether a drop-in's Environment= would set it."""
    name = VLLM_READY_VARIABLE
    if name in from_env_command:
        source, settable = f"{name} set by env on ExecStart=", False
    elif name in env and env.get(name) != unit_environment.get(name):
        source, settable = f"{name} set by an EnvironmentFile=", False
    elif name in env:
        source, settable = f"{name} set by Environment=", True
    else:
        return Setting(VLLM_READY_DEFAULT_S, f"vLLM's default {name}", default=True), True
    value = env[name].strip()
    if not _WHOLE_SECONDS.fullmatch(value):
        unread.append(f"the value of {name} is not understood: whole seconds expected")
        return Setting(None, source), settable
    return Setting(float(value), source), settable
