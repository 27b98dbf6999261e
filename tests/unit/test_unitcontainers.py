"""The unit's container: names from root's configuration, the engine's answer, stale or live."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gpuguard.core.unitconfig import exec_argvs
from gpuguard.core.unitcontainers import (
    Claim,
    ContainerFacts,
    ContainerResult,
    Engine,
    Evidence,
    claim_from_exec,
    claims,
    container_of,
    judge,
    parse_inspect,
    run_start_s,
)

SAMPLES = Path(__file__).parents[1] / "engine_samples"
RECORDED = json.loads((SAMPLES / "docker-20.10-inspect-running.json").read_text())
FULL = RECORDED["Id"]
SHORT = FULL[:12]
UNIT = "sglang.service"


@pytest.mark.parametrize(
    ("command", "name"),
    [
        (
            "/usr/bin/docker run --rm --gpus all --name sglang lmsysorg/sglang python3 -m x",
            "sglang",
        ),
        ("/usr/bin/docker run --name=sg-1 img", "sg-1"),
        ("/usr/bin/podman run -it --shm-size 32g --name s.1 img --name other", "s.1"),
        ("/usr/bin/docker container run -d -p 30000:30000 --name a img", "a"),
        ("/usr/bin/docker run -p8000:8000 -e X=1 --ipc=host --name b img", "b"),
        ("/usr/bin/docker run -itv /a:/b --name c img", "c"),
        ("/usr/bin/docker run -a stdout -a stderr --name d img", "d"),  # run's -a takes a value
        ("/usr/bin/docker start -a sglang", "sglang"),
        ("/usr/bin/podman start --attach sglang", "sglang"),
    ],
)
def test_the_name_of_a_plain_run_or_start(command: str, name: str) -> None:
    """The name stands before the image, whatever options take values around it."""
    claim = claim_from_exec(command.split())
    assert claim is not None
    assert claim.name == name
    assert claim.engine == Engine(Path(command.split(maxsplit=1)[0]).name)


@pytest.mark.parametrize(
    "command",
    [
        # The server's own --name after the image is never the container's.
        "/usr/bin/docker run --rm lmsysorg/sglang python3 -m sglang --name sglang",
        # A value-taking option swallows the next word: --name here is the value of -e.
        "/usr/bin/docker run -e --name img",
        # Global options may point the client at another engine than root's socket.
        "/usr/bin/docker -H tcp://elsewhere:2375 run --name sglang img",
        "/usr/bin/podman --url unix:///x run --name sglang img",
        # Expanded by systemd at start: gpuguard cannot know the value.
        "/usr/bin/docker run --name ${NAME} img",
        "/usr/bin/docker run --name sglang",  # no image
        "/usr/bin/docker start a b",
        "/usr/bin/docker start --checkpoint x sglang",
        "/usr/bin/python3 -m sglang.launch_server --name sglang",
        "/usr/bin/docker ps --name sglang",
        "/usr/bin/docker run --name ../etc img",
        "/usr/bin/docker run --name",
    ],
)
def test_no_name_where_the_command_does_not_say_it_plainly(command: str) -> None:
    """Anything but the plain form gives no name: the operator sets the container key then."""
    assert claim_from_exec(command.split()) is None


def test_exec_start_text_as_systemctl_show_prints_it() -> None:
    """The ExecStart= text of systemctl show gives the argv; the key's name comes first."""
    text = (
        "{ path=/usr/bin/docker ; argv[]=/usr/bin/docker run --rm --name 'sg lang' img ; "
        "ignore_errors=no ; start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; code=(null) ; "
        "status=0/0 }"
    )
    (argv,) = exec_argvs(text)
    assert argv == ("/usr/bin/docker", "run", "--rm", "--name", "sg lang", "img")
    assert claim_from_exec(argv) is None  # a space is no container name
    assert claims("sglang", [argv, ("/usr/bin/docker", "run", "--name", "x", "i")]) == (
        Claim("sglang", "the unit's container key"),
        Claim("x", "ExecStart= (docker run …)", Engine.DOCKER),
    )


def test_argv_parsing_is_linear_in_a_huge_command() -> None:
    """400 000 option words are parsed in well under the bound (one pass, no backtracking)."""
    argv = ["/usr/bin/docker", "run", *(["-e", "X=1"] * 200_000), "--name", "n", "img"]
    started = time.perf_counter()
    claim = claim_from_exec(argv)
    assert claim is not None
    assert claim.name == "n"
    assert time.perf_counter() - started < 2.0


