"""doctor's checks against the server's own settings, read from ExecStart= as systemctl shows it.

Each unit is written the way its server's docs show it (vLLM: ``vllm serve MODEL`` with its
engine arguments, docs.vllm.ai configuration/engine_args; SGLang: ``python3 -m
sglang.launch_server --model-path … --host … --port …``, docs.sglang.ai), then printed the way
``systemctl show`` prints ExecStart= (systemd 252: ``{ path=… ; argv[]=… ; … }``) and parsed by
the same parser doctor uses.
"""

from __future__ import annotations

import json

from gpuguard.core.doctor import (
    AuditedUnit,
    Finding,
    History,
    HostFacts,
    LearnedStarts,
    Stop,
    diagnose,
    render_fix,
    render_json,
    render_text,
)
from gpuguard.core.levels import Level
from gpuguard.core.unitconfig import parse_show

HOST = HostFacts(gate_timeout_s=300.0, nvidia_devices=False, persistenced_running=False)
VLLM = "/opt/vllm/bin/vllm serve meta-llama/Llama-3.1-8B-Instruct --tensor-parallel-size 2"
SGLANG = (
    "/usr/bin/python3 -m sglang.launch_server --model-path meta-llama/Meta-Llama-3-8B-Instruct "
    "--host 0.0.0.0 --port 30000"
)
SECRET = "sk-live-4f9a0c"  # noqa: S105 (the secret that must never be shown)


def show(command: str, *, stop: str = "1min 30s", restart: str = "always", env: str = "") -> str:
    """``systemctl show`` of a gated unit running ``command``, as systemd 252 prints it."""
    path = command.split(maxsplit=1)[0]
    return (
        "LoadState=loaded\nType=simple\nKillMode=mixed\n"
        f"TimeoutStopUSec={stop}\nTimeoutStartUSec=1h\nRestart={restart}\nRestartUSec=10s\n"
        "StartLimitIntervalUSec=1h\nStartLimitBurst=5\n"
        f"Environment={env}\n"
        "ExecStartPre={ path=/usr/bin/gpuguard ; argv[]=/usr/bin/gpuguard gate --unit u.service "
        "; ignore_errors=no ; start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; code=(null) ; "
        "status=0/0 }\n"
        f"ExecStart={{ path={path} ; argv[]={command} ; ignore_errors=no ; start_time=[n/a] ; "
        "stop_time=[n/a] ; pid=0 ; code=(null) ; status=0/0 }\n"
        "DropInPaths=/etc/systemd/system/u.service.d/gpuguard-gate.conf\n"
    )


def audit(
    text: str,
    *,
    file_env: dict[str, str] | None = None,
    starts: tuple[float, ...] | None = None,
    history: History | None = None,
    on_engine_dead: str | None = "report",
    clean_exit: bool = True,
) -> tuple[Finding, ...]:
    """The findings doctor makes of the unit ``systemctl show`` printed as ``text``."""
    config = parse_show("u.service", text)
    facts = AuditedUnit(
        config=config,
        history=history or History(),
        environment={**config.environment, **(file_env or {})},
        gpus=(0, 1),
        user_uid=0,
        learned=None if starts is None else LearnedStarts("/var/lib/gpuguard/u.json", starts),
        on_engine_dead=on_engine_dead,
        clean_exit_is_death=clean_exit,
    )
    return diagnose(facts, {}, HOST)


def only(findings: tuple[Finding, ...], code: str) -> Finding:
    """The one finding with ``code``."""
    (found,) = [f for f in findings if f.code == code]
    return found


def codes(findings: tuple[Finding, ...]) -> set[str]:
    """The codes of ``findings``."""
    return {f.code for f in findings}


def test_execstart_is_read_from_systemctl_show() -> None:
    """ExecStart='s argv is parsed from systemd's property text, word by word."""
    config = parse_show("u.service", show(VLLM + " --shutdown-timeout 30"))
    assert config.exec_start == (tuple((VLLM + " --shutdown-timeout 30").split()),)


