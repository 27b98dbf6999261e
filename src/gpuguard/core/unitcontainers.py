"""Which docker/podman container is a unit's server, and whether one of its is stale (pure).

A unit whose ``ExecStart=`` is ``docker run …`` runs its server in the engine's cgroup
(``docker-<id>.scope``, ``libpod-<id>.scope``), not the unit's: a container that outlived a stop
is neither in the unit's cgroup nor carries its ``INVOCATION_ID``. What ties it to the unit is
only what root wrote and the engine (root) confirms: the container's name, from the unit's
``container`` key or from ``--name`` in its ``ExecStart=`` (root's unit file, parsed with the
total shell-word parser, never a pattern over a command line), and the engine's own answer that
the container of that name is the very one whose cgroup holds the GPU, its ``Name`` equal to the
claim (the engine also answers a name that is an id prefix with that container). Stale or
current is told by the kernel's clock, not the engine's wall-clock ``StartedAt``: the start
time of the container's init process (``State.Pid``) against the start of the unit's running
invocation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath
from typing import TYPE_CHECKING, Final

from gpuguard.core.escaping import escape
from gpuguard.core.values import StrEnum

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence


class Engine(StrEnum):
    """A container engine gpuguard can ask, named as core/cgroup names its containers."""

    DOCKER = "docker"
    PODMAN = "podman"


NAME: Final = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}")
"""A container name as docker and podman accept it (bounded); nothing else is ever sent."""
UNIT_LABEL: Final = "gpuguard.unit"
"""A container label naming the unit that runs it: one naming another unit vetoes attribution."""
RUN_START: Final = "InactiveExitTimestampMonotonic"
"""When the unit's current run left "inactive" (its ExecStartPre= began), in µs of
CLOCK_MONOTONIC: the kernel's clock, comparable with a process's start in /proc (which also
counts suspended time, so a container started during the run never looks older than it)."""
_FULL_ID: Final = re.compile(r"[0-9a-f]{64}")
_MAX_LABELS: Final = 256

# Options of `docker run` (20.10 to 28) and `podman run` (4, 5) that take no value; every other
# option without ``=`` takes the next word, so the image (the first other word) ends the
# options and a ``--name`` of the server's own arguments is never read as the container's. A
# flag missing here would swallow the image; one wrongly here (run's ``-a`` takes a value)
# only ends the options early, and gives no name at worst.
_FLAGS: Final = frozenset(
    {
        "--detach",
        "--interactive",
        "--tty",
        "--rm",
        "--privileged",
        "--init",
        "--read-only",
        "--read-only-tmpfs",
        "--no-healthcheck",
        "--publish-all",
        "--oom-kill-disable",
        "--disable-content-trust",
        "--quiet",
        "--sig-proxy",
        "--replace",
        "--env-host",
        "--rootfs",
        "--no-hosts",
        "--http-proxy",
        "--tls-verify",
        "--passwd",
        "--rmi",
        "--unsetenv-all",
        "--use-api-socket",
        "--help",
    }
)
_SHORT_FLAGS: Final = frozenset("ditPq")


@dataclass(frozen=True, slots=True)
class Claim:
    """A container name the unit's root-written configuration gives for its server.

    ``engine`` is None for the ``container`` key, which names a container of whichever engine
    the holder's cgroup says; a name from ``ExecStart=`` belongs to that command's engine.
    """

    name: str
    source: str
    engine: Engine | None = None


@dataclass(frozen=True, slots=True)
class ContainerFacts:
    """What the engine's ``container inspect`` says, reduced to what the decision reads."""

    id: str
    name: str
    running: bool
    pid: int | None
    unit_label: str | None


@dataclass(frozen=True, slots=True)
class ContainerVerdict:
    """Whether to stop one container that holds the unit's GPUs, and why.

    ``name`` and ``full_id`` are set exactly when the engine confirmed the container is the
    unit's (``owned``), left over (``stop``) or the running invocation's own.
    """

    engine: Engine
    short_id: str
    stop: bool
    reason: str
    name: str | None = None
    full_id: str | None = None

    @property
    def container(self) -> str:
        """``docker:<id12>``, as core/cgroup attributes the container's processes."""
        return f"{self.engine}:{self.short_id}"

    @property
    def owned(self) -> bool:
        """Whether the engine confirmed this container is the unit's, as the gate confirms it."""
        return self.full_id is not None

    def owner(self, unit: str) -> str:
        """``sglang.service (container sglang-srv, docker 1a2b3c4d5e6f)``: the unit's container.

        ``, left over`` is added inside the parentheses for one of an earlier run.
        """
        left_over = ", left over" if self.stop else ""
        return f"{unit} (container {self.name}, {self.engine} {self.short_id}{left_over})"


