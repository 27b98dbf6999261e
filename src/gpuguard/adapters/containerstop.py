"""Judge and stop a unit's left-over server containers through their engine.

The process reaper never signals a holder in a container (policy: "belongs to docker:…"); this
is the one path by which such a holder goes away, and only for a container the engine confirms
is the unit's own (core/unitcontainers.judge). The gate, the daemon's recovery and its sweep of
an ended run's survivors, and ``reap`` stop through it; ``status`` asks it whose a container is.
The engine stops a container as ``docker stop`` would: the container's stop signal, the
reaper's grace, SIGKILL. One log line per container acted on, decision and outcome together;
with ``dry_run`` nothing is sent. Each container is judged once per stopper (one gate run, one
sweep, one reap): a kept one stays kept (the gate then refuses, naming it), a stopped one is
not stopped twice. Costs nothing on a host without containers: the unit's names and the engine
are asked only when a container holds one of the unit's GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpuguard.adapters import procfs, systemd
from gpuguard.adapters.engineapi import EngineClient, EngineError
from gpuguard.core.cgroup import attribute
from gpuguard.core.unitconfig import exec_argvs
from gpuguard.core.unitcontainers import (
    RUN_START,
    Claim,
    ContainerFacts,
    ContainerResult,
    ContainerVerdict,
    Engine,
    Evidence,
    claims,
    container_of,
    judge,
    parse_inspect,
    run_start_s,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from pathlib import Path

    from gpuguard.core.inventory import Inventory
    from gpuguard.core.logger import Logger
    from gpuguard.core.policy import PlanRequest


@dataclass(slots=True)
class ContainerJudge:
    """The verdict on each container holding the unit's GPUs: whose, and whether left over.

    ``claims`` gives the names the unit's configuration names (asked once, when first needed);
    ``live`` says the unit has, or may have, a live run; ``live_since_s`` gives that run's start
    in seconds since boot (asked only then), None when it cannot be read.
    """

    unit: str
    gpu_set: frozenset[int] | None
    claims: Callable[[], tuple[Claim, ...]]
    live: bool
    live_since_s: Callable[[], float | None]
    client: Callable[[Engine], EngineClient] = EngineClient
    proc_root: Path = procfs.PROC
    judged: dict[str, ContainerVerdict] = field(default_factory=dict)
    _names: tuple[Claim, ...] | None = None

    def plan(self, inventory: Inventory) -> tuple[ContainerVerdict, ...]:
        """A verdict for each container holding the unit's GPUs; each is judged once."""
        verdicts = []
        for engine, short_id in self._holding(inventory):
            key = f"{engine}:{short_id}"
            if key not in self.judged:
                self.judged[key] = self._judge(engine, short_id)
            verdicts.append(self.judged[key])
        return tuple(verdicts)

    def _holding(self, inventory: Inventory) -> list[tuple[Engine, str]]:
        """docker:/podman: containers whose processes hold a GPU of the set, in holder order."""
        found: dict[tuple[Engine, str], None] = {}
        for holder in inventory.holders:
            container = container_of(holder.attribution.container)
            uses = {use.gpu_index for use in holder.gpus}
            if container is not None and (
                self.gpu_set is None or not uses or bool(uses & self.gpu_set)
            ):
                found[container] = None
        return list(found)

    def _judge(self, engine: Engine, short_id: str) -> ContainerVerdict:
        if self._names is None:
            self._names = self.claims()
        names = [c for c in self._names if c.engine in {None, engine}]
        if not names:
            return judge(self.unit, Evidence(engine, short_id))
        try:
            claim, facts = self._find(engine, short_id, names)
        except EngineError as err:
            return judge(self.unit, Evidence(engine, short_id, problem=str(err)))
        init_container: str | None = None
        init_started: float | None = None
        if facts is not None and facts.pid is not None:
            cgroup = procfs.read_cgroup(facts.pid, proc_root=self.proc_root)
            init_container = attribute(cgroup).container
            stat = procfs.read_stat(facts.pid, proc_root=self.proc_root)
            if stat is not None:
                init_started = stat.start_time / procfs.clock_ticks_per_second()
        live_since = self.live_since_s() if self.live else None
        return judge(
            self.unit,
            Evidence(
                engine,
                short_id,
                claim=claim,
                facts=facts,
                init_container=init_container,
                init_started_s=init_started,
                live_since_s=live_since,
                run_problem=f"the start of {self.unit}'s running invocation cannot be read"
                if self.live and live_since is None
                else None,
            ),
        )

    def _find(
        self, engine: Engine, short_id: str, names: list[Claim]
    ) -> tuple[Claim | None, ContainerFacts | None]:
        """The claimed name the engine says is this container, else the first one it knows."""
        client = self.client(engine)
        first: tuple[Claim | None, ContainerFacts | None] = (None, None)
        for claim in names:
            facts = parse_inspect(client.inspect(claim.name))
            if facts is None or facts.name != claim.name:
                continue  # none, or another container whose id begins with the claimed name
            if facts.id[:12] == short_id:
                return claim, facts
            if first[1] is None:
                first = (claim, facts)
        return first