def test_a_stop_timeout_below_vllms_own_drain_is_a_warning_with_the_fixing_line() -> None:
    """--shutdown-timeout 300 under TimeoutStopSec=90s: SIGKILL mid-drain; 300 s + 30 s fixes it."""
    found = only(audit(show(VLLM + " --shutdown-timeout 300")), "engine-drain")
    assert found.severity is Level.WARNING
    assert "cuts vLLM's own drain short" in found.title
    assert found.fix[-1] == "TimeoutStopSec=5min 30s"
    assert "--shutdown-timeout on ExecStart=" in found.fix[0]


def test_vllms_default_drain_is_read_as_its_default_and_fits() -> None:
    """No flag: vLLM's default 0 (abort at once) + 30 s fits in 90 s, said with its source."""
    findings = audit(show(VLLM + " --shutdown_timeout=0"))
    assert only(findings, "engine-drain").severity is Level.OK
    default = only(audit(show(VLLM)), "engine-drain")
    assert default.severity is Level.OK
    assert "the default --shutdown-timeout" in default.evidence[0]
    assert "aborts every request in flight" in default.evidence[0]


def test_a_drain_past_the_ceiling_is_advice_never_a_longer_timeout() -> None:
    """--shutdown-timeout 900 would need 15 min 30 s: past doctor's 10 min ceiling, no fix line."""
    findings = audit(show(VLLM + " --shutdown-timeout=900"))
    found = only(findings, "engine-drain")
    assert found.severity is Level.WARNING
    assert found.fix == ()
    assert found.advice is not None
    assert "lower vLLM's --shutdown-timeout to at most 570" in found.advice
    drop_in = render_fix("u.service", findings).splitlines()
    assert not [line for line in drop_in if line.startswith("TimeoutStopSec=")]


def test_a_variable_is_expanded_as_systemd_does_and_an_unset_one_is_not_guessed() -> None:
    """``$DRAIN`` from Environment= is read; an unset one or --config is said, never guessed."""
    expanded = only(
        audit(show(VLLM + " --shutdown-timeout ${DRAIN}", env="DRAIN=120")), "engine-drain"
    )
    assert expanded.fix[-1] == "TimeoutStopSec=2min 30s"
    for command in (VLLM + " --shutdown-timeout $UNSET", VLLM + " --config /etc/vllm/serve.yaml"):
        findings = audit(show(command))
        assert "not understood" in only(findings, "engine-drain").title
        assert only(findings, "engine-drain").fix == ()
        read = only(findings, "engine")
        assert "1 of its settings not understood" in read.title
        assert any("--shutdown-timeout" in line for line in read.evidence)


def test_vllms_ready_timeout_below_the_learned_starts_gets_an_environment_line() -> None:
    """Default 600 s against starts of up to 750 s: a slow load fails; 750 x 1.5 → 19 min."""
    findings = audit(show(VLLM), starts=(700.0, 720.0, 750.0))
    found = only(findings, "engine-ready")
    assert found.severity is Level.WARNING
    assert "vLLM's default VLLM_ENGINE_READY_TIMEOUT_S" in found.evidence[0]
    assert found.fix[-1] == 'Environment="VLLM_ENGINE_READY_TIMEOUT_S=1140"'
    assert 'Environment="VLLM_ENGINE_READY_TIMEOUT_S=1140"' in render_fix("u.service", findings)


def test_a_ready_timeout_from_an_environment_file_is_advice_and_a_covering_one_is_ok() -> None:
    """An EnvironmentFile= wins over a drop-in's Environment=: advice; 1200 s covers the starts."""
    in_file = only(
        audit(show(VLLM), file_env={"VLLM_ENGINE_READY_TIMEOUT_S": "900"}, starts=(750.0,) * 3),
        "engine-ready",
    )
    assert in_file.severity is Level.WARNING
    assert in_file.fix == ()
    assert in_file.advice is not None
    assert "EnvironmentFile=" in in_file.advice
    covered = only(
        audit(show(VLLM, env="VLLM_ENGINE_READY_TIMEOUT_S=1200"), starts=(750.0,) * 3),
        "engine-ready",
    )
    assert covered.severity is Level.OK
    few = only(audit(show(VLLM), starts=(750.0,)), "engine-ready")
    assert few.severity is Level.OK
    assert few.fix == ()


