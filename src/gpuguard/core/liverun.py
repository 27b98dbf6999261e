"""Which run of a unit a process belongs to, as evidence tied to what systemd runs now (pure).

The daemon may read the journal seconds or minutes after the fact: when it records a run it
believes live, systemd may already run the next one, whose server and workers are in the
unit's cgroup. Filing them under the run the daemon believed live would make the running run's
workers "left-overs of an ended run" the moment that run's end is read. So nothing here asks
what the daemon believed:

- the ledger's walk (:func:`file_walk`) files each process under the run its own evidence names
  at the moment of the walk: a process in the unit's cgroup under its own ``INVOCATION_ID``
  (systemd sets it for every process of a run, and the unit's cgroup holds only its runs'
  processes), a descendant under its parent's run, a process the ledger recorded before under
  that run; what cannot tell files nothing;
- a kill decision (:func:`live_reason`) keeps a process whose own ``INVOCATION_ID`` or
  recorded run is the invocation systemd runs now, whatever else says it is stale.

A process sets its own environment, so its ``INVOCATION_ID`` can lie; every lie this rule
believes makes a process look *live* or makes its own user's process look stale, and a kill
still needs all four uids to be the unit's user's (core.policy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from gpuguard.core.ledger import SeenProcess
    from gpuguard.core.values import ProcessIdentity


@dataclass(frozen=True, slots=True)
class Walked:
    """One process the ledger's walk read, with what ties it to a run (adapters.runtree)."""

    process: SeenProcess
    invocation_id: str | None
    """Its own ``INVOCATION_ID`` (None: none, ambiguous, malformed or unreadable)."""
    parent: ProcessIdentity | None = None
    """The walked process it was found as a child of; None for a root of the walk."""
    recorded_run: str | None = None
    """For a root the ledger recorded before: the run it was recorded in."""
    ppid: int | None = None
    """For a root read from the unit's cgroup: the parent PID its ``stat`` named (None: not
    read). A member whose ``INVOCATION_ID`` cannot be read is its parent member's run."""


class Walk(tuple[Walked, ...]):  # noqa: SLOT001 - carries ``cut``, so it has a dict
    """The processes one walk read, parents first, and what its budgets left unread.

    A tuple, so it is used as the processes it holds; ``cut`` (None: nothing) says what was
    not read (processes past the walk's cap, threads past its thread budget): a cut walk is
    never read as the unit's whole tree.
    """

    cut: str | None

    def __new__(  # noqa: PYI034 - typing.Self is 3.11's; gpuguard runs on 3.10
        cls, found: Iterable[Walked] = (), cut: str | None = None
    ) -> Walk:
        """The walk's processes, in the order found, and its cut."""
        walk = super().__new__(cls, found)
        walk.cut = cut
        return walk


def file_walk(
    walked: Iterable[Walked], *, members_run: str | None = None
) -> dict[str, list[SeenProcess]]:
    """The walk's processes by the run each belongs to; those that cannot tell are left out.

    ``walked`` lists parents before their children (the walk's order). A root that is neither
    recorded nor a child was read from the unit's cgroup: its own ``INVOCATION_ID`` names its
    run (a left-over of an ended run keeps its own, the running run's processes theirs);
    without one it is ``members_run``'s when the caller knows which run alone can be in the
    cgroup (the gate server serving a stop-reap: systemd starts nothing until it ends), else
    its parent's run when its parent is a member too (started no later than it: no reused PID),
    else nothing. vLLM's ``VLLM::EngineCore`` and ``VLLM::Worker`` are such members: the
    setproctitle that names them zeroes what ``/proc/PID/environ`` shows (facts.md).
    A child is its parent's run when the parent was found in the cgroup now; else
    its own ``INVOCATION_ID`` when that names a run found in the cgroup now (it is the present
    run's, however it came under a recorded process); else its parent's. A recorded root keeps
    the run it was recorded in (core.ledger's first-run rule).
    """
    entries = list(walked)
    runs: dict[ProcessIdentity, str | None] = {}
    in_cgroup: set[ProcessIdentity] = set()
    for entry in entries:
        identity = entry.process.identity
        if entry.parent is None and entry.recorded_run is None:
            in_cgroup.add(identity)
            runs[identity] = entry.invocation_id or members_run
        elif entry.parent is None:
            runs[identity] = entry.recorded_run
        elif entry.parent in in_cgroup:
            in_cgroup.add(identity)
            runs[identity] = runs.get(entry.parent)
    _members_by_parent(entries, runs)
    present = {runs[identity] for identity in in_cgroup} - {None}
    filed: dict[str, list[SeenProcess]] = {}
    for entry in entries:
        identity = entry.process.identity
        if identity not in runs:  # a child of a recorded (or unfiled) process
            parents = runs.get(entry.parent) if entry.parent is not None else None
            own = entry.invocation_id
            runs[identity] = own if own is not None and own in present else parents
        run = runs[identity]
        if run is not None:
            filed.setdefault(run, []).append(entry.process)
    return filed


def _members_by_parent(entries: list[Walked], runs: dict[ProcessIdentity, str | None]) -> None:
    """File each cgroup member that names no run under its nearest ancestor root's run.

    A member is a root read from the cgroup (no parent, no recorded run). Its parent is the
    root of its ``ppid`` (a member, or a process the ledger recorded before: the engine of a
    crashed vLLM, whose API server is gone) that started no later than it (a PID reused after
    the parent's exit belongs to a younger process). Linear: every root is on one followed
    chain at most, a chain that ends nowhere is remembered as such.
    """
    roots = {entry.process.pid: entry for entry in entries if entry.parent is None}
    members = [entry for entry in roots.values() if entry.recorded_run is None]
    nowhere: set[ProcessIdentity] = set()
    for entry in members:
        chain: list[ProcessIdentity] = []
        walking: Walked | None = entry
        run: str | None = None
        while walking is not None and len(chain) <= len(roots):
            identity = walking.process.identity
            run = runs.get(identity)
            if run is not None or identity in nowhere:
                break
            chain.append(identity)
            parent = roots.get(walking.ppid) if walking.ppid is not None else None
            if parent is None or parent.process.start_time > walking.process.start_time:
                walking = None
            else:
                walking = parent
        for link in chain:
            if run is None:
                nowhere.add(link)
            else:
                runs[link] = run


def live_reason(
    unit: str, invocation_id: str | None, recorded_run: str | None, live: str | None
) -> str | None:
    """Why a process belongs to the run of ``unit`` systemd runs now (``live``), or None.

    Its own ``INVOCATION_ID`` naming the live run, or the ledger having seen it descend from
    the live run, is enough: no other evidence makes such a process stale.
    """
    if live is None:
        return None
    if invocation_id == live:
        return f"live process of the running {unit}"
    if recorded_run == live:
        return f"live process of the running {unit} (ledger)"
    return None