def test_recorded_docker_inspect() -> None:
    """The answer of docker 20.10, recorded from a real dockerd, gives id, name, state, init PID."""
    facts = parse_inspect(RECORDED)
    assert facts == ContainerFacts(
        id=FULL, name="ggtest", running=True, pid=RECORDED["State"]["Pid"], unit_label=None
    )


@pytest.mark.parametrize(
    "answer",
    [
        None,
        [],
        "x",
        {"Id": "abc", "State": {}},
        {"Id": FULL.upper(), "State": {}},
        {"Id": FULL},
        {"Id": FULL, "State": "running"},
    ],
)
def test_inspect_answers_of_the_wrong_shape_are_nothing(answer: object) -> None:
    """An answer without a full lower-case id and a State object names no container."""
    assert parse_inspect(answer) is None


def test_inspect_fields_of_the_wrong_type_are_unknown() -> None:
    """A field of the wrong type is unknown (not running, no PID, no label), never a crash."""
    answer = {
        "Id": FULL,
        "Name": 7,
        "State": {"Running": "yes", "Pid": True},
        "Config": {"Labels": {"gpuguard.unit": ["x"]}},
    }
    assert parse_inspect(answer) == ContainerFacts(
        FULL, "", running=False, pid=None, unit_label=None
    )


def test_container_of_attribution() -> None:
    """Only docker and podman containers have an engine gpuguard asks."""
    assert container_of(f"docker:{SHORT}") == (Engine.DOCKER, SHORT)
    assert container_of(f"podman:{SHORT}") == (Engine.PODMAN, SHORT)
    assert container_of("lxc:sglang") is None
    assert container_of(f"kubepods:x/{SHORT}") is None
    assert container_of(None) is None


CLAIM = Claim("ggtest", "the unit's container key")
FACTS = ContainerFacts(FULL, "ggtest", running=True, pid=4242, unit_label=None)


def evidence(**changes: object) -> Evidence:
    """Evidence that confirms the unit's container, with ``changes``."""
    base: dict[str, object] = {
        "engine": Engine.DOCKER,
        "short_id": SHORT,
        "claim": CLAIM,
        "facts": FACTS,
        "init_container": f"docker:{SHORT}",
        "init_started_s": 100.0,
        "live_since_s": None,
    }
    return Evidence(**(base | changes))  # type: ignore[arg-type]


def test_the_units_container_is_stopped_when_the_unit_has_no_live_run() -> None:
    """At the gate (ExecStartPre=) or after a stop, the unit's container is left over."""
    verdict = judge(UNIT, evidence())
    assert verdict.stop
    assert verdict.full_id == FULL
    assert "no live run" in verdict.reason


def test_started_before_the_running_invocation_is_left_over() -> None:
    """An init process older than the running invocation belongs to an earlier run."""
    assert judge(UNIT, evidence(live_since_s=150.0)).stop


def test_started_during_the_running_invocation_is_live() -> None:
    """The running unit's own container is never stopped."""
    verdict = judge(UNIT, evidence(live_since_s=50.0))
    assert not verdict.stop
    assert "live container" in verdict.reason


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"claim": None, "facts": None}, "no name the unit gives"),
        ({"problem": "connection refused"}, "connection refused"),
        (
            {"facts": ContainerFacts("f" * 64, "g", running=True, pid=4242, unit_label=None)},
            "is not",
        ),
        (
            {
                "facts": ContainerFacts(
                    FULL, "ggtest", running=True, pid=4242, unit_label="other.service"
                )
            },
            "label",
        ),
        (
            {"facts": ContainerFacts(FULL, "ggtest", running=False, pid=None, unit_label=None)},
            "not running",
        ),
        ({"init_container": "docker:ffffffffffff"}, "not in its cgroup"),
        ({"init_container": None}, "not in its cgroup"),
        ({"live_since_s": 150.0, "init_started_s": None}, "cannot be read"),
    ],
)
def test_anything_unconfirmed_is_kept(changes: dict[str, object], why: str) -> None:
    """Every missing or contradicting piece of evidence keeps the container, with the reason."""
    verdict = judge(UNIT, evidence(**changes))
    assert not verdict.stop
    assert why in verdict.reason