def test_restart_on_failure_on_vllm_is_the_exit_0_hole_with_its_two_fixes() -> None:
    """An exit 0 of vLLM after its engine died: Restart=always, or the daemon's recovery."""
    hole = only(audit(show(VLLM, restart="on-failure")), "exit-0")
    assert hole.severity is Level.WARNING
    assert "#48966" in hole.evidence[0]
    assert hole.fix[-1] == "Restart=always"
    assert hole.advice is not None
    assert 'on_engine_dead = "recover"' in hole.advice
    opted = only(audit(show(VLLM, restart="on-failure"), on_engine_dead="recover"), "exit-0")
    assert opted.severity is Level.OK
    blind = only(
        audit(show(VLLM, restart="on-failure"), on_engine_dead="recover", clean_exit=False),
        "exit-0",
    )
    assert blind.severity is Level.WARNING
    assert blind.advice is not None
    assert "clean_exit_is_death = true" in blind.advice
    assert "exit-0" not in codes(audit(show(VLLM, restart="always")))
    assert "exit-0" not in codes(audit(show(SGLANG, restart="on-failure")))


def test_sglangs_unbounded_drain_needs_a_finite_stop_timeout() -> None:
    """SGLang drains until no request is left: infinity is a warning, its watchdog is named."""
    endless = only(audit(show(SGLANG + " --watchdog-timeout 600", stop="infinity")), "engine-drain")
    assert endless.severity is Level.WARNING
    assert any("600 s crashes the server" in line for line in endless.evidence)
    bounded = only(audit(show(SGLANG)), "engine-drain")
    assert bounded.severity is Level.OK
    assert any("300 s crashes the server (the default" in line for line in bounded.evidence)
    read = only(audit(show(SGLANG)), "engine")
    assert read.title == "ExecStart= runs SGLang"
    assert {"engine-ready", "exit-0"}.isdisjoint(codes(audit(show(SGLANG))))


def test_an_unknown_server_is_said_and_nothing_is_guessed() -> None:
    """A container or a shell line: doctor says what it cannot read and judges no engine setting."""
    for command in (
        "/usr/bin/docker run --gpus all vllm/vllm-openai --shutdown-timeout 300",
        "/usr/bin/bash -c exec",
        "/usr/bin/python3 -m my_server --shutdown-timeout 300",
    ):
        findings = audit(show(command, restart="on-failure"))
        read = only(findings, "engine")
        assert read.severity is Level.OK
        assert "does not know the server" in read.title
        assert {"engine-drain", "engine-ready", "exit-0"}.isdisjoint(codes(findings))
    nothing = parse_show("u.service", "LoadState=loaded\nKillMode=mixed\n")
    assert nothing.exec_start == ()


def test_the_servers_api_key_never_reaches_text_json_or_fix() -> None:
    """--api-key and env's HF_TOKEN are shown redacted wherever the command line is shown."""
    for command in (
        f"{VLLM} --api-key {SECRET} --shutdown-timeout 300",
        f"/usr/bin/env HF_TOKEN={SECRET} {VLLM} --api-key={SECRET} --shutdown-timeout 300",
        f"/usr/bin/docker run -e OPENAI_API_KEY={SECRET} vllm/vllm-openai --api-key {SECRET}",
    ):
        findings = audit(show(command, restart="on-failure"), starts=(750.0,) * 3)
        outputs = (
            render_text({"u.service": findings}),
            json.dumps(render_json({"u.service": findings})),
            render_fix("u.service", findings),
        )
        for output in outputs:
            assert SECRET not in output
        assert "<redacted>" in outputs[0]
        assert "<redacted>" in outputs[1]


def test_one_timeout_stop_line_when_the_drains_seen_and_vllms_own_both_propose() -> None:
    """A killed stop (6 min guess) and --shutdown-timeout 300 (5 min 30 s): one line, the longer."""
    history = History(stops=(Stop("a", 90.0, killed=True),))
    findings = audit(show(VLLM + " --shutdown-timeout 300"), history=history)
    drop_in = render_fix("u.service", findings)
    assert [line for line in drop_in.splitlines() if line.startswith("TimeoutStopSec=")] == [
        "TimeoutStopSec=6min"
    ]
    assert only(findings, "engine-drain").fix == ()
    assert any(
        "stop-timeout fix sets a longer" in e for e in only(findings, "engine-drain").evidence
    )