@dataclass(slots=True, kw_only=True)
class ContainerStopper(ContainerJudge):
    """The judge that also stops: the gate's ``containers`` step (see run_gate), and reap's."""

    grace_s: float
    dry_run: bool
    logger: Callable[[], Logger]
    _acted: set[str] = field(default_factory=set)

    def __call__(self, inventory: Inventory) -> bool:
        """Act on each container newly seen holding the unit's GPUs; True when one was stopped."""
        stopped = False
        for verdict in self.plan(inventory):
            if verdict.container not in self._acted:
                result = self.act(verdict)
                stopped = (result is not None and result.done) or stopped
        return stopped

    def act(self, verdict: ContainerVerdict) -> ContainerResult | None:
        """Log the verdict and, for one to stop, stop it (dry run: say so); its result, if any.

        One log line per container, decision and outcome together; each container is acted on
        once (a kept one stays kept, a stopped one is not stopped twice).
        """
        self._acted.add(verdict.container)
        log = self.logger()
        fields: Mapping[str, object] = {
            "unit": self.unit,
            "container": verdict.container,
            "reason": verdict.reason,
        }
        if not verdict.stop or verdict.full_id is None:
            log.info("container not stopped", **fields)
            return None
        if self.dry_run:
            log.info("would stop container", grace_s=self.grace_s, **fields)
            return ContainerResult(verdict, "would stop")
        try:
            outcome = self.client(verdict.engine).stop(verdict.full_id, self.grace_s)
        except EngineError as err:
            log.warning("container stop failed", error=str(err), **fields)
            return ContainerResult(verdict, "stop failed", str(err))
        log.info("container stopped", outcome=outcome, grace_s=self.grace_s, **fields)
        return ContainerResult(verdict, outcome)


def for_unit(
    request: PlanRequest,
    configured: str | None,
    *,
    grace_s: float,
    dry_run: bool,
    logger: Callable[[], Logger],
) -> ContainerStopper:
    """The stopper for the unit of a gate's ``request``, named by ``configured`` or ExecStart=.

    The unit's run may be live when the request keeps a live invocation, and also when
    systemd's view of the unit is unknown: then the run's start is asked, and unknown keeps.
    """
    names, live_since_s = _asking_systemd(request.unit, configured)
    return ContainerStopper(
        request.unit,
        request.gpu_set,
        names,
        live=request.live_invocation is not None or request.provenance.problem is not None,
        live_since_s=live_since_s,
        grace_s=grace_s,
        dry_run=dry_run,
        logger=logger,
    )


def owners(
    inventory: Inventory, configured: Mapping[str, str | None], live: Callable[[str], bool]
) -> dict[str, tuple[str, ContainerVerdict]]:
    """For ``status``: each GPU-holding container the engine confirms is a watched unit's.

    ``configured``: each watched unit's ``container`` key; ``live(unit)``: whether the unit has,
    or may have, a live run. Keyed by ``docker:<id12>``; the unit and its verdict (``stop``: left
    over). The first unit in configuration order that owns a container has it. Nothing is
    asked unless a container holds a GPU.
    """
    found: dict[str, tuple[str, ContainerVerdict]] = {}
    if not any(container_of(h.attribution.container) for h in inventory.holders):
        return found
    for unit, key in configured.items():
        names, live_since_s = _asking_systemd(unit, key)
        judge_ = ContainerJudge(unit, None, names, live=live(unit), live_since_s=live_since_s)
        for verdict in judge_.plan(inventory):
            if verdict.owned and verdict.container not in found:
                found[verdict.container] = (unit, verdict)
    return found


def _asking_systemd(
    unit: str, configured: str | None
) -> tuple[Callable[[], tuple[Claim, ...]], Callable[[], float | None]]:
    """The unit's container names and its running invocation's start, as systemd gives them."""

    def names() -> tuple[Claim, ...]:
        shown = systemd.show_properties(unit, ("ExecStart",))
        text = shown.get("ExecStart", "") if isinstance(shown, dict) else ""
        return claims(configured, exec_argvs(text))

    def live_since_s() -> float | None:
        shown = systemd.show_properties(unit, (RUN_START,))
        return run_start_s(shown.get(RUN_START, "") if isinstance(shown, dict) else "")

    return names, live_since_s
