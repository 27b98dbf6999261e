"""The /proc adapter against a fake /proc tree built in a temporary directory."""

from __future__ import annotations

import os
import string
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest
from builders import plan_request
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.adapters import runtree
from gpuguard.adapters.procdevices import ScanBudget
from gpuguard.adapters.procfs import (
    ENVIRON_LIMIT,
    ancestor_pids,
    read_identity,
    read_listed,
    read_wchan,
    scan_device_holders,
)
from gpuguard.adapters.procread import PF_KTHREAD, parse_fd_size, parse_stat
from gpuguard.adapters.runtree import DESCENDANTS_MAX, THREADS_MAX, descendants
from gpuguard.core.inventory import build_inventory
from gpuguard.core.policy import Verdict, plan
from gpuguard.core.redaction import REDACTED
from gpuguard.core.values import (
    NvmlHealth,
    NvmlReading,
    ProcessFacts,
    ProcessIdentity,
    ProcScan,
    UnitProvenance,
)

if TYPE_CHECKING:
    from pathlib import Path

GLOB = "/dev/nvidia*"
USER_FLAGS = 0x00400100  # PF_RANDOMIZE | PF_FORKNOEXEC, as an ordinary process shows
INVOCATION = "0123456789abcdef0123456789abcdef"


@dataclass(frozen=True)
class FakeProcess:
    """One process of the fake tree; every field is what its /proc files will say."""

    pid: int
    comm: str = "python3"
    state: str = "S"
    ppid: int = 1
    flags: int = USER_FLAGS
    start_time: int = 5000
    cmdline: tuple[str, ...] = ("python3", "-m", "sglang.launch_server")
    uid: int = 0
    cgroup: str = "0::/system.slice/sglang.service\n"
    environ: dict[str, str] = field(default_factory=lambda: {"INVOCATION_ID": INVOCATION})
    fds: dict[int, str] = field(default_factory=dict)
    maps: tuple[str, ...] = ()
    threads: dict[int, tuple[int, ...]] = field(default_factory=dict)
    children: tuple[int, ...] | None = ()
    unreadable: bool = False
    wchan: str = "0"
    fd_size: int = 64


def stat_line(proc: FakeProcess) -> str:
    """Return the /proc/PID/stat line of ``proc`` in the kernel's layout (fields 1 to 52)."""
    middle = [proc.state, proc.ppid, proc.pid, proc.pid, 0, -1, proc.flags, 10, 0, 0, 0, 5, 3]
    tail = [0, 0, 20, 0, 1, 0, proc.start_time, 1000, 100, *([0] * 30)]
    return f"{proc.pid} ({proc.comm}) " + " ".join(str(x) for x in [*middle, *tail]) + "\n"


class FakeProc:
    """Builds a /proc-shaped tree under a directory.

    Tests run as root here, so file modes cannot hide anything: an unreadable fd directory is
    a regular file where the directory should be (the adapter sees an error that is not
    "vanished"), and unreadable maps are a directory.
    """

    def __init__(self, root: Path) -> None:
        """Start an empty tree at ``root``."""
        self.root = root
        root.mkdir(exist_ok=True)

    def add(self, proc: FakeProcess) -> Path:
        """Write the files of ``proc`` and return its directory."""
        base = self.root / str(proc.pid)
        base.mkdir()
        (base / "stat").write_bytes(stat_line(proc).encode())
        (base / "cmdline").write_bytes(b"".join(arg.encode() + b"\0" for arg in proc.cmdline))
        (base / "status").write_text(
            f"Name:\t{proc.comm}\nState:\t{proc.state}\nPPid:\t{proc.ppid}\n"
            f"Uid:\t{proc.uid}\t{proc.uid}\t{proc.uid}\t{proc.uid}\nFDSize:\t{proc.fd_size}\n"
            f"Threads:\t{len({proc.pid, *proc.threads})}\n"
        )
        (base / "cgroup").write_text(proc.cgroup)
        (base / "environ").write_bytes(
            b"".join(f"{k}={v}".encode() + b"\0" for k, v in proc.environ.items())
        )
        (base / "wchan").write_text(proc.wchan)
        if proc.unreadable:
            (base / "fd").write_text("not a directory\n")
            (base / "maps").mkdir()
        else:
            (base / "fd").mkdir()
            for number, target in proc.fds.items():
                (base / "fd" / str(number)).symlink_to(target)
            (base / "maps").write_text("".join(line + "\n" for line in proc.maps))
        threads = {proc.pid: proc.children, **proc.threads}
        for tid, kids in threads.items():
            (base / "task" / str(tid)).mkdir(parents=True)
            if kids is not None:
                (base / "task" / str(tid) / "children").write_text(
                    "".join(f"{kid} " for kid in kids)
                )
        return base


