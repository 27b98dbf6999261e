"""The Debian package on a real systemd: install, READY, status, sandbox, upgrade, repo, purge.

Each test boots a clean container and installs the .deb that `make deb` / `packaging/build-deb`
left in dist (or `$GPUGUARD_DEB_DIR`) with `apt install ./gpuguard_*.deb`, as an operator would,
offline (the containers have no network). Most run on the release(s) under test; the life-cycle
test runs on Debian 12 and 13 whatever is selected: one package, two Pythons (3.11, 3.13), and
the upgrade from each release's 0.1.0-1 package (`packaging/build-previous`); the repository
test installs from `make repo`'s signed repository. Without a built package the tests skip,
saying how to build one; `GPUGUARD_REQUIRE_DEB=1` (CI) makes that a failure instead. What is at
risk: a package that installs but does not start, or only on one release; an upgrade that leaves
the old environment or a stopped daemon; a sandbox that takes away what gpuguard needs (other
users' /proc/PID/fd, signals, NVML, journalctl, systemctl); a gate drop-in that is installed
silently or outlives the binary it calls; a purge that leaves state behind; a repository whose
signature apt does not check.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from fakestate import build_fake_nvml, write_state

from e2e.container import RELEASES, Bind, Container, ensure_rootfs
from e2e.measure import SESSION_NOTES

if TYPE_CHECKING:
    from e2e.conftest import ContainerFactory

ROOT = Path(__file__).resolve().parents[2]
DEB_DIR_ENV = "GPUGUARD_DEB_DIR"
PREVIOUS_ENV = "GPUGUARD_PREVIOUS_DEB_DIR"  # packaging/build-previous prints it
REQUIRE_ENV = "GPUGUARD_REQUIRE_DEB"
APT_ENV = {"DEBIAN_FRONTEND": "noninteractive"}
UNIT_STARTED = "39f53479d3a045ac8e11786248231fbf"
UPSTREAM = re.search(
    r'^__version__ = "(.+)"$', (ROOT / "src/gpuguard/__init__.py").read_text(), re.MULTILINE
)


def missing(message: str) -> None:
    """Skip for want of a built artifact, or fail where CI requires it."""
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def deb() -> Path:
    """The built package (one for every release); skip (or fail in CI) without one."""
    found = sorted(Path(os.environ.get(DEB_DIR_ENV) or ROOT / "dist").glob("gpuguard_*.deb"))
    if not found:
        missing("no gpuguard .deb in dist: run `packaging/build-deb` (make deb)")
    return found[-1]


def apt(box: Container, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`apt ARGS` inside, non-interactive, from the directory holding the package."""
    return box.run(
        ["sh", "-c", 'cd /debs && exec apt -y "$@"', "apt", *args],
        env=APT_ENV,
        timeout=300,
        check=check,
    )


def install(box: Container, deb: Path) -> None:
    """`apt install ./gpuguard_VERSION_ARCH.deb`, exactly as docs/install.md says."""
    apt(box, "install", f"./{deb.name}")


def wait_active(box: Container, unit: str, timeout: float = 60.0) -> None:
    """Wait until `unit` is active: for gpuguard (Type=notify) that means READY=1 arrived."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        state = box.systemctl("show", "-p", "ActiveState", "--value", unit).stdout.strip()
        if state == "active":
            return
        time.sleep(0.2)
    journal = box.run(["journalctl", "--no-pager", "-u", unit, "-n", "40"], check=False).stdout
    pytest.fail(f"{unit} is {state!r}, not active (READY=1), after {timeout} s:\n{journal}")


def booted_with(container: ContainerFactory, deb: Path, *binds: Bind) -> Container:
    """A booted container with the package's directory at /debs (read-only) and `binds`."""
    return container(binds=[Bind(deb.parent, "/debs"), *binds])


@pytest.fixture
def installed(container: ContainerFactory, deb: Path) -> Container:
    """A booted container with the package installed."""
    box = booted_with(container, deb)
    install(box, deb)
    return box


