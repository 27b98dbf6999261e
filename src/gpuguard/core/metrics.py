"""Prometheus metrics from what gpuguard already knows (pure: no I/O, time passed in).

One function, ``families``, turns an inventory, the daemon's snapshot and a ``Tally`` of
counters (``core.tally``) into metric families of the official ``prometheus_client``;
``exposition`` renders them through a registry of our own (never the library's global one,
which would add process metrics of whichever command imports it). The daemon writes the result
to node_exporter's textfile directory and may serve it over HTTP; ``gpuguard status
--prometheus`` prints the same.

Labels are bounded by configuration or by enums: a GPU index, a watched unit, a result. Never a
PID, a command line or any other foreign text: a tenant must not be able to mint series.
Counters live in the daemon's memory and start at 0 with each daemon process (Prometheus'
``rate``/``increase`` read that as a counter reset); history found at start is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuguard.core.breaker import BreakerLimits, BreakerState, in_window
from gpuguard.core.enginelines import Phase
from gpuguard.core.health import health_warnings, needs_reboot, reset_reasons
from gpuguard.core.idle import is_idle_seen
from gpuguard.core.leftovers import Kind, LeftOver, WatchedUnit, left_overs
from gpuguard.core.prevented import PREVENTERS
from gpuguard.core.releaselog import Logged, summarize
from gpuguard.core.releasetimes import release_family
from gpuguard.core.tally import GATE_RESULTS, REAP_OUTCOMES, REAPERS, RECOVERY_RESULTS, Tally
from gpuguard.core.values import NvmlHealth, UnitProvenance

if TYPE_CHECKING:
    from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence

    from gpuguard.core.inventory import Inventory
    from gpuguard.core.snapshot import Snapshot
    from gpuguard.core.values import GpuReading

HEALTH_STATES = ("ok", "warning", "needs-reset", "needs-reboot")
"""A GPU's health, worst first from the right: what an operator must do about it."""
PHASE_LABELS = frozenset(phase.value for phase in Phase)
"""The ``phase`` label's values: a bounded enum, never text from the journal."""
_NVML_ERRORS = tuple(h.value for h in NvmlHealth if h is not NvmlHealth.OK)
_GPU_CAUSES = frozenset({"stale-gpu-holders", "gpu-needs-reset"})
"""Loop causes that are the unit's GPUs (core.detector's Cause values)."""


@dataclass(frozen=True, slots=True)
class Observed:
    """Everything one set of metrics is drawn from.

    ``live_invocations``: each watched unit systemd could be asked about, with the invocation
    that runs now (None: not running). A unit missing there has no stale holders (no evidence).
    ``snapshot``: the daemon's snapshot (core.snapshot), None when there is none to read.
    ``gate_refused``: per unit, whether the last recorded gate decision refused the start.
    ``watched``: each unit as status judges it (GPU set, live run, provenance: leftovers.py),
    so the metrics count left-overs exactly as status names them; None: built from
    ``live_invocations`` (all GPUs, no ended run known beyond the cgroup).
    """

    inventory: Inventory | None
    inventory_age_s: float | None
    watched_units: Sequence[str]
    live_invocations: Mapping[str, str | None]
    protected_names: Collection[str]
    idle_threshold_bytes: int
    snapshot: Snapshot | None
    daemon_running: bool
    gate_refused: Mapping[str, bool]
    tally: Tally
    now_wall: float
    watched: Sequence[WatchedUnit] | None = None
    releases: Sequence[Logged] = ()
    """The release log (core.releaselog): the last and typical release per GPU."""
    breaker: BreakerState | None = None
    """The host-wide breaker as its file holds it (core.breaker); None: closed, none counted."""
    breaker_limits: BreakerLimits | None = None
    now_monotonic: float | None = None
    """For the breaker's window (its times are this boot's monotonic ones)."""

    def units(self) -> tuple[WatchedUnit, ...]:
        """The watched units the left-overs are judged against."""
        if self.watched is not None:
            return tuple(self.watched)
        return tuple(
            WatchedUnit(
                name,
                (),
                live_invocation=self.live_invocations.get(name),
                provenance=UnitProvenance(None)
                if name in self.live_invocations
                else UnitProvenance("systemd did not answer"),
            )
            for name in self.watched_units
        )