def maps_line(path: str, inode: int = 42) -> str:
    """Return a /proc/PID/maps line mapping ``path``."""
    return f"7f1c2a000000-7f1c2a200000 rw-s 00000000 00:05 {inode}                      {path}"


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    """Provide an empty fake /proc."""
    return FakeProc(tmp_path / "proc")


def read_one(proc: FakeProc, pid: int) -> ProcessFacts | None:
    """The facts of ``pid`` as ``read_listed`` reads a PID NVML named; None when not there."""
    found = read_listed([pid], GLOB, proc_root=proc.root).processes
    return found[0] if found else None


def test_fd_holder_is_found_with_all_its_facts(proc: FakeProc) -> None:
    """A process with /dev/nvidia0 open is reported with identity, owner, cgroup and invocation."""
    proc.add(
        FakeProcess(
            pid=100,
            ppid=7,
            start_time=123456,
            cmdline=("python3", "-m", "sglang.launch_server", "--api-key", "sk-live"),
            fds={0: "/dev/null", 3: "/dev/nvidia0", 4: "/dev/nvidiactl", 5: "pipe:[123]"},
        )
    )
    scan = scan_device_holders(GLOB, proc_root=proc.root)
    assert scan.method == "full"
    assert scan.unreadable == 0
    [facts] = scan.processes
    assert facts.identity == ProcessIdentity(pid=100, start_time=123456)
    assert facts.ppid == 7
    assert facts.state == "S"
    assert facts.comm == "python3"
    assert facts.cmdline == ("python3", "-m", "sglang.launch_server", "--api-key", REDACTED)
    assert facts.uid == 0
    assert facts.user == "root"
    assert facts.cgroup == "/system.slice/sglang.service"
    assert facts.invocation_id == INVOCATION
    assert facts.device_files == frozenset({"/dev/nvidia0", "/dev/nvidiactl"})
    assert not facts.kernel_thread


def test_process_that_only_maps_the_device_is_found(proc: FakeProc) -> None:
    """A process with no device fd but a /dev/nvidia0 mapping still holds the GPU."""
    proc.add(
        FakeProcess(
            pid=200,
            maps=(maps_line("/usr/lib/libc.so.6"), maps_line("/dev/nvidia0"), "7f00-7f01 r-xp"),
        )
    )
    [facts] = scan_device_holders(GLOB, proc_root=proc.root).processes
    assert facts.device_files == frozenset({"/dev/nvidia0"})


def test_processes_without_device_files_are_not_reported(proc: FakeProc) -> None:
    """Only holders are returned by the full walk."""
    proc.add(FakeProcess(pid=10, fds={0: "/dev/null", 1: "/dev/nvidiax/other"}))
    proc.add(FakeProcess(pid=11, fds={3: "/dev/nvidia1"}))
    scan = scan_device_holders("/dev/nvidia[0-9]", proc_root=proc.root)
    assert [p.identity.pid for p in scan.processes] == [11]


def test_without_the_kernels_count_the_table_size_puts_a_flood_last(proc: FakeProc) -> None:
    """Where ``fd`` sizes are no count (Linux < 6.2, or this tree), ``FDSize:`` orders the walk.

    The flood has the lower PID and spends the scan's budget; read after it, the holder would be
    cut short and its device file unseen.
    """
    proc.add(FakeProcess(pid=100, fds=dict.fromkeys(range(150), "/dev/null"), fd_size=256, maps=()))
    proc.add(FakeProcess(pid=200, fds={3: "/dev/nvidia0"}, fd_size=64))
    budget = ScanBudget(fds_per_process=10_000, fds_per_scan=100)
    by_pid = {
        f.identity.pid: f
        for f in scan_device_holders(GLOB, proc_root=proc.root, budget=budget).processes
    }
    assert by_pid[200].partial is None
    assert by_pid[200].device_files == {"/dev/nvidia0"}
    assert by_pid[100].partial == "the scan's budget of 100 descriptors was spent"


