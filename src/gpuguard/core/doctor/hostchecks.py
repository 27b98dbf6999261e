"""doctor's checks of what a unit shares with the host: GPUs, paths, persistence mode, MIG.

Two servers on one GPU, processes holding GPUs outside the unit's set (its gate and recoveries
would look elsewhere), a PATH entry the service user can change while root runs in the unit's
environment, GPUs the driver tears down between runs, MIG GPUs gpuguard does not judge, and a
TCP health check the daemon's sandbox cannot make.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from gpuguard.core.doctor.findings import NAME_CHARS, VALUE_CHARS, Finding, show
from gpuguard.core.levels import Level
from gpuguard.core.mig import UNJUDGED, indices_text

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gpuguard.core.doctor.facts import AuditedUnit, HostFacts, PathFact


def gpu_set(facts: AuditedUnit, others: Mapping[str, AuditedUnit]) -> list[Finding]:
    """The unit's GPU set, and the other watched units it shares GPUs with."""
    mine = _gpus(facts)
    unit = facts.config.unit
    found: list[Finding] = []
    if mine is None:
        found.append(
            Finding(
                "gpu-set",
                Level.WARNING if others else Level.OK,
                "no GPU set: neither gpus in gpuguard's configuration nor CUDA_VISIBLE_DEVICES; "
                "the unit may use every GPU",
                fix=("# the GPUs this server uses, e.g.", 'Environment="CUDA_VISIBLE_DEVICES=0,1"')
                if others
                else (),
            )
        )
    for name, other in sorted(others.items()):
        theirs = _gpus(other)
        shared = (
            "all"
            if mine is None or theirs is None
            else show(",".join(sorted(mine & theirs)), VALUE_CHARS)
        )
        if shared:
            found.append(
                Finding(
                    "gpu-overlap",
                    Level.WARNING,
                    f"shares GPUs ({shared}) with {show(name, VALUE_CHARS)}",
                    (
                        f"{show(unit, VALUE_CHARS)}: {_describe_gpus(mine)}",
                        f"{show(name, VALUE_CHARS)}: {_describe_gpus(theirs)}",
                    ),
                    advice="give each unit disjoint CUDA_VISIBLE_DEVICES (and gpus in the config)",
                )
            )
    return found


def gpu_use(facts: AuditedUnit) -> list[Finding]:
    """The GPU set against what the unit's processes hold now (NVML and /proc)."""
    use = facts.use
    if use is None or not use.held:
        return []
    held = ",".join(str(i) for i in sorted(use.held))
    fix = ("# the GPUs this server's processes hold", f'Environment="CUDA_VISIBLE_DEVICES={held}"')
    if use.set_indices is not None and not use.held <= use.set_indices:
        outside = ",".join(str(i) for i in sorted(use.held - use.set_indices))
        listed = ",".join(str(i) for i in sorted(use.set_indices)) or "none"
        return [
            Finding(
                "gpu-use",
                Level.WARNING,
                f"its processes hold GPUs {outside} outside its GPU set ({listed})",
                (f"held now: GPUs {held}",),
                advice="the gate and recoveries look only at the set: make it name every GPU "
                "the server uses",
                fix=fix,
            )
        ]
    if use.set_indices is None and len(use.held) < use.gpu_count:
        return [
            Finding(
                "gpu-use",
                Level.OK,
                f"its processes hold GPUs {held} of {use.gpu_count}, but its GPU set is all GPUs",
                advice="name them, so its gate never waits for another server's GPUs",
                fix=fix,
            )
        ]
    return [Finding("gpu-use", Level.OK, f"its processes hold GPUs {held}, all in its set")]


def _gpus(facts: AuditedUnit) -> frozenset[str] | None:
    """The unit's GPUs as tokens (indices or UUIDs); None: all of them."""
    if facts.gpus is not None:
        return frozenset(str(g) for g in facts.gpus)
    visible = facts.environment.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    return frozenset(t.strip() for t in visible[:VALUE_CHARS].split(",") if t.strip())


def _describe_gpus(gpus: frozenset[str] | None) -> str:
    if gpus is None:
        return "all GPUs"
    return "GPUs " + show(",".join(sorted(gpus)), VALUE_CHARS)


