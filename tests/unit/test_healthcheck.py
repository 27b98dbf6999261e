"""The health check's address and verdict (core.healthcheck), and the per-unit keys that set it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gpuguard.core.healthcheck import (
    SILENT_DEAD_S,
    HealthBack,
    HealthCheck,
    HealthDeath,
    HealthTarget,
    ProbeResult,
    parse_health_url,
)
from gpuguard.core.liveness import Liveness
from gpuguard.core.livenessview import DeadEngine, LivenessView, State, left_alone
from gpuguard.core.unitstate import UnitState
from gpuguard.unitsettings import UnitSettings

FAILED = ProbeResult(ok=False, detail="HTTP 503")
SLOW = ProbeResult(ok=False, detail="no answer within 2 s")
OK = ProbeResult(ok=True, detail="HTTP 200")


@pytest.mark.parametrize(
    ("url", "target"),
    [
        ("http://127.0.0.1:30000/health", HealthTarget("/health", "127.0.0.1", 30000)),
        ("http://[::1]:8000/health?x=1", HealthTarget("/health?x=1", "::1", 8000)),
        ("http://localhost:8000/v1/models", HealthTarget("/v1/models", "127.0.0.1", 8000)),
        ("http://127.0.0.1/health", HealthTarget("/health", "127.0.0.1", 80)),
    ],
)
def test_loopback_urls_are_taken(url: str, target: HealthTarget) -> None:
    """The three loopback spellings name their target."""
    assert parse_health_url(url) == target


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("http://10.0.0.5:8000/health", "not a loopback HTTP URL"),
        ("http://127.0.0.2:8000/health", "not a loopback"),
        ("http://localhost.evil.example:80/health", "not a loopback"),
        ("http://user@127.0.0.1:80/health", "not a loopback"),
        ("http://127.0.0.1:8000", "not a loopback"),
        ("http://127.0.0.1:8000/health\r\nHost: x", "not a loopback"),
        ("http://127.0.0.1:8000/he alth", "not a loopback"),
        ("http://127.0.0.1:8000/health#frag", "not a loopback"),
        ("http://127.0.0.1:99999/health", "outside 1..65535"),
        ("http://127.0.0.1:0/health", "outside 1..65535"),
        ("https://127.0.0.1:8443/health", "https is not supported"),
        ("ftp://127.0.0.1/health", "not a loopback"),
        ("http://127.0.0.1:80/" + "a" * 600, "longer than 512"),
        ("http://127.0.0.1:80/\u00e9", "not a loopback"),
    ],
)
def test_other_urls_are_a_config_error_that_says_what_to_write(url: str, said: str) -> None:
    """Anything but TCP loopback is refused, with the spellings that work."""
    with pytest.raises(ValidationError) as refused:
        UnitSettings(health_url=url)
    assert said in str(refused.value)


@pytest.mark.parametrize(
    "url",
    [
        "http://unix:/run/sglang/api.sock:/health",
        "http://unix:/tmp/x.sock:/health",
        "http://unix:run/api.sock:/health",
        "unix:/run/sglang/api.sock",
    ],
)
def test_a_unix_socket_url_is_refused_and_the_error_says_why(url: str) -> None:
    """A unix socket is a config error naming the attack (a path the unit's user controls)."""
    with pytest.raises(ValidationError) as refused:
        UnitSettings(health_url=url)
    said = str(refused.value)
    assert "a unix socket is not supported" in said
    assert "a path the unit's user controls" in said
    assert "TCP loopback only" in said


def test_a_hostile_url_is_refused_in_linear_time() -> None:
    """A long near-miss is refused at once: the patterns never backtrack."""
    with pytest.raises(ValueError, match="not a loopback"):
        parse_health_url("http://127.0.0.1:80" + "/a" * 240 + " ")


def test_the_timeout_must_stay_below_the_interval() -> None:
    """A probe that could take as long as its interval is a config error."""
    with pytest.raises(ValidationError, match="must be below health_every_s"):
        UnitSettings(health_url="http://127.0.0.1:1/h", health_every_s=2.0, health_timeout_s=2.0)
    with pytest.raises(ValidationError, match="less than or equal to 5"):
        UnitSettings(health_timeout_s=6.0, health_every_s=60.0)


def test_the_check_is_off_by_default() -> None:
    """No health_url, no check; the other keys have their documented defaults."""
    unit = UnitSettings()
    assert unit.health is None
    assert (unit.health_every_s, unit.health_timeout_s, unit.health_failures) == (10.0, 2.0, 3)


def test_failures_in_a_row_make_the_engine_dead() -> None:
    """Three 5xx of the run that is up (a slow answer between neither counts nor resets): dead."""
    check = HealthCheck(every_s=10.0, failures=3)
    assert check.due_in("run-a", 100.0) == 0.0
    assert check.answered("run-a", FAILED, now=100.0, wall=1000.0, probed_run="run-a") is None
    assert check.due_in("run-a", 105.0) == 5.0
    assert check.answered("run-a", FAILED, now=110.0, wall=1010.0, probed_run="run-a") is None
    assert check.answered("run-a", SLOW, now=120.0, wall=1020.0, probed_run="run-a") is None
    refused = ProbeResult(ok=False, detail="connection refused")
    death = check.answered("run-a", refused, now=130.0, wall=1030.0, probed_run="run-a")
    assert isinstance(death, HealthDeath)
    assert (death.invocation_id, death.since_s, death.since_wall_s) == ("run-a", 100.0, 1000.0)
    assert death.cause == "health check failed 3 times: connection refused"
    assert not death.silent


def test_slow_answers_alone_are_no_dead_engine_until_long_silent() -> None:
    """A busy engine's timeouts make no verdict; only SILENT_DEAD_S without a 2xx does."""
    check = HealthCheck(every_s=10.0, failures=3)
    check.due_in("run-a", 0.0)
    moments = [10.0 * n for n in range(int(SILENT_DEAD_S / 10.0))]
    for at in moments:
        assert check.answered("run-a", SLOW, now=at, wall=at, probed_run="run-a") is None
    death = check.answered("run-a", SLOW, now=SILENT_DEAD_S, wall=0.0, probed_run="run-a")
    assert isinstance(death, HealthDeath)
    assert death.silent
    assert death.cause == "health check answered no 2xx for 300 s: no answer within 2 s"


def test_only_refusals_and_server_errors_say_the_engine_is_down() -> None:
    """Refused and 5xx say down; a timeout, a 4xx, a closed or garbled answer do not."""
    down = [ProbeResult(ok=False, detail=d) for d in ("connection refused", "HTTP 500", "HTTP 503")]
    assert all(result.says_down for result in down)
    others = ("no answer within 2 s", "HTTP 404", "HTTP 429", "the answer is not HTTP")
    assert not any(ProbeResult(ok=False, detail=d).says_down for d in others)
    assert not ProbeResult(ok=True, detail="HTTP 200").says_down


def test_a_run_the_check_made_dead_is_probed_on_and_one_success_ends_it() -> None:
    """Dead by the check: further failures say nothing new, the first success ends the verdict."""
    check = HealthCheck(every_s=10.0, failures=1)
    check.due_in("run-a", 0.0)
    assert isinstance(
        check.answered("run-a", FAILED, now=0.0, wall=0.0, probed_run="run-a"), HealthDeath
    )
    assert check.due_in("run-a", 5.0) == 5.0  # still probed
    assert (
        check.answered("run-a", FAILED, now=10.0, wall=0.0, probed_run="run-a", dead=True) is None
    )
    back = check.answered("run-a", OK, now=20.0, wall=0.0, probed_run="run-a", dead=True)
    assert back == HealthBack("run-a", "HTTP 200")


def test_a_dropped_death_needs_its_failures_again() -> None:
    """A death the daemon did not count (systemd: not that run, active) starts the streak over."""
    check = HealthCheck(every_s=1.0, failures=2)
    check.due_in("run-a", 0.0)
    assert check.answered("run-a", FAILED, now=0.0, wall=0.0, probed_run="run-a") is None
    assert check.answered("run-a", FAILED, now=1.0, wall=0.0, probed_run="run-a") is not None
    check.dropped()
    assert check.answered("run-a", FAILED, now=2.0, wall=0.0, probed_run="run-a") is None
    assert check.answered("run-a", FAILED, now=3.0, wall=0.0, probed_run="run-a") is not None


def test_a_success_resets_the_count() -> None:
    """Two failures, a success, two failures: never three in a row, never dead."""
    check = HealthCheck(every_s=1.0, failures=3)
    check.due_in("run-a", 0.0)
    for at, answer in enumerate([FAILED, FAILED, OK, FAILED, FAILED]):
        assert check.answered("run-a", answer, now=float(at), wall=0.0, probed_run="run-a") is None


def test_no_probe_while_the_run_is_not_up() -> None:
    """A start (no run up yet) is never probed."""
    assert HealthCheck(every_s=10.0, failures=1).due_in(None, 50.0) is None


def test_a_probe_answered_after_its_run_ended_counts_for_nothing() -> None:
    """The run ended (or another began) while the probe waited: its failure counts for nothing."""
    check = HealthCheck(every_s=10.0, failures=1)
    check.due_in("run-a", 0.0)
    assert check.answered("run-a", FAILED, now=1.0, wall=0.0, probed_run=None) is None
    assert check.answered("run-a", FAILED, now=1.0, wall=0.0, probed_run="run-b") is None


def test_a_new_run_starts_a_fresh_count() -> None:
    """Failures of an earlier run never add up with the next run's."""
    check = HealthCheck(every_s=10.0, failures=2)
    check.due_in("run-a", 0.0)
    assert check.answered("run-a", FAILED, now=0.0, wall=0.0, probed_run="run-a") is None
    assert check.due_in("run-b", 5.0) == 0.0  # a new run up: probed at once
    assert check.answered("run-b", FAILED, now=5.0, wall=0.0, probed_run="run-b") is None
    assert check.answered("run-b", FAILED, now=15.0, wall=0.0, probed_run="run-b") is not None


def test_a_probe_the_sandbox_refused_is_neither_failure_nor_success() -> None:
    """The daemon could not even ask: the streak stands, the reason is kept, the next is due."""
    check = HealthCheck(every_s=10.0, failures=2)
    check.due_in("run-a", 0.0)
    refused = ProbeResult(ok=False, detail="cannot make the socket (refused)", counts=False)
    assert check.answered("run-a", FAILED, now=0.0, wall=0.0, probed_run="run-a") is None
    for at in (10.0, 20.0, 30.0):
        assert check.answered("run-a", refused, now=at, wall=0.0, probed_run="run-a") is None
    assert check.blocked == "cannot make the socket (refused)"
    assert check.due_in("run-a", 35.0) == 5.0
    assert check.answered("run-a", FAILED, now=40.0, wall=0.0, probed_run="run-a") is not None


def test_liveness_takes_a_health_death_only_for_the_run_that_is_up() -> None:
    """A death reported for a run liveness does not call up makes no dead engine."""
    liveness = Liveness("sglang.service", "sglang")
    death = HealthDeath("run-a", 1.0, 2.0, "health check failed 3 times: HTTP 503")
    assert liveness.up_run is None
    assert not liveness.health_failed(death)
    assert liveness.dead is None
    assert liveness.view(10.0).state is not State.ENGINE_DEAD


def test_a_restart_for_silence_is_never_repeated_without_a_new_cause() -> None:
    """After the daemon restarted a unit for a silent check, silence again is only reported."""
    run = "r" * 32
    now = UnitState("vllm.service", "active", "running", invocation_id=run)

    def view(*, silent: bool) -> LivenessView:
        dead = DeadEngine(run, 1.0, None, "c", "c", by_health=True, by_silence=silent)
        return LivenessView(State.ENGINE_DEAD, "dead", "critical", run, dead)

    assert left_alone(view(silent=True), "vllm.service", now) is None  # the first: recovered
    again = left_alone(view(silent=True), "vllm.service", now, silence_recovered=True)
    assert again is not None
    assert "not restarted again without a new cause" in again
    # A refusal or a 5xx is a new cause: recovered even after a restart for silence.
    assert left_alone(view(silent=False), "vllm.service", now, silence_recovered=True) is None