def test_paths_with_spaces_and_deleted_marker_in_maps(proc: FakeProc) -> None:
    """A mapped path with spaces is read whole and a ' (deleted)' marker is dropped."""
    proc.add(FakeProcess(pid=12, maps=(maps_line("/dev/nvidia dir/x (deleted)"),)))
    [facts] = scan_device_holders(GLOB, proc_root=proc.root).processes
    assert facts.device_files == frozenset({"/dev/nvidia dir/x"})


def test_deleted_marker_on_fd_target_is_dropped(proc: FakeProc) -> None:
    """An fd to a removed device node reports the node's path."""
    proc.add(FakeProcess(pid=13, fds={3: "/dev/nvidia3 (deleted)"}))
    [facts] = scan_device_holders(GLOB, proc_root=proc.root).processes
    assert facts.device_files == frozenset({"/dev/nvidia3"})


def test_literal_glob_matches_only_that_file(proc: FakeProc) -> None:
    """A glob without wildcards matches exactly one path."""
    proc.add(FakeProcess(pid=14, fds={3: "/dev/nvidia0"}))
    proc.add(FakeProcess(pid=15, fds={3: "/dev/nvidia00"}))
    scan = scan_device_holders("/dev/nvidia0", proc_root=proc.root)
    assert [p.identity.pid for p in scan.processes] == [14]


@pytest.mark.parametrize(
    "comm", ["foo) Z 1 2 (", "a)b", "x\ny", "((", "))", "", " ", "sglang::sch ed"]
)
def test_hostile_process_names_do_not_shift_fields(proc: FakeProc, comm: str) -> None:
    """A name with ')' or a newline is kept whole and the fields after it are right."""
    proc.add(FakeProcess(pid=300, comm=comm, state="D", ppid=42, fds={3: "/dev/nvidia0"}))
    [facts] = scan_device_holders(GLOB, proc_root=proc.root).processes
    assert facts.comm == comm
    assert facts.state == "D"
    assert facts.ppid == 42


def test_unreadable_processes_are_counted_not_fatal(proc: FakeProc) -> None:
    """Processes whose fds and maps cannot be read are counted and the walk goes on."""
    proc.add(FakeProcess(pid=400, unreadable=True))
    proc.add(FakeProcess(pid=401, unreadable=True))
    proc.add(FakeProcess(pid=402, fds={3: "/dev/nvidia0"}))
    scan = scan_device_holders(GLOB, proc_root=proc.root)
    assert scan.unreadable == 2
    assert [p.identity.pid for p in scan.processes] == [402]


def test_unreadable_fds_still_report_mapped_device(proc: FakeProc) -> None:
    """When only the fd directory is unreadable, a mapping still reveals the holder."""
    base = proc.add(FakeProcess(pid=410, maps=(maps_line("/dev/nvidia1"),)))
    (base / "fd").rmdir()
    (base / "fd").write_text("")
    scan = scan_device_holders(GLOB, proc_root=proc.root)
    assert scan.unreadable == 1
    assert scan.processes[0].device_files == frozenset({"/dev/nvidia1"})


def test_kernel_threads_are_neither_holders_nor_unreadable(proc: FakeProc) -> None:
    """A kernel thread with an unreadable fd directory is not counted as unreadable."""
    proc.add(
        FakeProcess(
            pid=2, comm="kthreadd", ppid=0, flags=PF_KTHREAD | 0x40, cmdline=(), unreadable=True
        )
    )
    scan = scan_device_holders(GLOB, proc_root=proc.root)
    assert scan == scan_device_holders(GLOB, proc_root=proc.root)
    assert scan.unreadable == 0
    assert scan.processes == ()
    facts = read_one(proc, 2)
    assert facts is not None
    assert facts.kernel_thread
    assert facts.cmdline == ()


