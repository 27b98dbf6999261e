"""``unitfacts.gather``, the gate's and reap's one read of a unit, as each asker stands to it.

Stand-ins, and why: what systemd says comes from the test doubles of ``systemctl`` and
``journalctl`` (clirunner.FakeSystemd), since systemd cannot run in this container (its PID 1 is
not systemd). gpuguard runs both by absolute path only (adapters/programs), so the doubles are
bound over the real programs in a private mount namespace (Cli.prefix) and ``gather`` runs in a
child process there. The unit's cgroup is a real cgroup v2 directory this test makes
(unit_cgroups), not one systemd made; the ledger's runs hold ``sleep`` processes standing for a
run's workers. Everything else is real: the asker is read from /proc (peer.own_caller), and the
unit's GPU variables and the provenance ledger are real files in the runtime directory. The
end-to-end suite runs the same path against a real systemd.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from typing import TYPE_CHECKING, Any

from clirunner import ENDED, LAST, unit_name

from gpuguard.adapters import ledgerstore, procfs, unitenv
from gpuguard.core.ledger import Ledger, SeenProcess

if TYPE_CHECKING:
    from clirunner import Cli, FakeSystemd, UnitCgroups

# The child's whole work: gather for itself, then print what the facts hold.
_GATHER = r"""
import json, sys
from pathlib import Path
from gpuguard.adapters import peer, unitfacts
unit, runtime, trust = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "trust"
facts = unitfacts.gather(unit, peer.own_caller(), runtime, trust_unknown=trust)
found = facts.provenance
print(json.dumps({
    "error": facts.state.error,
    "inside": facts.inside,
    "live": facts.live,
    "environment": facts.environment,
    "provenance": {
        "problem": found.problem,
        "invocations": sorted(found.invocations),
        "uid": found.uid,
        "ledger": sorted([p.pid, p.start_time, run] for p, run in found.ledger),
        "elsewhere": sorted([p.pid, p.start_time] for p in found.elsewhere),
    },
    "notices": list(facts.notices),
}))
"""
_BUS = "Failed to connect to bus: No such file or directory"


def _gather(
    cli: Cli,
    unit: str,
    *,
    cgroups: UnitCgroups | None = None,
    trust: bool = False,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """What ``gather`` says to a child asker; ``cgroups``: the child runs in the unit's cgroup.

    ``trust``: root runs gpuguard itself (an in-process gate), as ``trust_unknown``.
    """
    runtime = cli.config.parent / "run"
    command = [
        *cli.prefix(),
        sys.executable,
        "-c",
        _GATHER,
        unit,
        str(runtime),
        "trust" if trust else "-",
    ]
    if cgroups is not None:  # the way systemd starts ExecStopPost=: a process of the unit's cgroup
        procs = shlex.quote(str(cgroups.ensure(unit) / "cgroup.procs"))
        command = ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *command]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**cli.env, **(env or {})},
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    facts: dict[str, Any] = json.loads(done.stdout)
    return facts


def test_the_units_control_process_brings_its_own_environment_and_ends_its_run(
    cli: Cli, fake_systemd: FakeSystemd, unit_cgroups: UnitCgroups
) -> None:
    """Its ExecStopPost=: its own environment wins over Environment=, and no run is live."""
    unit = unit_name()
    fake_systemd(
        unit,
        state="deactivating",
        sub_state="stop-post",
        control=True,
        environment="CUDA_VISIBLE_DEVICES=0,1",
    )

    facts = _gather(cli, unit, cgroups=unit_cgroups, env={"CUDA_VISIBLE_DEVICES": "2"})

    assert facts["inside"] is True
    assert facts["environment"]["CUDA_VISIBLE_DEVICES"] == "2"  # EnvironmentFile= included
    assert facts["live"] is None  # "deactivating", yet the run it stops is over
    assert facts["provenance"] == {
        "problem": None,
        "invocations": sorted([ENDED, LAST]),  # the ending run counts among the ended ones
        "uid": 0,
        "ledger": [],
        "elsewhere": [],
    }
    assert facts["notices"] == []
    # Root recorded the unit's GPU variables for the daemon's recoveries and for status.
    assert unitenv.recorded(cli.config.parent / "run", unit) == {"CUDA_VISIBLE_DEVICES": "2"}


def test_an_asker_outside_the_unit_gets_systemds_environment_and_keeps_the_live_run(
    cli: Cli, fake_systemd: FakeSystemd
) -> None:
    """An operator's reap: Environment= as systemd prints it; the running run is not ended."""
    unit = unit_name()
    fake_systemd(
        unit, state="active", sub_state="running", environment="CUDA_VISIBLE_DEVICES=0,1 'A=b c'"
    )

    facts = _gather(cli, unit, env={"CUDA_VISIBLE_DEVICES": "2"})

    assert facts["inside"] is False
    assert facts["environment"] == {"CUDA_VISIBLE_DEVICES": "0,1", "A": "b c"}
    assert facts["live"] == LAST
    assert facts["provenance"]["problem"] is None
    assert facts["provenance"]["invocations"] == [ENDED]  # the live run is no left-over
    assert facts["notices"] == []
    assert unitenv.recorded(cli.config.parent / "run", unit) is None  # nothing of its own


