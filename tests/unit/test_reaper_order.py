"""The reaper's signal order, without processes: parents first, every target exactly once."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpuguard.adapters.reaper import signal_order
from gpuguard.core.values import ProcessIdentity, ReapTarget


def _target(pid: int, ppid: int) -> ReapTarget:
    return ReapTarget(
        identity=ProcessIdentity(pid=pid, start_time=1000 + pid),
        ppid=ppid,
        command=f"python3 worker {pid}",
        unit="sglang.service",
        reason="stale holder",
    )


@st.composite
def forests(draw: st.DrawFn) -> list[ReapTarget]:
    """Targets whose parent links form a forest, listed in a random order."""
    pids = draw(st.lists(st.integers(3, 10_000), unique=True, max_size=30))
    targets: list[ReapTarget] = []
    for index, pid in enumerate(pids):
        # A parent among the targets created earlier (so links never cycle), or an outsider.
        outsider = st.integers(1, 20_000).filter(lambda ppid: ppid not in pids)
        choices = st.sampled_from(pids[:index]) | outsider if index else outsider
        targets.append(_target(pid, draw(choices)))
    return draw(st.permutations(targets))


def _ancestors(
    target: ReapTarget, by_pid: dict[int, ReapTarget], limit: int = 10_000
) -> list[ReapTarget]:
    chain: list[ReapTarget] = []
    current = by_pid.get(target.ppid)
    while current is not None and len(chain) < limit:
        chain.append(current)
        current = by_pid.get(current.ppid)
    return chain


@given(forests())
def test_ancestors_come_before_descendants(targets: list[ReapTarget]) -> None:
    """Every target's ancestors among the targets are signalled before it."""
    order = signal_order(targets)
    position = {target: index for index, target in enumerate(order)}
    by_pid = {target.identity.pid: target for target in targets}
    for target in targets:
        for ancestor in _ancestors(target, by_pid):
            assert position[ancestor] < position[target]


@given(forests())
def test_every_target_appears_once(targets: list[ReapTarget]) -> None:
    """The order is a permutation of the targets: none lost, none repeated."""
    order = signal_order(targets)
    assert sorted(order, key=lambda target: target.identity.pid) == sorted(
        targets, key=lambda target: target.identity.pid
    )


@given(st.lists(st.tuples(st.integers(3, 40), st.integers(1, 40)), max_size=30))
def test_arbitrary_links_including_cycles_still_give_a_permutation(
    links: list[tuple[int, int]],
) -> None:
    """Stale ppids that form cycles (or point at the target itself) still give every target once."""
    targets = [_target(pid, ppid) for pid, ppid in dict(links).items()]
    order = signal_order(targets)
    assert len(order) == len(targets)
    assert set(order) == set(targets)
    position = {target: index for index, target in enumerate(order)}
    by_pid = {target.identity.pid: target for target in targets}
    for target in targets:
        chain = _ancestors(target, by_pid, limit=len(targets) + 1)
        if len(chain) <= len(targets):  # not on or below a cycle: the order still holds
            assert all(position[ancestor] < position[target] for ancestor in chain)


def test_unrelated_targets_keep_the_given_order() -> None:
    """Targets with no parent among the targets are signalled in the order given."""
    targets = [_target(30, 1), _target(10, 1), _target(20, 7)]
    assert signal_order(targets) == tuple(targets)


def test_a_supervisor_listed_after_its_workers_is_signalled_first() -> None:
    """A launcher listed after its TP workers and their helper is moved in front, level by level."""
    helper = _target(40, 30)
    workers = [_target(30, 10), _target(31, 10)]
    launcher = _target(10, 1)
    order = signal_order([helper, *workers, launcher])
    assert order == (launcher, *workers, helper)


def test_a_two_process_cycle_is_broken_where_the_walk_from_the_first_target_closes_it() -> None:
    """Two targets naming each other as parent: the one listed first is signalled last.

    The walk starts at the earliest target and follows ppid links until it comes back to it; the
    last target reached is ranked first and the earliest last, so listing them the other way round
    swaps them. Each comes out exactly once.
    """
    first, second = _target(5, 6), _target(6, 5)
    assert signal_order([first, second]) == (second, first)
    assert signal_order([second, first]) == (first, second)


def test_a_three_process_cycle_is_cut_before_the_earliest_target() -> None:
    """A three-process ppid cycle is cut before the earliest target: walk order reversed.

    The walk from ``a`` reaches its parent ``c``, then ``b`` (whose parent is ``a``): ``b`` is
    ranked level with an unrelated root (input order between them), then ``c``, then ``a``.
    """
    root = _target(1000, 1)
    a, b, c = _target(5, 7), _target(6, 5), _target(7, 6)
    assert signal_order([a, b, c, root]) == (b, root, c, a)