def test_install_enables_and_starts_the_daemon_which_reaches_ready(
    installed: Container, deb: Path
) -> None:
    """`apt install` succeeds, enables gpuguard.service and starts it; it sends READY=1."""
    version = installed.run(["dpkg-query", "-W", "-f=${Version}", "gpuguard"]).stdout
    assert deb.name == f"gpuguard_{version}_amd64.deb"
    assert installed.systemctl("is-enabled", "gpuguard.service").stdout.strip() == "enabled"
    wait_active(installed, "gpuguard.service")
    shown = installed.systemctl("show", "-p", "Type,SubState,StatusText", "gpuguard.service")
    properties = dict(line.split("=", 1) for line in shown.stdout.splitlines())
    assert properties["Type"] == "notify"
    assert properties["SubState"] == "running"
    assert properties["StatusText"], "the daemon sends STATUS= lines"
    installed.wait_journal(
        ["_PID=1", "UNIT=gpuguard.service", f"MESSAGE_ID={UNIT_STARTED}"], lambda e: len(e) == 1
    )


def test_status_answers_for_root_and_other_users(installed: Container) -> None:
    """/usr/bin/gpuguard runs from the private environment; status answers, also without root."""
    assert UPSTREAM is not None
    version = installed.run(["gpuguard", "--version"]).stdout.strip()
    assert version == f"gpuguard {UPSTREAM[1]}"
    done = installed.run(["gpuguard", "status", "--json"], check=False)
    assert done.returncode in {0, 1, 2, 3}, done.stderr
    document = json.loads(done.stdout)
    assert document["exit_code"] == done.returncode
    assert document["schema_version"] >= 1
    # A watched unit's Environment=PYTHONPATH=... cannot reach into gpuguard's imports (-I).
    installed.write_file("/tmp/evil/pydantic/__init__.py", "raise SystemExit('hijacked')\n")
    hijack = installed.run(
        ["gpuguard", "status"], env={"PYTHONPATH": "/tmp/evil"}, check=False
    )  # fmt: skip
    assert "hijacked" not in hijack.stdout + hijack.stderr
    assert hijack.returncode in {0, 1, 2, 3}
    installed.run(["useradd", "--create-home", "operator1"])
    as_user = installed.run_as("operator1", ["gpuguard", "status"], check=False)
    assert as_user.returncode in {0, 1, 2, 3}, as_user.stderr
    assert "NVML" in as_user.stdout


def test_package_contents_follow_policy(installed: Container) -> None:
    """Conffile, man page, copyright, changelog, example drop-in, state dirs; no unit touched."""
    conffiles = installed.run(["dpkg-query", "-W", "-f=${Conffiles}", "gpuguard"]).stdout
    assert "/etc/gpuguard/gpuguard.toml" in conffiles
    config = installed.read_file("/etc/gpuguard/gpuguard.toml")
    live = [line for line in config.splitlines() if line.strip() and not line.startswith("#")]
    assert live == ["[daemon]", "dry_run = false"], (
        "every setting ships commented out but the line the off switch rewrites"
    )
    for path in (
        "/usr/share/man/man8/gpuguard.8.gz",
        "/usr/share/doc/gpuguard/copyright",
        "/usr/share/doc/gpuguard/changelog.Debian.gz",
        "/usr/share/doc/gpuguard/examples/gpuguard-gate.conf",
        "/usr/share/gpuguard/gpuguard-gate.conf",
        "/usr/share/doc/gpuguard/examples/health-loopback.conf",
        "/usr/share/gpuguard/health-loopback.conf",
    ):
        installed.run(["test", "-s", path])
    dropins = installed.run(
        ["sh", "-c", "ls /etc/systemd/system/*.d/gpuguard-gate.conf 2>/dev/null || true"]
    ).stdout
    assert dropins == "", "the gate drop-in is never installed by the package itself"
    wait_active(installed, "gpuguard.service")
    for directory in ("/run/gpuguard", "/var/lib/gpuguard"):
        mode = installed.run(["stat", "-c", "%U %a", directory]).stdout.split()
        assert mode == ["root", "755"]
    link = installed.run(["readlink", "/usr/lib/gpuguard/venv"]).stdout.strip()
    assert re.fullmatch(r"envs/py3\.\d+-[0-9a-f]{12}", link), link
    compiled = installed.run(
        ["find", "/usr/lib/gpuguard/venv/", "-name", "*.pyc", "-path", "*/gpuguard/*"]
    ).stdout
    assert compiled, "the environment is compiled when it is made"