def _gauge(name: str, doc: str, labels: Sequence[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def families(observed: Observed) -> list[Metric]:
    """Every metric gpuguard exports (docs/metrics.md lists them with their meaning)."""
    return [
        *_gpu_families(observed),
        *_unit_families(observed),
        *_liveness_families(observed),
        *_counter_families(observed.tally, observed.watched_units),
        *_release_families(observed.releases),
        *_daemon_families(observed),
        *_breaker_families(observed),
    ]


def _breaker_families(observed: Observed) -> list[Metric]:
    """The host-wide breaker: open or not, and the recoveries its window counts now."""
    breaker = observed.breaker
    opened = _gauge(
        "gpuguard_breaker_open",
        "1 while the host-wide breaker is open: the daemon only reports until "
        "`gpuguard breaker --close`.",
    )
    opened.add_metric([], int(breaker is not None and breaker.is_open))
    counted = _gauge(
        "gpuguard_breaker_recoveries",
        "Recoveries (and sweeps that reaped) the breaker counts in its window now.",
    )
    limits, now = observed.breaker_limits, observed.now_monotonic
    recent = in_window(breaker, limits, now) if breaker and limits and now is not None else ()
    counted.add_metric([], len(recent))
    result: list[Metric] = [opened, counted]
    if limits is not None:
        limit = _gauge(
            "gpuguard_breaker_max_recoveries",
            "The most recoveries the breaker lets through in its window (breaker_max_recoveries).",
        )
        limit.add_metric([], limits.max_recoveries)
        result.append(limit)
    return result


def _release_families(records: Sequence[Logged]) -> list[Metric]:
    """The release log's last and typical time per GPU: the numbers status and explain show."""
    labels = ["gpu", "UUID", "modelName", "driver"]
    last = _gauge(
        "gpuguard_holder_release_last_seconds",
        "The newest logged kill-to-release time of the GPU (as status shows it).",
        labels,
    )
    typical = _gauge(
        "gpuguard_holder_release_typical_seconds",
        "The median of the GPU's logged kill-to-release times (as status shows it).",
        labels,
    )
    for gpu in summarize(records):
        last.add_metric(list(gpu.labels), round(gpu.last.release.seconds, 3))
        typical.add_metric(list(gpu.labels), round(gpu.typical_s, 3))
    return [last, typical]


def _gpu_families(observed: Observed) -> list[Metric]:
    used = _gauge("gpuguard_gpu_memory_used_bytes", "GPU memory in use (NVML).", ["gpu"])
    total = _gauge("gpuguard_gpu_memory_total_bytes", "GPU memory in all (NVML).", ["gpu"])
    idle = _gauge(
        "gpuguard_gpu_idle",
        "1 when no process has memory on the GPU, its use is within idle_threshold_mib and no "
        "process the /proc walk could not read in full may hold it (as status judges it).",
        ["gpu"],
    )
    stale = _gauge(
        "gpuguard_gpu_stale_holders",
        "Left-overs of a watched unit holding the GPU, as status names them.",
        ["gpu"],
    )
    suspected = _gauge(
        "gpuguard_gpu_suspected_stale_holders",
        "Of those, the ones only their command line ties to the unit: kept, for an operator.",
        ["gpu"],
    )
    stale_bytes = _gauge(
        "gpuguard_gpu_stale_holder_memory_bytes",
        "GPU memory NVML attributes to those stale holders.",
        ["gpu"],
    )
    unattributed = _gauge(
        "gpuguard_gpu_unattributed_memory_bytes",
        "Used GPU memory no listed process explains, beyond the idle allowance.",
        ["gpu"],
    )
    health = _gauge(
        "gpuguard_gpu_health",
        "1 for the GPU's health state: ok, warning, needs-reset or needs-reboot.",
        ["gpu", "state"],
    )
    inventory = observed.inventory
    stale_holders = _stale(observed)
    for gpu in inventory.gpus if inventory else ():
        reading = gpu.reading
        label = [str(reading.index)]
        if reading.memory is not None:
            used.add_metric(label, reading.memory.used_bytes)
            total.add_metric(label, reading.memory.total_bytes)
        # As status judges it: a process the /proc walk could not read in full keeps it busy.
        seen = inventory is not None and is_idle_seen(inventory, gpu, observed.idle_threshold_bytes)
        idle.add_metric(label, int(seen))
        lefts = [
            x for x in stale_holders if any(u.gpu_index == reading.index for u in x.holder.gpus)
        ]
        holders = [x.holder for x in lefts]
        stale.add_metric(label, len(holders))
        suspected.add_metric(label, sum(x.kind is Kind.SUSPECTED for x in lefts))
        stale_bytes.add_metric(
            label,
            sum(u.used_bytes or 0 for h in holders for u in h.gpus if u.gpu_index == reading.index),
        )
        if gpu.unattributed_bytes is not None:
            unattributed.add_metric(label, gpu.unattributed_bytes)
        state = _health_state(reading)
        for name in HEALTH_STATES:
            health.add_metric([*label, name], int(name == state))
    return [used, total, idle, stale, suspected, stale_bytes, unattributed, health]


def _stale(observed: Observed) -> tuple[LeftOver, ...]:
    """The left-overs status names (leftovers.py): proven by the policy, or suspected by pattern.

    Positive evidence for the proven ones, as the gate reaps; protected processes never count,
    nor does a process of any unit's running invocation.
    """
    inventory = observed.inventory
    if inventory is None:
        return ()
    return left_overs(inventory, observed.units(), observed.protected_names)


def _health_state(reading: GpuReading) -> str:
    if reset_reasons(reading):
        return "needs-reboot" if needs_reboot(reading) else "needs-reset"
    return "warning" if health_warnings(reading) else "ok"


def _unit_families(observed: Observed) -> list[Metric]:
    labels = ["unit"]
    looping = _gauge("gpuguard_unit_restart_loop", "1 while the unit is in a restart loop.", labels)
    gpu_cause = _gauge(
        "gpuguard_unit_restart_loop_gpu_cause",
        "1 while the unit loops and the cause is its GPUs (stale holders, a GPU needing reset).",
        labels,
    )
    failed = _gauge(
        "gpuguard_unit_failed_runs_in_window",
        "Failed runs inside the daemon's loop_window_s.",
        labels,
    )
    operator = _gauge(
        "gpuguard_unit_needs_operator",
        "1 when recoveries gave up or only an operator can help (a GPU reset).",
        labels,
    )
    recovering = _gauge(
        "gpuguard_unit_recovery_in_progress", "1 while the daemon recovers the unit.", labels
    )
    refused = _gauge(
        "gpuguard_gate_last_decision_refused",
        "1 when the gate refused the unit's last start (recorded in /run/gpuguard/gate).",
        labels,
    )
    units = observed.snapshot.units if observed.snapshot else {}
    for name in observed.watched_units:
        unit = units.get(name)
        loops = unit is not None and unit.looping
        looping.add_metric([name], int(loops))
        gpu_cause.add_metric([name], int(loops and unit is not None and unit.cause in _GPU_CAUSES))
        failed.add_metric([name], unit.failures_in_window if unit else 0)
        operator.add_metric([name], int(unit is not None and unit.needs_operator))
        recovering.add_metric([name], int(unit is not None and unit.recovery_in_progress))
        refused.add_metric([name], int(observed.gate_refused.get(name, False)))
    return [looping, gpu_cause, failed, operator, recovering, refused]


def _liveness_families(observed: Observed) -> list[Metric]:
    """The engine behind each unit (core.liveness): dead, stuck, and how long starts take."""
    labels = ["unit"]
    dead = _gauge("gpuguard_unit_engine_dead", "1 while the unit's engine is dead.", labels)
    stuck = _gauge(
        "gpuguard_unit_start_stuck",
        "1 while the unit's start is past its learned budget in one phase.",
        labels,
    )
    deaths = CounterMetricFamily(
        "gpuguard_unit_engine_deaths",
        "Dead engines the daemon saw happen (a fatal line, or an exit 0 nobody asked for).",
        labels=labels,
    )
    stuck_starts = CounterMetricFamily(
        "gpuguard_unit_stuck_starts", "Starts the daemon saw stuck in a phase.", labels=labels
    )
    ready = _gauge(
        "gpuguard_unit_start_ready_seconds",
        "Seconds from systemd's start to the server's ready line, of the last start that came up.",
        labels,
    )
    phase = _gauge(
        "gpuguard_unit_start_phase_seconds",
        "Seconds the last start that came up spent in each phase.",
        ["unit", "phase"],
    )
    units = observed.snapshot.units if observed.snapshot else {}
    for name in observed.watched_units:
        unit = units.get(name)
        liveness = (unit.liveness if unit else None) or {}
        dead.add_metric([name], int(liveness.get("state") == "engine-dead"))
        stuck.add_metric([name], int(liveness.get("state") == "stuck"))
        for family, key in ((deaths, "engine_deaths"), (stuck_starts, "stuck_starts")):
            count = liveness.get(key)
            family.add_metric([name], count if type(count) is int else 0)
        last = liveness.get("last_start")
        start = last if isinstance(last, dict) else {}
        if _is_number(start.get("ready_s")):
            ready.add_metric([name], start["ready_s"])
        phases = start.get("phases")
        for label, seconds in phases.items() if isinstance(phases, dict) else ():
            if label in PHASE_LABELS and _is_number(seconds):
                phase.add_metric([name, label], seconds)
    return [dead, stuck, deaths, stuck_starts, ready, phase]


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _counter_families(tally: Tally, units: Sequence[str]) -> list[Metric]:
    """Every label combination is present from the start, at 0: ``increase()`` needs a base."""
    recoveries = CounterMetricFamily(
        "gpuguard_recoveries",
        "Recoveries of a restart loop the daemon finished, by result.",
        labels=["unit", "result"],
    )
    gate = CounterMetricFamily(
        "gpuguard_gate_decisions",
        "Start decisions of the gate, by result (learned from its records).",
        labels=["unit", "result"],
    )
    reaped = CounterMetricFamily(
        "gpuguard_reaped_processes",
        "Processes reaped by the daemon or the gate, by how they ended.",
        labels=["reaper", "outcome"],
    )
    nvml = CounterMetricFamily(
        "gpuguard_nvml_errors",
        "NVML readings of the daemon that failed, by kind.",
        labels=["error"],
    )
    for unit in units:
        for result in RECOVERY_RESULTS:
            recoveries.add_metric([unit, result], tally.recoveries[unit, result])
        for result in GATE_RESULTS:
            gate.add_metric([unit, result], tally.gate_decisions[unit, result])
    for reaper in REAPERS:
        for outcome in REAP_OUTCOMES:
            reaped.add_metric([reaper, outcome], tally.reaped[reaper, outcome])
    for error in _NVML_ERRORS:
        nvml.add_metric([error], tally.nvml_errors[error])
    return [recoveries, gate, reaped, nvml, *_prevented_families(tally, units)]


def _prevented_families(tally: Tally, units: Sequence[str]) -> list[Metric]:
    """What gpuguard saved, by core.prevented's conservative rule, and the release histogram."""
    starts = CounterMetricFamily(
        "gpuguard_prevented_failed_starts",
        "Failed starts gpuguard prevented: 1 per start the gate let through after its signal "
        "ended a holder, 1 per recovery that restarted the unit (never more).",
        labels=["unit", "reaper"],
    )
    loading = CounterMetricFamily(
        "gpuguard_prevented_load_seconds",
        "The loading those starts would have cost, each at the unit's shortest learned start "
        "(none learned: not counted).",
        labels=["unit", "reaper"],
    )
    for unit in units:
        for by in PREVENTERS:
            starts.add_metric([unit, by], tally.prevented[unit, by])
            loading.add_metric([unit, by], round(tally.prevented_load_s.get((unit, by), 0.0), 3))
    return [starts, loading, release_family(tally.releases)]


def _daemon_families(observed: Observed) -> list[Metric]:
    snapshot = observed.snapshot
    up = _gauge("gpuguard_daemon_up", "1 while the watchdog daemon (gpuguard run) runs.")
    up.add_metric([], int(observed.daemon_running))
    attached = _gauge("gpuguard_journal_attached", "1 while the daemon follows the journal live.")
    state = snapshot.journal_state if snapshot else None
    attached.add_metric([], int(observed.daemon_running and state == "attached"))
    dry_run = _gauge("gpuguard_daemon_dry_run", "1 when the daemon only says what it would do.")
    dry_run.add_metric([], int(snapshot is not None and snapshot.dry_run))
    nvml = _gauge("gpuguard_nvml_up", "1 when the last inventory could read NVML.")
    inventory = observed.inventory
    healthy = (NvmlHealth.OK, NvmlHealth.DRIVER_TOO_OLD)
    nvml.add_metric([], int(inventory is not None and inventory.nvml.health in healthy))
    result: list[Metric] = [up, attached, dry_run, nvml]
    if observed.inventory_age_s is not None:
        age = _gauge("gpuguard_inventory_age_seconds", "Seconds since the GPU inventory was taken.")
        age.add_metric([], round(observed.inventory_age_s, 3))
        result.append(age)
    updated = _gauge(
        "gpuguard_metrics_updated_timestamp_seconds",
        "When these metrics were drawn (Unix time): stale metrics mean a stuck daemon.",
    )
    updated.add_metric([], round(observed.now_wall, 3))
    result.append(updated)
    return result


class _Fixed(Collector):
    """A collector that yields given families (one registry of our own, no global state)."""

    def __init__(self, metrics: Iterable[Metric]) -> None:
        self.metrics = list(metrics)

    def collect(self) -> Iterator[Metric]:
        yield from self.metrics


class Latest(Collector):
    """The newest families, for an HTTP listener's thread: replaced whole, never mutated."""

    def __init__(self) -> None:
        """Nothing to serve until the first ``publish``."""
        self._metrics: tuple[Metric, ...] = ()

    def publish(self, metrics: Iterable[Metric]) -> None:
        """Serve these from now on."""
        self._metrics = tuple(metrics)

    def collect(self) -> Iterator[Metric]:
        """What a scrape gets."""
        yield from self._metrics


def registry_of(collector: Collector) -> CollectorRegistry:
    """A registry of our own holding only ``collector`` (no process or platform metrics)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def exposition(metrics: Iterable[Metric]) -> bytes:
    """The Prometheus text format of ``metrics``, as node_exporter's textfile collector reads."""
    return bytes(generate_latest(registry_of(_Fixed(metrics))))


class Rendered:
    """``exposition`` for a writer that draws the same metrics again and again (the daemon's).

    The text format is each family's lines in turn, so a family equal to the one drawn last
    time (name, help, type and every sample: labels, value) has the same text, kept from then;
    only the families that changed are rendered. An idle daemon's are its timestamps and ages.
    """

    def __init__(self) -> None:
        """Nothing rendered yet."""
        self._last: dict[str, tuple[Metric, bytes]] = {}
        self.rendered = 0
        """How many families the last ``exposition`` rendered anew."""

    def exposition(self, metrics: Iterable[Metric]) -> bytes:
        """The text ``exposition(metrics)`` returns, rendering only what changed."""
        drawn: dict[str, tuple[Metric, bytes]] = {}
        parts: list[bytes] = []
        self.rendered = 0
        for metric in metrics:
            last = self._last.get(metric.name)
            if last is None or last[0] != metric:
                last = (metric, exposition([metric]))
                self.rendered += 1
            drawn[metric.name] = last
            parts.append(last[1])
        self._last = drawn
        return b"".join(parts)