def test_without_systemd_only_roots_own_gate_in_the_cgroup_counts_as_inside(
    cli: Cli, fake_systemd: FakeSystemd, unit_cgroups: UnitCgroups
) -> None:
    """With systemctl failing, only root's in-process gate in the unit's cgroup is inside.

    Outside, the provenance is unknown; root's own gate in the cgroup is inside
    (``trust_unknown``); the same process served by the gate server is not.
    """
    unit = unit_name()
    fake_systemd(None)
    error = f"systemctl show {unit}: {_BUS}"

    outside = _gather(cli, unit)
    assert outside["error"] == error
    assert (outside["inside"], outside["environment"], outside["live"]) == (False, {}, None)
    assert outside["provenance"] == {
        "problem": error,  # nothing in the unit's cgroup is reaped
        "invocations": [],
        "uid": None,
        "ledger": [],
        "elsewhere": [],
    }

    trusted = _gather(
        cli, unit, cgroups=unit_cgroups, trust=True, env={"CUDA_VISIBLE_DEVICES": "3"}
    )
    assert trusted["inside"] is True
    assert trusted["environment"]["CUDA_VISIBLE_DEVICES"] == "3"
    # No problem, no runs, no user: its cgroup may be reaped, nothing outside it is
    # (commands/context.unit_plan stands the asker's uid for the unit's).
    assert trusted["provenance"]["problem"] is None
    assert (trusted["provenance"]["invocations"], trusted["provenance"]["uid"]) == ([], None)

    served = _gather(cli, unit, cgroups=unit_cgroups, env={"CUDA_VISIBLE_DEVICES": "3"})
    assert served["inside"] is False
    assert served["environment"]["CUDA_VISIBLE_DEVICES"] == "3"  # it runs in the unit still
    assert served["provenance"]["problem"] == error


def test_the_ledgers_evidence_joins_systemds_provenance(
    cli: Cli, fake_systemd: FakeSystemd
) -> None:
    """The unit's recorded worker is a claim of its ended run; another unit's is elsewhere."""
    unit = unit_name()
    fake_systemd(unit, state="active", sub_state="running")
    workers = [subprocess.Popen(["sleep", "600"]) for _ in range(2)]
    try:
        mine, theirs = (procfs.read_identity(worker.pid) for worker in workers)
        assert mine is not None
        assert theirs is not None
        ledger = Ledger().record(
            unit, ENDED, [SeenProcess(mine.pid, mine.start_time, (0,), "sleep", "/")], 1.0
        )
        ledger = ledger.record(
            "other.service",
            "a" * 32,
            [SeenProcess(theirs.pid, theirs.start_time, (0,), "sleep", "/")],
            1.0,
        )
        ledgerstore.save(cli.config.parent / "run", ledger)

        facts = _gather(cli, unit)
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()

    assert facts["provenance"] == {
        "problem": None,
        "invocations": [ENDED],
        "uid": 0,
        "ledger": [[mine.pid, mine.start_time, ENDED]],
        "elsewhere": [[theirs.pid, theirs.start_time]],
    }
    assert facts["notices"] == []