def test_vanished_processes_are_skipped(proc: FakeProc) -> None:
    """A PID directory whose files are gone (the process exited) is skipped silently."""
    (proc.root / "500").mkdir()
    base = proc.add(FakeProcess(pid=501, fds={3: "/dev/nvidia0"}))
    (base / "cmdline").unlink()  # exited between reading stat and cmdline
    proc.add(FakeProcess(pid=502, fds={3: "/dev/nvidia0"}))
    scan = scan_device_holders(GLOB, proc_root=proc.root)
    assert [p.identity.pid for p in scan.processes] == [502]
    assert scan.unreadable == 0
    assert read_one(proc, 500) is None
    assert read_one(proc, 501) is None
    assert read_one(proc, 999) is None


def test_non_numeric_entries_are_ignored(proc: FakeProc) -> None:
    """Entries like self, sys or 12abc are not processes."""
    for name in ("self", "sys", "12abc", "\u0663"):
        (proc.root / name).mkdir()
    proc.add(FakeProcess(pid=600, fds={3: "/dev/nvidia0"}))
    assert [p.identity.pid for p in scan_device_holders(GLOB, proc_root=proc.root).processes] == [
        600
    ]


def test_unknown_uid_falls_back_to_the_number(proc: FakeProc) -> None:
    """A uid without a passwd entry is shown as its number."""
    proc.add(FakeProcess(pid=700, uid=3999999, fds={3: "/dev/nvidia0"}))
    facts = read_one(proc, 700)
    assert facts is not None
    assert (facts.uid, facts.user) == (3999999, "3999999")


@pytest.mark.parametrize(
    ("status", "slots"),
    [
        (b"Name:\tx\nFDSize:\t1\nUid:\t0\t0\t0\t0\nFDSize:\t256\n", 256),
        (b"Name:\tx\nUid:\t0\t0\t0\t0\n", 0),
        (b"Name:\tx\nFDSize:\t-1\n", 0),
        (b"Name:\tx\nFDSize:\t" + b"9" * 40 + b"\n", 0),
        (b"", 0),
    ],
)
def test_the_table_size_is_the_kernels_last_fdsize_line(status: bytes, slots: int) -> None:
    """A name smuggling an FDSize: line, a missing line, or a malformed one never reads as more."""
    assert parse_fd_size(status) == slots


def test_forged_uid_in_the_name_line_is_ignored(proc: FakeProc) -> None:
    """A process name that smuggles a Uid: line does not change the uid read."""
    proc.add(FakeProcess(pid=701, comm="x\nUid:\t0\t0\t0\t0", uid=1234))
    facts = read_one(proc, 701)
    assert facts is not None
    assert facts.uid == 1234


@pytest.mark.parametrize(
    "environ",
    [{}, {"INVOCATION_ID": "not-hex"}, {"INVOCATION_ID": INVOCATION + "00"}, {"X": "1"}],
)
def test_missing_or_malformed_invocation_id_is_none(
    proc: FakeProc, environ: dict[str, str]
) -> None:
    """Only a 32-hex-digit INVOCATION_ID is taken from the environment."""
    proc.add(FakeProcess(pid=710, environ=environ))
    facts = read_one(proc, 710)
    assert facts is not None
    assert facts.invocation_id is None


def test_unreadable_environ_gives_no_invocation(proc: FakeProc) -> None:
    """An environment we may not read leaves invocation_id unknown, not an error."""
    base = proc.add(FakeProcess(pid=711))
    (base / "environ").unlink()
    (base / "environ").mkdir()
    facts = read_one(proc, 711)
    assert facts is not None
    assert facts.invocation_id is None


def test_hybrid_cgroup_text_is_reduced_to_the_systemd_path(proc: FakeProc) -> None:
    """The cgroup field holds the systemd path even on a hybrid v1/v2 host."""
    text = "4:memory:/x\n1:name=systemd:/user.slice/user-0.slice/session-1.scope\n0::/\n"
    proc.add(FakeProcess(pid=720, cgroup=text))
    facts = read_one(proc, 720)
    assert facts is not None
    assert facts.cgroup == "/user.slice/user-0.slice/session-1.scope"