def _files(box: Container) -> set[str]:
    """Every path on the container's root file system that a package may own or leave."""
    skip = ["/proc", "/sys", "/dev", "/tmp", "/var/tmp", "/var/log", "/var/cache", "/debs"]
    skip += ["/var/lib/apt", "/var/lib/dpkg", "/var/lib/systemd/catalog", "/root"]
    prune = " -o ".join(f"-path {path}" for path in skip)
    out = box.run(["sh", "-c", f"find / -xdev \\( {prune} \\) -prune -o -print"]).stdout
    return set(out.splitlines())


def python_minor(box: Container) -> str:
    """The container's python3 as X.Y."""
    return box.run(["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]).stdout


def timed_apt(box: Container, *args: str) -> float:
    """Seconds `apt ARGS` took."""
    started = time.monotonic()
    apt(box, *args)
    return time.monotonic() - started


@pytest.mark.parametrize("target", sorted(RELEASES))
def test_install_upgrade_remove_purge_on_each_release(target: str, deb: Path) -> None:
    """One package on Debian 12 (3.11) and 13 (3.13): install, purge, upgrade from 0.1.0-1, purge.

    Offline. The environment is made for the container's python3 from the package's wheels; the
    upgrade stops 0.1.0-1's daemon (whose environment dpkg deletes), the new one runs from the
    new environment; python3's trigger keeps it; `apt remove` stops the daemon and takes the
    environment too; purge leaves nothing.
    """
    previous_dir = os.environ.get(PREVIOUS_ENV)
    previous = sorted(Path(previous_dir or "/nonexistent").glob(f"{target}/gpuguard_*.deb"))
    if not previous:
        missing(
            f"no 0.1.0-1 package for {target}: export {PREVIOUS_ENV}=$(packaging/build-previous)"
        )
    binds = [Bind(deb.parent, "/debs"), Bind(previous[-1].parent, "/previous")]
    copy = os.environ.get("GPUGUARD_E2E_MODE") == "copy"
    with Container(ensure_rootfs(target), binds=binds, mode="copy" if copy else "overlay") as box:
        before = _files(box)
        seconds = timed_apt(box, "install", f"./{deb.name}")
        wait_active(box, "gpuguard.service")
        link = box.run(["readlink", "/usr/lib/gpuguard/venv"]).stdout.strip()
        assert link.startswith(f"envs/py{python_minor(box).strip()}-"), link
        apt(box, "purge", "gpuguard")
        assert sorted(_files(box) - before) == []

        apt(box, "install", f"/previous/{previous[-1].name}")
        wait_active(box, "gpuguard.service")
        old_pid = box.systemctl("show", "-p", "MainPID", "--value", "gpuguard.service").stdout
        upgrade = timed_apt(box, "install", f"./{deb.name}")
        wait_active(box, "gpuguard.service")
        pid = box.systemctl("show", "-p", "MainPID", "--value", "gpuguard.service").stdout.strip()
        assert pid != old_pid.strip()
        version = box.run(["dpkg-query", "-W", "-f=${Version}", "gpuguard"]).stdout
        assert deb.name == f"gpuguard_{version}_amd64.deb"
        maps = box.run(["cat", f"/proc/{pid}/maps"]).stdout
        assert f"/usr/lib/gpuguard/{link}/" in maps, "the daemon runs from the new environment"
        box.run(["test", "-L", "/usr/lib/gpuguard/venv"])
        _gate_answers_through_the_resident_server(box)
        # What a python3 upgrade fires (the file trigger): the same Python keeps its environment
        # and its daemon; the package stays configured.
        box.run(["dpkg-trigger", "--no-await", "/usr/bin/python3"])
        fired = box.run(["dpkg", "--triggers-only", "--pending"]).stdout
        assert "Processing triggers for gpuguard" in fired, fired
        assert box.run(["readlink", "/usr/lib/gpuguard/venv"]).stdout.strip() == link
        shown = box.systemctl("show", "-p", "MainPID", "--value", "gpuguard.service").stdout
        assert shown.strip() == pid
        status = box.run(["dpkg-query", "-W", "-f=${Status}", "gpuguard"]).stdout
        assert status == "install ok installed"

        apt(box, "remove", "gpuguard")
        active = box.systemctl("is-active", "gpuguard.service", check=False).stdout.strip()
        assert active in {"inactive", "unknown"}
        assert box.run(["pgrep", "-x", "gpuguard"], check=False).stdout == ""
        for path in ("/usr/bin/gpuguard", "/usr/lib/gpuguard"):
            assert box.run(["test", "-e", path], check=False).returncode == 1, path
        box.run(["test", "-f", "/etc/gpuguard/gpuguard.toml"])  # remove keeps conffiles
        apt(box, "purge", "gpuguard")
        assert sorted(_files(box) - before) == []
    note = f"package on {target}: install {seconds:.1f} s, upgrade from 0.1.0-1 {upgrade:.1f} s"
    SESSION_NOTES.append(note)
    print(note)  # noqa: T201


def _gate_answers_through_the_resident_server(box: Container) -> None:
    """0.1.0-1's socket had Accept=yes and per-connection servers: after the upgrade, Accept=no.

    A request from a user outside any service is refused by the server's own request process
    (no NVML needed), so its one line proves the new socket and server answer.
    """
    accept = box.systemctl("show", "-p", "Accept", "--value", "gpuguard-gate.socket")
    assert accept.stdout.strip() == "no"
    asked = box.run(
        ["runuser", "-u", "nobody", "--", "gpuguard", "gate", "--unit", "sglang.service"],
        check=False,
    )
    assert asked.returncode == 1
    refused = "gpuguard: request from a process outside any service (uid 65534): refused"
    assert asked.stderr.strip() == refused, asked.stderr
    state = box.systemctl("show", "-p", "ActiveState", "--value", "gpuguard-gate.service")
    assert state.stdout.strip() == "active", "the socket started the resident server"
    journal = box.run(["journalctl", "--no-pager", "-u", "gpuguard-gate.service"]).stdout
    assert refused in journal, journal


def test_install_from_the_signed_repository(container: ContainerFactory, deb: Path) -> None:
    """`apt-get install gpuguard` from `make repo`'s repository, and only under its key.

    Added with signed-by= as docs/install.md says: under another key apt refuses it; under its
    own, a preferences pin names the version apt takes.
    """
    repo = Path(os.environ.get(DEB_DIR_ENV) or ROOT / "dist") / "repo"
    if not (repo / "gpuguard-archive-keyring.gpg").exists():
        missing("no repository in dist/repo: run `packaging/build-repo` (make repo)")
    box = container(binds=[Bind(repo, "/srv/repo")])
    # A host whose only source is gpuguard's repository (the container has no network anyway).
    box.run(["sh", "-c", "rm -f /etc/apt/sources.list /etc/apt/sources.list.d/*"])
    sources = (
        "Types: deb\nURIs: file:/srv/repo\nSuites: stable\nComponents: main\n"
        "Signed-By: /etc/apt/keyrings/gpuguard-archive-keyring.gpg\n"
    )
    box.write_file("/etc/apt/sources.list.d/gpuguard.sources", sources)
    box.run(["mkdir", "-p", "/etc/apt/keyrings"])
    box.run(
        ["cp", "/usr/share/keyrings/debian-archive-keyring.gpg",
         "/etc/apt/keyrings/gpuguard-archive-keyring.gpg"]
    )  # fmt: skip
    refused = box.run(["apt-get", "update"], env=APT_ENV, check=False)
    assert "NO_PUBKEY" in refused.stdout + refused.stderr
    assert box.run(["apt-get", "install", "-y", "gpuguard"], env=APT_ENV, check=False).returncode

    box.run(["cp", "/srv/repo/gpuguard-archive-keyring.gpg", "/etc/apt/keyrings/"])
    box.run(["apt-get", "update"], env=APT_ENV)
    version = deb.name.split("_")[1]
    box.write_file(
        "/etc/apt/preferences.d/gpuguard",
        f"Package: gpuguard\nPin: version {version}\nPin-Priority: 1001\n",
    )
    policy = box.run(["apt-cache", "policy", "gpuguard"]).stdout
    assert f"Candidate: {version}" in policy
    assert "file:/srv/repo stable/main amd64" in policy
    box.run(["apt-get", "install", "-y", "gpuguard"], env=APT_ENV, timeout=300)
    installed = box.run(["dpkg-query", "-W", "-f=${Version}", "gpuguard"]).stdout
    assert installed == version
    wait_active(box, "gpuguard.service")


_FAKE_SGLANG = """\
[Unit]
Description=stand-in for an SGLang server

[Service]
ExecStart=/bin/sleep infinity
"""


def test_gate_dropin_is_installed_by_hand_and_taken_back_on_removal(installed: Container) -> None:
    """The documented cp installs the gate; apt remove deletes unchanged copies, keeps changed."""
    for unit in ("sglang-a.service", "sglang-b.service"):
        installed.write_file(f"/etc/systemd/system/{unit}", _FAKE_SGLANG)
        installed.run(["mkdir", "-p", f"/etc/systemd/system/{unit}.d"])
        installed.run(
            ["cp", "/usr/share/gpuguard/gpuguard-gate.conf", f"/etc/systemd/system/{unit}.d/"]
        )
    changed = "/etc/systemd/system/sglang-b.service.d/gpuguard-gate.conf"
    installed.run(["sh", "-c", f"echo TimeoutStopSec=30 >>{changed}"])
    installed.systemctl("daemon-reload")
    pre = installed.systemctl("show", "-p", "ExecStartPre", "sglang-a.service").stdout
    assert "/usr/bin/gpuguard" in pre
    assert "gate" in pre

    removed = apt(installed, "remove", "gpuguard")
    assert "removed the gate drop-in /etc/systemd/system/sglang-a.service.d" in removed.stdout
    # apt passes the maintainer scripts' stderr on with its stdout.
    assert f"{changed} differs from the shipped drop-in" in removed.stdout + removed.stderr
    gone = installed.run(["test", "-e", "/etc/systemd/system/sglang-a.service.d"], check=False)
    assert gone.returncode == 1, "the emptied drop-in directory goes too"
    installed.run(["test", "-f", changed])
    cat = installed.systemctl("cat", "sglang-a.service").stdout
    assert "gpuguard" not in cat
    installed.systemctl("start", "sglang-a.service")
    assert installed.systemctl("is-active", "sglang-a.service").stdout.strip() == "active"


_PROBE = """\
#!/bin/sh
# Runs inside gpuguard.service's sandbox (the unit's own [Service] hardening lines).
gpuguard status --json >/run/gpuguard/probe-status.json
echo "status-exit=$?"
if journalctl --quiet --no-pager -n 1 _PID=1 >/dev/null; then echo journal=ok
else echo journal=denied; fi
if systemctl restart probe-target.service; then echo systemctl=ok; else echo systemctl=denied; fi
if touch /etc/gpuguard/probe 2>/dev/null; then echo etc=writable; else echo etc=read-only; fi
if python3 -c 'import socket; socket.socket(socket.AF_INET)' 2>/dev/null; then echo inet=allowed
else echo inet=denied; fi
# In this process, as the daemon reaps (no gate server: a root service may not ask it for
# another unit).
gpuguard reap --unit sglang.service --scope all --yes --grace 2 --timeout 15 --json \\
  --socket /run/gpuguard/none.sock >/run/gpuguard/probe-reap.json
echo "reap-exit=$?"
"""

_PROBE_TARGET = """\
[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/true
"""

# Lines of gpuguard.service that make it a long-running notify daemon, not part of its sandbox.
_NOT_SANDBOX = re.compile(
    r"^(Type|NotifyAccess|WatchdogSec|ExecStart|Restart|RestartSec|RestartPreventExitStatus|"
    r"StartLimitIntervalSec|StartLimitBurst|After|Description|Documentation|WantedBy)="
)


def probe_unit(service: str) -> str:
    """gpuguard.service's sandbox around the probe script, as a oneshot unit."""
    lines = [
        line
        for line in service.splitlines()
        if line.strip() and not line.startswith("#") and not _NOT_SANDBOX.match(line)
    ]
    lines = lines[: lines.index("[Install]")] if "[Install]" in lines else lines
    return "\n".join(
        [
            *lines,
            "Type=oneshot",
            "Environment=FAKENVML_STATE=/srv/fake",
            "ExecStart=/bin/sh /usr/local/sbin/gpuguard-probe",
            "",
        ]
    )


def test_sandbox_keeps_what_gpuguard_needs(
    container: ContainerFactory, deb: Path, tmp_path: Path
) -> None:
    """In gpuguard.service's sandbox: another user's holder seen and killed, journal, systemctl.

    Through NVML (the fake library) and /proc it sees a GPU holder of another user with its device
    files and kills it, reads the journal and restarts a unit; it cannot write /etc or use the
    network.
    """
    if shutil.which("make") is None or shutil.which("gcc") is None:
        pytest.skip("needs gcc and make for the fake libnvidia-ml (tests/fakenvml)")
    state = write_state(tmp_path / "fake")
    for path in (state, *state.rglob("*")):
        path.chmod(0o777 if path.is_dir() else 0o666)
    box = booted_with(
        container,
        deb,
        Bind(state, "/srv/fake", read_only=False),
        Bind(build_fake_nvml(), "/fakelib"),
        Bind(ROOT / "tests/fakenvml", "/fakenvml"),
    )
    install(box, deb)
    box.run(["cp", "/fakelib/libnvidia-ml.so.1", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"])
    box.run(["ldconfig"])
    box.write_file(
        "/etc/gpuguard/gpuguard.toml",
        'allow_plain_device_files = true\ndevice_glob = "/srv/fake/dev/nvidia*"\n',
    )
    box.run(["useradd", "--create-home", "inference"])
    box.run_as(
        "inference",
        [
            "sh",
            "-c",
            (
                "setsid -f python3 /fakenvml/gpu_hold.py --state /srv/fake --gpus 0 --mib 1000 "
                "--name sglang::scheduler >/srv/fake/holder.json 2>/srv/fake/holder.err"
            ),
        ],
    )
    answer = state / "holder.json"
    box.wait_for(
        "the fake GPU holder", lambda: answer.exists() and answer.read_text().strip() != ""
    )
    holder = json.loads(answer.read_text())["pid"]

    fragment = box.systemctl("show", "-p", "FragmentPath", "--value", "gpuguard.service").stdout
    box.write_file("/etc/systemd/system/probe-target.service", _PROBE_TARGET)
    box.write_file("/usr/local/sbin/gpuguard-probe", _PROBE, mode=0o755)
    box.write_file(
        "/etc/systemd/system/gpuguard-probe.service", probe_unit(box.read_file(fragment.strip()))
    )
    box.systemctl("daemon-reload")
    box.systemctl("start", "gpuguard-probe.service", check=False)
    said = box.wait_journal(
        ["_SYSTEMD_UNIT=gpuguard-probe.service"],
        lambda entries: any(str(e.get("MESSAGE", "")).startswith("reap-exit=") for e in entries),
        timeout=60,
    )
    results = dict(
        str(e["MESSAGE"]).split("=", 1) for e in said if "=" in str(e.get("MESSAGE", ""))
    )

    status = json.loads(box.read_file("/run/gpuguard/probe-status.json"))
    assert status["nvml"]["health"] == "ok", status["nvml"]
    seen = {h["pid"]: h for h in status["holders"]}
    assert holder in seen, f"holder {holder} not seen in the sandbox: {status['holders']}"
    assert seen[holder]["user"] == "inference"
    assert seen[holder]["device_files"], "other users' /proc/PID/fd must be readable"
    assert results["journal"] == "ok"
    assert results["systemctl"] == "ok"
    assert results["etc"] == "read-only"
    assert results["inet"] == "denied"
    assert results["reap-exit"] == "0", box.read_file("/run/gpuguard/probe-reap.json")
    gone = box.run(["sh", "-c", f"ps -o stat= -p {holder} || true"]).stdout.strip()
    assert gone in {"", "Z"}, f"holder {holder} survived the reap ({gone})"


_EXPOSURE = re.compile(r"Overall exposure level for gpuguard\.service: (\d+\.\d)")
_RECORDED = re.compile(r"systemd (\d+): (\d+\.\d)")


def test_security_exposure_is_at_most_4_and_recorded_in_the_unit(
    installed: Container, release: str
) -> None:
    """`systemd-analyze security` rates gpuguard.service <= 4.0, the score its comment records."""
    done = installed.run(["systemd-analyze", "security", "--no-pager", "gpuguard.service"])
    match = _EXPOSURE.search(done.stdout)
    assert match is not None, done.stdout[-2000:]
    score = float(match[1])
    assert score <= 4.0, done.stdout
    unit = (ROOT / "systemd/gpuguard.service").read_text()
    recorded = {int(version): float(value) for version, value in _RECORDED.findall(unit)}
    assert recorded.get(RELEASES[release]) == score, (
        f"update the score comment in systemd/gpuguard.service: systemd {RELEASES[release]} "
        f"rates it {score}"
    )


def test_build_refuses_a_changelog_that_disagrees_with_the_version(tmp_path: Path) -> None:
    """packaging/build-deb stops at once when debian/changelog names another upstream version."""
    for name in ("packaging/build-deb", "packaging/debian/changelog", "src/gpuguard/__init__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    changelog = tmp_path / "packaging/debian/changelog"
    changelog.write_text(re.sub(r"\(([^)]*)\)", "(99.0.0-1)", changelog.read_text(), count=1))
    done = subprocess.run(
        [str(tmp_path / "packaging/build-deb")], capture_output=True, text=True, check=False
    )
    assert done.returncode == 1
    assert "version mismatch" in done.stderr
    assert "99.0.0-1" in done.stderr


_GATE_EXPOSURE = re.compile(r"Overall exposure level for gpuguard-gate\.service: (\d+\.\d)")


def test_gate_socket_listens_for_every_user_and_its_server_scores_at_most_2(
    installed: Container, release: str
) -> None:
    """Installing enables the gate socket (0666, root's); `systemd-analyze security` <= 2.0.

    The rating is of gpuguard-gate.service, the server the socket starts (systemd rates
    services, not sockets); the unit's comment records it for each release we test.
    """
    for query in ("is-enabled", "is-active"):
        state = installed.systemctl(query, "gpuguard-gate.socket", check=False).stdout.strip()
        assert state in {"enabled", "active"}, f"gpuguard-gate.socket {query}: {state}"
    mode = installed.run(["stat", "-c", "%A %U", "/run/gpuguard/gate.sock"]).stdout.strip()
    assert mode in {"srwxrwxrwx root", "srw-rw-rw- root"}, mode
    done = installed.run(["systemd-analyze", "security", "--no-pager", "gpuguard-gate.service"])
    match = _GATE_EXPOSURE.search(done.stdout)
    assert match is not None, done.stdout[-2000:]
    score = float(match[1])
    print(f"systemd-analyze security gpuguard-gate.service on {release}: {score}")  # noqa: T201
    assert score <= 2.0, done.stdout
    unit = (ROOT / "systemd/gpuguard-gate.service").read_text()
    recorded = {int(version): float(value) for version, value in _RECORDED.findall(unit)}
    assert recorded.get(RELEASES[release]) == score, (
        f"update the score comment in systemd/gpuguard-gate.service: systemd "
        f"{RELEASES[release]} rates it {score}"
    )