@dataclass(frozen=True, slots=True)
class ContainerResult:
    """What was done about one container a verdict said to stop: the engine's outcome.

    ``outcome``: "stopped", "already stopped", "gone" (the engine's answers), "would stop"
    (dry run) or "stop failed"; ``error`` says why it failed.
    """

    verdict: ContainerVerdict
    outcome: str
    error: str | None = None

    @property
    def done(self) -> bool:
        """Whether the container is no longer running (as the engine said)."""
        return self.outcome in {"stopped", "already stopped", "gone"}


def container_of(attribution: str | None) -> tuple[Engine, str] | None:
    """``docker:<id12>`` / ``podman:<id12>`` (core/cgroup's names) as engine and short id."""
    if attribution is None:
        return None
    kind, sep, short = attribution.partition(":")
    if not sep or kind not in {Engine.DOCKER, Engine.PODMAN} or len(short) != 12:
        return None
    return Engine(kind), short


def claim_from_exec(argv: Sequence[str]) -> Claim | None:
    """The ``--name`` of ``docker run``/``podman run`` (or ``start``'s container) in one command.

    Only the plain form counts: the engine's program itself, no global options before the
    subcommand (``-H``/``--url`` would name another engine than root's socket), a name without
    ``$`` (systemd would expand it at start, to what gpuguard cannot know).
    """
    if not argv:
        return None
    program = PurePath(argv[0]).name
    if program not in {Engine.DOCKER, Engine.PODMAN}:
        return None
    words = list(argv[1:])
    if words[:1] == ["container"]:
        words = words[1:]
    if not words or words[0] not in {"run", "start"}:
        return None
    found = _start_name(words[1:]) if words[0] == "start" else _run_name(words[1:])
    if found is None or not NAME.fullmatch(found):
        return None
    return Claim(found, f"ExecStart= ({program} {words[0]} …)", Engine(program))


def _run_name(words: Sequence[str]) -> str | None:
    """``--name`` among the options before the image; None without one."""
    name: str | None = None
    index = 0
    while index < len(words):
        word = words[index]
        index += 1
        if word == "--" or not word.startswith("-") or word == "-":
            return name
        option, sep, value = word.partition("=")
        if option == "--name":
            if not sep:
                if index >= len(words):
                    return None
                value = words[index]
                index += 1
            name = value
        elif word.startswith("--"):
            if not sep and option not in _FLAGS:
                index += 1
        elif _short_takes_next(word[1:]):
            index += 1
    return None  # no image: not a command docker would run


def _short_takes_next(letters: str) -> bool:
    """Whether a short-option cluster (``it``, ``p8000:8000``, ``e``) consumes the next word."""
    for position, letter in enumerate(letters):
        if letter not in _SHORT_FLAGS:
            return position == len(letters) - 1
    return False


def _start_name(words: Sequence[str]) -> str | None:
    """The one container ``docker start [-a] [-i] NAME`` starts; None for several or none."""
    names = [word for word in words if not word.startswith("-")]
    options_ok = all(
        word in {"-a", "-i", "-ai", "-ia", "--attach", "--interactive"}
        for word in words
        if word.startswith("-")
    )
    return names[0] if len(names) == 1 and options_ok else None


def claims(configured: str | None, exec_starts: Iterable[Sequence[str]]) -> tuple[Claim, ...]:
    """Every name the unit's configuration gives: the ``container`` key, then ExecStart='s."""
    found = [Claim(configured, "the unit's container key")] if configured else []
    for argv in exec_starts:
        claim = claim_from_exec(argv)
        if claim is not None and claim not in found:
            found.append(claim)
    return tuple(found)


def run_start_s(text: str) -> float | None:
    """``RUN_START`` as systemctl show prints it, in seconds; None: unset (0) or not a number."""
    if not text.isascii() or not text.isdigit() or len(text) > 20 or int(text) == 0:
        return None
    return int(text) / 1e6


def parse_inspect(data: object) -> ContainerFacts | None:
    """``GET /containers/NAME/json`` (docker's, and podman's compatible API) → facts, or None.

    Total: anything but the documented shape (a 64-hex ``Id``, a ``State`` object) is None.
    """
    if not isinstance(data, dict):
        return None
    container_id, state = data.get("Id"), data.get("State")
    if not isinstance(container_id, str) or not _FULL_ID.fullmatch(container_id):
        return None
    if not isinstance(state, dict):
        return None
    name = data.get("Name")
    pid = state.get("Pid")
    config = data.get("Config")
    labels = config.get("Labels") if isinstance(config, dict) else None
    unit_label = _label(labels, UNIT_LABEL) if isinstance(labels, dict) else None
    return ContainerFacts(
        id=container_id,
        name=name.removeprefix("/") if isinstance(name, str) else "",
        running=state.get("Running") is True,
        pid=pid if type(pid) is int and pid > 0 else None,
        unit_label=unit_label,
    )