def writable_paths(facts: AuditedUnit) -> list[Finding]:
    """Paths in PATH, LD_LIBRARY_PATH and EnvironmentFile= that the service user can change.

    Anything root runs for the unit in its environment (an ExecStartPre=+ line, a helper that
    sources its environment file) then runs or reads what that user chose.
    """
    uid = facts.user_uid
    if uid is None or uid == 0:
        return []
    found: list[Finding] = []
    for path, chain in sorted(facts.paths.items()):
        culprit = next((fact for fact in chain if _writable_by(fact, uid)), None)
        if culprit is None:
            continue
        why = "owned by the service user" if culprit.uid == uid else "group/other-writable"
        found.append(
            Finding(
                "writable-path",
                Level.WARNING,
                f"{show(path, VALUE_CHARS)} can be changed by the service user "
                f"({show(facts.config.user or '', NAME_CHARS)})",
                (f"{show(culprit.path, VALUE_CHARS)}: {why}, mode {culprit.mode & 0o7777:04o}",),
                advice="make it root-owned and not group/other-writable, or drop it from the "
                "unit's environment",
            )
        )
    return found


def _writable_by(fact: PathFact, uid: int) -> bool:
    if fact.uid == uid:
        return True
    sticky = fact.is_dir and fact.mode & 0o1000
    return bool(fact.mode & 0o022) and not sticky


def mig(host: HostFacts) -> list[Finding]:
    """MIG mode on: what gpuguard cannot judge there, so the operator does not rely on it."""
    if not host.mig_on:
        return []
    listed = indices_text(host.mig_on)
    return [
        Finding(
            "mig",
            Level.WARNING,
            f"MIG mode is on on GPU {listed}: {UNJUDGED}; the gate and the daemon neither wait "
            "on nor reap from it, and a unit's GPU set leaves it out",
            (f"nvmlDeviceGetMigMode: current mode enabled on GPU {listed}",),
            advice="check its instances with `nvidia-smi mig -lgi`; stale processes there "
            "must be found and stopped by hand",
        )
    ]


def persistenced(host: HostFacts) -> list[Finding]:
    """Persistence mode as NVML reports it, else whether its daemon runs."""
    daemon = f"nvidia-persistenced is {'' if host.persistenced_running else 'not '}running"
    advice = "systemctl enable --now nvidia-persistenced"
    if host.persistence_off:
        listed = ",".join(str(i) for i in host.persistence_off)
        return [
            Finding(
                "persistenced",
                Level.WARNING,
                f"persistence mode is off on GPUs {listed}: the driver tears them down between "
                "runs, slowing every start, and idle memory readings are less stable",
                (daemon,),
                advice=advice,
            )
        ]
    if host.persistence_off is not None:
        return [Finding("persistenced", Level.OK, "persistence mode is on on every GPU")]
    if not host.nvidia_devices:
        return []
    if host.persistenced_running:
        return [Finding("persistenced", Level.OK, daemon)]
    return [
        Finding(
            "persistenced",
            Level.WARNING,
            f"{daemon}: the driver tears GPUs down between runs, "
            "slowing every start, and idle memory readings are less stable",
            advice=advice,
        )
    ]


HEALTH_DROPIN: Final = "/usr/share/gpuguard/health-loopback.conf"
"""The shipped drop-in that lets gpuguard.service reach loopback TCP (docs/liveness.md)."""
HEALTH_FIX: Final = (
    f"sudo install -D -m 0644 {HEALTH_DROPIN} "
    "/etc/systemd/system/gpuguard.service.d/health-loopback.conf && "
    "sudo systemctl daemon-reload && sudo systemctl restart gpuguard.service"
)


def health_sandbox(facts: AuditedUnit, host: HostFacts) -> list[Finding]:
    """A ``health_url`` the daemon cannot reach: gpuguard.service has no network for TCP."""
    url, sandbox = facts.health_url, host.daemon_sandbox
    if url is None or not sandbox:
        return []
    if sandbox.get("LoadState") != "loaded":
        return []
    private = sandbox.get("PrivateNetwork") == "yes"
    families = sandbox.get("RestrictAddressFamilies", "").split()
    unix_only = bool(families) and not families[0].startswith("~") and "AF_INET" not in families
    if not private and not unix_only:
        return []
    shown = [
        *(["PrivateNetwork=yes"] if private else []),
        *([f"RestrictAddressFamilies={' '.join(families)}"] if unix_only else []),
    ]
    return [
        Finding(
            "health-sandbox",
            Level.WARNING,
            f"health_url {show(url, VALUE_CHARS)} is TCP, but gpuguard.service runs with "
            f"{' and '.join(shown)}: the daemon cannot ask it (the check is skipped, never "
            "counted as failed)",
            (f"gpuguard.service: {', '.join(shown)}",),
            advice=f"install the loopback drop-in: {HEALTH_FIX}",
        )
    ]