def test_setproctitle_padding_is_dropped(proc: FakeProc) -> None:
    """Trailing NUL padding of a rewritten command line does not add empty arguments."""
    base = proc.add(FakeProcess(pid=730))
    (base / "cmdline").write_bytes(b"sglang::scheduler_TP0 --api-key=k" + b"\0" * 40)
    facts = read_one(proc, 730)
    assert facts is not None
    assert facts.cmdline == (f"sglang::scheduler_TP0 --api-key={REDACTED}",)


def test_a_listed_process_without_devices_is_read_with_an_empty_set(proc: FakeProc) -> None:
    """read_listed answers for any existing PID NVML named, holder or not."""
    proc.add(FakeProcess(pid=740, fds={0: "/dev/null"}))
    facts = read_one(proc, 740)
    assert facts is not None
    assert facts.device_files == frozenset()


def test_descendants_are_the_children_of_every_thread_and_theirs(proc: FakeProc) -> None:
    """The ledger's walk finds each thread's children and grandchildren, not other processes."""
    proc.add(FakeProcess(pid=800, children=(801, 802), threads={810: (803,)}))
    proc.add(FakeProcess(pid=801, ppid=800, fds={3: "/dev/nvidia0"}, children=(804,)))
    proc.add(FakeProcess(pid=802, ppid=800, fds={0: "/dev/null"}))
    proc.add(FakeProcess(pid=803, ppid=800, maps=(maps_line("/dev/nvidia1"),)))
    proc.add(FakeProcess(pid=804, ppid=801, fds={5: "/dev/nvidia0"}))
    proc.add(FakeProcess(pid=900, fds={3: "/dev/nvidia0"}))  # unrelated holder
    found = descendants([800, 424242], proc_root=proc.root)
    assert sorted(w.process.pid for w in found) == [800, 801, 802, 803, 804]


def test_the_walk_reads_each_processs_own_invocation_and_how_it_was_found(proc: FakeProc) -> None:
    """Own INVOCATION_ID (none past the read limit), the parent found under, a root's run."""
    late = {"PADDING": "x" * runtree.ENVIRON_LIMIT, "INVOCATION_ID": "c" * 32}
    proc.add(FakeProcess(pid=800, children=(801,)))
    proc.add(FakeProcess(pid=801, ppid=800, environ=late))
    proc.add(FakeProcess(pid=900, environ={"INVOCATION_ID": "e" * 32}))
    recorded = ProcessIdentity(900, 5000)
    found = descendants([800, recorded], runs={recorded: "f" * 32}, proc_root=proc.root)
    assert [(w.process.pid, w.invocation_id, w.recorded_run) for w in found] == [
        (800, INVOCATION, None),
        (900, "e" * 32, "f" * 32),
        (801, None, None),
    ]
    assert found[2].parent == ProcessIdentity(800, 5000)


def test_descendants_count_every_lead_read_against_the_bound(proc: FakeProc) -> None:
    """Listed children that fail their checks count too: the walk stops at DESCENDANTS_MAX.

    A parent that exits right after its children are listed leaves each of them failing its
    parent check; had only the found ones counted, a unit's process could make the root walk
    as long as it has children.
    """
    gone = tuple(range(100_000, 100_000 + DESCENDANTS_MAX))  # listed, then gone (no /proc entry)
    proc.add(FakeProcess(pid=800, children=(*gone, 801)))
    proc.add(FakeProcess(pid=801, ppid=800))
    found = descendants([800], proc_root=proc.root)
    assert [w.process.pid for w in found] == [800]
    assert found.cut is not None
    assert f"stopped at {DESCENDANTS_MAX} processes read" in found.cut


def test_descendants_read_at_most_threads_max_threads_and_say_what_was_cut(
    proc: FakeProc,
) -> None:
    """A process with more threads than the budget has its main thread read alone, said cut.

    A process's children are listed per thread, so the walk cost a read per thread: one
    process of 20,000 threads took 0.1-0.3 s under the process cap alone.
    """
    empty: tuple[int, ...] = ()
    many = dict.fromkeys(range(10_000, 10_000 + THREADS_MAX + 50), empty)
    many[10_000 + THREADS_MAX + 49] = (802,)  # a child of a thread past the budget
    proc.add(FakeProcess(pid=800, children=(801,), threads=many))
    proc.add(FakeProcess(pid=801, ppid=800, threads={900: (803,)}))
    proc.add(FakeProcess(pid=802, ppid=800))
    proc.add(FakeProcess(pid=803, ppid=801))
    found = descendants([800], proc_root=proc.root)
    # the main thread's child, then its own
    assert [w.process.pid for w in found] == [800, 801, 803]
    assert found.cut is not None
    assert f"the children of {THREADS_MAX + 50} threads of 1 process not read" in found.cut
    assert descendants([801], proc_root=proc.root).cut is None