def test_a_hex_looking_claim_never_matches_a_container_by_id_prefix() -> None:
    """The engine answers ``cafe`` with the container whose id starts so: its Name must match."""
    other = "cafe" + FULL[4:]
    verdict = judge(
        UNIT,
        evidence(
            short_id=other[:12],
            claim=Claim("cafe", "the unit's container key"),
            facts=ContainerFacts(other, "tenant-job", running=True, pid=4242, unit_label=None),
            init_container=f"docker:{other[:12]}",
        ),
    )
    assert not verdict.stop
    assert not verdict.owned
    assert "the container named tenant-job (an id prefix, not its name)" in verdict.reason


def test_a_label_naming_the_unit_itself_is_no_veto() -> None:
    """The label only vetoes: naming the unit itself is consistent."""
    facts = ContainerFacts(FULL, "ggtest", running=True, pid=4242, unit_label=UNIT)
    assert judge(UNIT, evidence(facts=facts)).stop


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1234567890", 1234.56789),
        ("0", None),
        ("", None),
        ("-5", None),
        ("1e9", None),
        ("٣", None),
        ("9" * 21, None),
    ],
)
def test_run_start_as_systemctl_prints_it(text: str, seconds: float | None) -> None:
    """Microseconds of CLOCK_MONOTONIC; 0 (never started) and anything else is unknown."""
    assert run_start_s(text) == seconds


def test_recorded_podman_compat_inspect() -> None:
    """Podman 4.3's compatible API (recorded) has docker's shape; a created container is idle.

    Recorded from a real ``podman system service`` here: its container could not start in this
    sandbox (runc may not set RLIMIT_NPROC), so the answer is that of a created container.
    """
    answer = json.loads((SAMPLES / "podman-4.3-compat-inspect-created.json").read_text())
    facts = parse_inspect(answer)
    assert facts == ContainerFacts(answer["Id"], "ggp", running=False, pid=None, unit_label=None)
    claim = Claim("ggp", "the unit's container key")
    verdict = judge(
        UNIT,
        evidence(engine=Engine.PODMAN, short_id=answer["Id"][:12], claim=claim, facts=facts),
    )
    assert not verdict.stop
    assert "not running" in verdict.reason


def test_a_confirmed_container_is_the_units_whether_left_over_or_live() -> None:
    """Status names the unit for both; only the left-over one is to be stopped."""
    left_over = judge(UNIT, evidence())
    live = judge(UNIT, evidence(live_since_s=50.0))
    assert (left_over.owned, left_over.stop) == (True, True)
    assert (live.owned, live.stop) == (True, False)
    assert live.full_id == FULL
    assert live.owner(UNIT) == f"{UNIT} (container ggtest, docker {SHORT})"
    assert left_over.owner(UNIT) == f"{UNIT} (container ggtest, docker {SHORT}, left over)"


def test_an_unreadable_run_start_keeps_the_units_container_but_still_names_it() -> None:
    """Whether it is left over cannot be told; whose it is can."""
    verdict = judge(UNIT, evidence(run_problem="the start of the running invocation is unknown"))
    assert not verdict.stop
    assert verdict.owned
    assert "the start of the running invocation is unknown" in verdict.reason


def test_an_unconfirmed_container_is_nobodys() -> None:
    """A kept container the engine did not confirm carries no name or id: status shows it as is."""
    verdict = judge(UNIT, evidence(init_container=None))
    assert not verdict.owned
    assert verdict.name is None
    assert verdict.container == f"docker:{SHORT}"


def test_the_name_is_the_claimed_checked_one() -> None:
    """The engine's Name is foreign text: one that is not the claim confirms nothing, escaped."""
    facts = ContainerFacts(FULL, "other\nname", running=True, pid=4242, unit_label=None)
    verdict = judge(UNIT, evidence(facts=facts))
    assert verdict.name is None
    assert "\n" not in verdict.reason
    assert judge(UNIT, evidence()).name == "ggtest"


@pytest.mark.parametrize(
    ("outcome", "done"),
    [
        ("stopped", True),
        ("already stopped", True),
        ("gone", True),
        ("would stop", False),
        ("stop failed", False),
    ],
)
def test_a_result_is_done_only_when_the_engine_says_it_no_longer_runs(
    outcome: str, *, done: bool
) -> None:
    """A dry run's or a failed stop leaves the container running."""
    assert ContainerResult(judge(UNIT, evidence()), outcome).done is done
