"""The gate drop-in: one source for its text; install and remove touch only gpuguard's file."""

from __future__ import annotations

from pathlib import Path

from gpuguard.adapters import dropin

SHIPPED = Path(__file__).resolve().parents[2] / "systemd" / "gpuguard-gate.conf"


def test_shipped_example_is_the_rendered_text() -> None:
    """systemd/gpuguard-gate.conf is exactly what install-gate writes for /usr/bin/gpuguard."""
    assert SHIPPED.read_text() == dropin.render("/usr/bin/gpuguard")


def test_every_setting_line_is_commented() -> None:
    """Each directive has a comment line right above it."""
    lines = dropin.render().splitlines()
    for number, line in enumerate(lines):
        if "=" in line and not line.startswith("#"):
            assert lines[number - 1].startswith("#"), line


def test_the_stop_timeout_is_left_to_the_unit() -> None:
    """No TimeoutStopSec=: it would silently replace the operator's drain budget (docs/gate.md)."""
    settings = [line for line in dropin.render().splitlines() if not line.startswith("#")]
    assert not [line for line in settings if line.startswith("TimeoutStopSec")]
    assert "KillMode=mixed" in settings


def test_install_then_remove(tmp_path: Path) -> None:
    """Install writes the file once, calling the given gpuguard; remove deletes it and its dir."""
    change = dropin.install("sglang.service", "/opt/gpuguard/bin/gpuguard", systemd_dir=tmp_path)
    assert change.action == "installed"
    text = change.path.read_text()
    assert "ExecStartPre=/opt/gpuguard/bin/gpuguard gate --unit %n" in text
    assert change.path == tmp_path / "sglang.service.d" / "gpuguard-gate.conf"
    again = dropin.install("sglang.service", "/opt/gpuguard/bin/gpuguard", systemd_dir=tmp_path)
    assert again.action == "unchanged"
    assert dropin.remove("sglang.service", systemd_dir=tmp_path).action == "removed"
    assert not (tmp_path / "sglang.service.d").exists()
    assert dropin.remove("sglang.service", systemd_dir=tmp_path).action == "absent"