def test_descendants_spend_the_thread_budget_across_processes(proc: FakeProc) -> None:
    """Processes that fit the budget together are read whole; the one past it is said cut."""
    half = THREADS_MAX // 2
    empty: tuple[int, ...] = ()

    def threads(first: int) -> dict[int, tuple[int, ...]]:
        return dict.fromkeys(range(first, first + half - 1), empty)

    proc.add(FakeProcess(pid=800, children=(801, 802), threads=threads(10_000)))
    proc.add(FakeProcess(pid=801, ppid=800, threads=threads(20_000)))
    proc.add(FakeProcess(pid=802, ppid=800, threads=threads(30_000)))
    found = descendants([800], proc_root=proc.root)
    assert sorted(w.process.pid for w in found) == [800, 801, 802]
    assert found.cut is not None
    assert f"the children of {half - 1} threads of 1 process not read" in found.cut


def test_descendants_fall_back_to_a_ppid_walk_without_children_files(proc: FakeProc) -> None:
    """Without task/*/children (CONFIG_PROC_CHILDREN off) descendants are found by ppid."""
    proc.add(FakeProcess(pid=1, comm="init", ppid=0, children=None))
    proc.add(FakeProcess(pid=800, children=None))
    proc.add(FakeProcess(pid=801, ppid=800, fds={3: "/dev/nvidia0"}, children=None))
    proc.add(FakeProcess(pid=802, ppid=801, fds={3: "/dev/nvidia0"}, children=None))
    proc.add(FakeProcess(pid=900, ppid=1, fds={3: "/dev/nvidia0"}, children=None))
    found = descendants([800], proc_root=proc.root)
    assert sorted(w.process.pid for w in found) == [800, 801, 802]


def test_descendants_survive_a_children_cycle_and_unreadable_fds(proc: FakeProc) -> None:
    """A children loop ends; a listed process whose fds are unreadable is said to be so."""
    proc.add(FakeProcess(pid=800, unreadable=True, children=(801,)))
    proc.add(FakeProcess(pid=801, ppid=800, fds={3: "/dev/nvidia0"}, children=(800,)))
    assert [w.process.pid for w in descendants([800, 800], proc_root=proc.root)] == [800, 801]
    listed = read_listed([800, 800], GLOB, proc_root=proc.root)
    assert [(p.identity.pid, p.files_readable) for p in listed.processes] == [(800, False)]


def test_read_identity_and_wchan(proc: FakeProc) -> None:
    """Identity comes from stat; wchan gives the sleeping function or None for '0'."""
    proc.add(FakeProcess(pid=1000, start_time=77, wchan="uvm_va_space_destroy"))
    proc.add(FakeProcess(pid=1001, wchan="0"))
    assert read_identity(1000, proc_root=proc.root) == ProcessIdentity(1000, 77)
    assert read_identity(1234, proc_root=proc.root) is None
    assert read_wchan(1000, proc_root=proc.root) == "uvm_va_space_destroy"
    assert read_wchan(1001, proc_root=proc.root) is None
    assert read_wchan(1234, proc_root=proc.root) is None


def test_ancestor_pids_walks_to_init(proc: FakeProc) -> None:
    """The ancestors of a process are listed parent first, up to PID 1."""
    proc.add(FakeProcess(pid=1, ppid=0))
    proc.add(FakeProcess(pid=50, ppid=1))
    proc.add(FakeProcess(pid=60, ppid=50))
    assert ancestor_pids(60, proc_root=proc.root) == (50, 1)
    assert ancestor_pids(1, proc_root=proc.root) == ()
    assert ancestor_pids(12345, proc_root=proc.root) == ()