def _label(labels: Mapping[object, object], key: str) -> str | None:
    if len(labels) > _MAX_LABELS:
        return None
    value = labels.get(key)
    return value if isinstance(value, str) else None


@dataclass(frozen=True, slots=True)
class Evidence:
    """What gpuguard learned about one GPU-holding container, for :func:`judge`.

    ``facts`` is the engine's answer for a claimed name (None: no claimed name is this
    container, or the engine could not be asked, which ``problem`` says). ``init_container``
    is the container core/cgroup finds for ``facts.pid``'s cgroup; ``init_started_s`` that
    process's start (seconds since boot), ``live_since_s`` the running invocation's start
    (seconds since boot, None when the unit has no live run); ``run_problem`` why the unit may
    have a live run whose start cannot be read (its container is then the unit's, but whether
    it is left over cannot be told).
    """

    engine: Engine
    short_id: str
    claim: Claim | None = None
    facts: ContainerFacts | None = None
    problem: str | None = None
    init_container: str | None = None
    init_started_s: float | None = None
    live_since_s: float | None = None
    run_problem: str | None = None


def judge(unit: str, evidence: Evidence) -> ContainerVerdict:
    """Stop only a container the engine confirms is the unit's, of a run that is not live."""
    here = f"{evidence.engine}:{evidence.short_id}"
    facts, claim = evidence.facts, evidence.claim
    if evidence.problem is not None:
        return _keep(evidence, f"{here}: {evidence.problem}")
    if facts is None or claim is None:
        return _keep(
            evidence, f"{here} is not {unit}'s container: no name the unit gives is this container"
        )
    named = f"{here} ({claim.name}, from {claim.source})"
    why = _not_confirmed(unit, evidence, facts, named)
    if why is not None:
        return _keep(evidence, why)
    return _by_run(unit, evidence, facts, named)


def _not_confirmed(unit: str, evidence: Evidence, facts: ContainerFacts, named: str) -> str | None:
    """Why the engine's answer does not confirm that the holders' container is the unit's."""
    here = f"{evidence.engine}:{evidence.short_id}"
    if facts.id[:12] != evidence.short_id:
        return f"{here} is not {unit}'s container {facts.name} ({facts.id[:12]})"
    claimed = evidence.claim.name if evidence.claim is not None else None
    if facts.name != claimed:
        # The engine resolves GET /containers/NAME/json by name, then by id prefix: a claim
        # that looks like hex (``cafe``) can fetch another container whose id begins so.
        return (
            f"{here} is not {unit}'s container {claimed}: the engine answered for that name "
            f"with the container named {escape(facts.name) or '(none)'} (an id prefix, not its "
            "name)"
        )
    if facts.unit_label is not None and facts.unit_label != unit:
        return f"{named}: its {UNIT_LABEL} label names another unit"
    if not facts.running or facts.pid is None:
        return f"{named}: the engine says it is not running"
    if evidence.init_container != here:
        return f"{named}: its init PID {facts.pid} is not in its cgroup"
    return None


def _by_run(unit: str, evidence: Evidence, facts: ContainerFacts, named: str) -> ContainerVerdict:
    """The unit's own container: stale unless it started during the unit's running invocation."""
    if evidence.run_problem is not None:
        return _owned(evidence, facts, f"{named}: {evidence.run_problem}", stop=False)
    if evidence.live_since_s is None:
        return _owned(evidence, facts, f"{named}: left over, {unit} has no live run", stop=True)
    if evidence.init_started_s is None:
        return _owned(
            evidence,
            facts,
            f"{named}: the start of its init PID {facts.pid} cannot be read",
            stop=False,
        )
    if evidence.init_started_s < evidence.live_since_s:
        return _owned(
            evidence,
            facts,
            f"{named}: started before {unit}'s running invocation, left over",
            stop=True,
        )
    return _owned(evidence, facts, f"{named}: the running {unit}'s live container", stop=False)


def _keep(evidence: Evidence, reason: str) -> ContainerVerdict:
    return ContainerVerdict(evidence.engine, evidence.short_id, stop=False, reason=reason)


def _owned(
    evidence: Evidence, facts: ContainerFacts, reason: str, *, stop: bool
) -> ContainerVerdict:
    """A verdict on a container confirmed as the unit's; its name is the claimed, checked one."""
    name = evidence.claim.name if evidence.claim is not None else facts.name
    return ContainerVerdict(
        evidence.engine,
        evidence.short_id,
        stop=stop,
        reason=reason,
        name=name,
        full_id=facts.id,
    )