def test_foreign_or_edited_files_are_left_alone(tmp_path: Path) -> None:
    """A file gpuguard did not write, or one edited since, is never overwritten or removed."""
    path = dropin.drop_in_path("vllm.service", tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("[Service]\nExecStartPre=/bin/true\n")
    assert dropin.install("vllm.service", "/usr/bin/gpuguard", systemd_dir=tmp_path).refused
    assert dropin.remove("vllm.service", systemd_dir=tmp_path).refused
    assert path.read_text() == "[Service]\nExecStartPre=/bin/true\n"
    path.write_text(dropin.render() + "TimeoutStopSec=30\n")
    refused = dropin.install("vllm.service", "/usr/bin/gpuguard", systemd_dir=tmp_path)
    assert refused.refused is not None
    assert "changed since" in refused.refused


def test_other_drop_ins_survive_removal(tmp_path: Path) -> None:
    """Removing the gate keeps the unit's other drop-ins and their directory."""
    dropin.install("sglang.service", "/usr/bin/gpuguard", systemd_dir=tmp_path)
    other = tmp_path / "sglang.service.d" / "override.conf"
    other.write_text("[Service]\nNice=5\n")
    assert dropin.remove("sglang.service", systemd_dir=tmp_path).action == "removed"
    assert other.exists()


def test_remove_keeps_an_edited_drop_in_and_says_so(tmp_path: Path) -> None:
    """Only a byte-identical file goes, whatever gpuguard path it calls; an edit is kept."""
    installed = dropin.install("sglang.service", "/opt/gg/bin/gpuguard", systemd_dir=tmp_path)
    path = installed.path
    edited = path.read_text().replace("KillMode=mixed", "KillMode=mixed\nNice=5")
    path.write_text(edited)
    kept = dropin.remove("sglang.service", systemd_dir=tmp_path)
    assert kept.action == "kept"
    assert kept.refused is not None
    assert f"kept {path}" in kept.refused
    assert path.read_text() == edited
    path.write_text(dropin.render("/opt/gg/bin/gpuguard") + "\n")  # one byte more
    assert dropin.remove("sglang.service", systemd_dir=tmp_path).action == "kept"
    path.write_text(dropin.render("/opt/gg/bin/gpuguard"))
    assert dropin.remove("sglang.service", systemd_dir=tmp_path).action == "removed"


SOCKET = "/run/gpuguard/gate.sock"
UNSET = {
    "RestrictAddressFamilies": "~",
    "SystemCallFilter": "~",
    "InaccessiblePaths": "",
    "TemporaryFileSystem": "",
    "RootDirectory": "",
    "RootImage": "",
}


def test_an_unsandboxed_unit_reaches_the_socket() -> None:
    """`systemctl show` of a unit without these options: no problem (PrivateNetwork= is none)."""
    assert dropin.sandbox_problems(UNSET, SOCKET) == []
    allowed = {**UNSET, "RestrictAddressFamilies": "AF_UNIX AF_INET", "InaccessiblePaths": "/home"}
    assert dropin.sandbox_problems(allowed, SOCKET) == []
    service_set = {**UNSET, "SystemCallFilter": "close connect socket read write"}
    assert dropin.sandbox_problems(service_set, SOCKET) == []


def test_each_way_a_sandbox_keeps_the_gate_from_the_socket_is_named() -> None:
    """Values as systemd 252 prints them (probed in the e2e container)."""
    cases = {
        "RestrictAddressFamilies": ("AF_INET AF_INET6", "forbids AF_UNIX"),
        "SystemCallFilter": ("~accept bind connect socket", "forbids socket and connect()"),
        "InaccessiblePaths": ("-/run", "InaccessiblePaths=-/run hides /run/gpuguard/gate.sock"),
        "TemporaryFileSystem": ("/run/gpuguard:ro", "hides /run/gpuguard/gate.sock"),
        "RootDirectory": ("/srv/root", "RootDirectory=/srv/root runs the gate in another root"),
    }
    for key, (value, said) in cases.items():
        problems = dropin.sandbox_problems({**UNSET, key: value}, SOCKET)
        assert len(problems) == 1, (key, problems)
        assert said in problems[0], problems
    none = dropin.sandbox_problems({**UNSET, "RestrictAddressFamilies": ""}, SOCKET)
    assert none == ["RestrictAddressFamilies=none forbids AF_UNIX sockets: add AF_UNIX"]
    near = dropin.sandbox_problems({**UNSET, "InaccessiblePaths": "/run/gpu"}, SOCKET)
    assert near == []


def test_no_line_of_the_drop_in_runs_gpuguard_with_privileges() -> None:
    """No "+" (nor "!"): the gate and the stop-reap run as the unit's user and ask the server."""
    commands = [
        line
        for line in dropin.render().splitlines()
        if line.startswith(("ExecStartPre=", "ExecStopPost="))
    ]
    assert commands == [
        "ExecStartPre=/usr/bin/gpuguard gate --unit %n",
        "ExecStopPost=-/usr/bin/gpuguard reap --unit %n --yes --grace 5 --timeout 20",
    ]


def test_a_unit_is_gated_while_gpuguards_drop_in_is_there(tmp_path: Path) -> None:
    """The gate server serves a unit whose drop-in gpuguard wrote (an edited one too), no other."""
    assert not dropin.installed("sglang.service", systemd_dir=tmp_path)
    dropin.install("sglang.service", "/usr/bin/gpuguard", systemd_dir=tmp_path)
    assert dropin.installed("sglang.service", systemd_dir=tmp_path)
    path = dropin.drop_in_path("sglang.service", tmp_path)
    path.write_text(path.read_text() + "TimeoutStopSec=900\n")
    assert dropin.installed("sglang.service", systemd_dir=tmp_path), "edited, still gpuguard's"
    foreign = dropin.drop_in_path("cron.service", tmp_path)
    foreign.parent.mkdir()
    foreign.write_text("[Service]\nExecStartPre=/usr/bin/gpuguard gate --unit %n\n")
    assert not dropin.installed("cron.service", systemd_dir=tmp_path)
    for odd in ("..", "a/b.service", "", "x" * 300):
        assert not dropin.installed(odd, systemd_dir=tmp_path), odd


def test_a_restart_of_the_gate_server_never_kills_a_request() -> None:
    """gpuguard-gate.service waits longer than the server lets any request run (upgrades)."""
    from gpuguard.adapters import gateserver  # noqa: PLC0415 - only this test needs it

    unit = (Path(__file__).parents[2] / "systemd" / "gpuguard-gate.service").read_text()
    settings = dict(
        line.split("=", 1) for line in unit.splitlines() if "=" in line and line[0] != "#"
    )
    assert settings["KillMode"] == "mixed"  # SIGTERM to the parent alone, which lets them finish
    assert float(settings["TimeoutStopSec"]) > gateserver.REQUEST_LIMIT_S