@pytest.mark.parametrize(
    "data",
    [b"", b"123", b"123 (x", b"123 x) S 1", b"abc (x) S 1 " + b"0 " * 30, b"1 (x) S a b c d e"],
)
def test_malformed_stat_is_none(data: bytes) -> None:
    """Truncated or garbled stat content parses to None."""
    assert parse_stat(data) is None


@given(
    comm=st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=40),
    state=st.sampled_from("RSDZTtXIP"),
    ppid=st.integers(0, 2**22),
    flags=st.integers(0, 2**32 - 1),
    start_time=st.integers(0, 2**63),
)
def test_stat_parser_recovers_fields_after_any_name(
    comm: str, state: str, ppid: int, flags: int, start_time: int
) -> None:
    """Whatever the process name, the fields after it are parsed exactly."""
    fake = FakeProcess(
        pid=4242, comm=comm, state=state, ppid=ppid, flags=flags, start_time=start_time
    )
    parsed = parse_stat(stat_line(fake).encode())
    assert parsed is not None
    assert (parsed.pid, parsed.comm, parsed.state) == (4242, comm, state)
    assert (parsed.ppid, parsed.flags, parsed.start_time) == (ppid, flags, start_time)
    assert parsed.kernel_thread == bool(flags & PF_KTHREAD)


@given(st.binary(max_size=300) | st.text(alphabet=string.printable).map(str.encode))
def test_stat_parser_never_raises(data: bytes) -> None:
    """Arbitrary bytes never make the stat parser raise."""
    parse_stat(data)


def test_fake_tree_is_not_confused_with_real_proc(proc: FakeProc) -> None:
    """The proc_root parameter keeps the walk inside the fake tree."""
    assert scan_device_holders(GLOB, proc_root=proc.root).processes == ()
    assert read_listed([os.getpid()], GLOB, proc_root=proc.root) == ProcScan((), method="listed")
    assert descendants([os.getpid()], proc_root=proc.root) == ()


def test_unparseable_cgroup_text_makes_an_unknown_owner_that_is_spared(proc: FakeProc) -> None:
    """Forged cgroup text (a hierarchy named twice) gives no cgroup, and the holder is spared.

    The whole path: procfs reads it, holders attributes it, the policy keeps it in unit scope.
    """
    forged = "0::/user.slice/user-1000.slice/session-3.scope/x\n0::/system.slice/sglang.service\n"
    proc.add(FakeProcess(pid=300, ppid=1, cgroup=forged, fds={3: "/dev/nvidia0"}, uid=0))
    [facts] = scan_device_holders(GLOB, proc_root=proc.root).processes
    assert facts.cgroup is None
    assert facts.uids == (0, 0, 0, 0)
    inventory = build_inventory(NvmlReading(NvmlHealth.OK), ProcScan((facts,)), 0)
    [holder] = inventory.holders
    assert holder.owner == "unknown cgroup"
    request = plan_request(
        gpu_set=None, provenance=UnitProvenance(None, frozenset({INVOCATION}), uid=0)
    )
    [decision] = plan([holder], request).decisions
    assert decision.verdict is Verdict.KEEP
    assert "owner unknown" in decision.reason


def test_environ_is_read_only_up_to_its_limit(proc: FakeProc) -> None:
    """A huge environment is read boundedly; an INVOCATION_ID past the limit is not seen."""
    padding = "x" * (ENVIRON_LIMIT + 10)
    proc.add(
        FakeProcess(
            pid=301, environ={"PAD": padding, "INVOCATION_ID": INVOCATION}, fds={3: "/dev/nvidia0"}
        )
    )
    [facts] = scan_device_holders(GLOB, proc_root=proc.root).processes
    assert facts.invocation_id is None


def test_a_listed_child_whose_pid_was_reused_is_not_recorded_as_a_descendant(
    tmp_path: Path,
) -> None:
    """The ledger's walk: a child listed under 10 whose stat names another parent is skipped."""
    tree = FakeProc(tmp_path / "proc")
    tree.add(FakeProcess(10, children=(11, 12)))
    tree.add(FakeProcess(11, ppid=10, start_time=6000))
    tree.add(FakeProcess(12, ppid=99, start_time=7000))  # 12 died, its PID now another's
    found = descendants([10], proc_root=tree.root)
    assert [(w.process.pid, w.process.start_time) for w in found] == [(10, 5000), (11, 6000)]
