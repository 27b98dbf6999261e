"""A unit's GPU set: config first, then CUDA_VISIBLE_DEVICES (ordinals or UUIDs), else all."""

from __future__ import annotations

import shlex
from dataclasses import replace
from typing import TYPE_CHECKING

from builders import gpu
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.core.gpuset import cuda_view, resolve_gpu_set
from gpuguard.core.unitconfig import parse_environment, shell_words
from gpuguard.core.unitstate import parse_show
from gpuguard.core.values import MigMode

if TYPE_CHECKING:
    from gpuguard.core.values import GpuReading


def gpus(*names: str) -> list[GpuReading]:
    """GPUs of these models in NVML (PCI) order."""
    return [gpu(index, name=name) for index, name in enumerate(names)]


EIGHT = gpus(*["NVIDIA H200"] * 8)


def test_config_wins() -> None:
    """A configured set is used even when the unit sets CUDA_VISIBLE_DEVICES."""
    result = resolve_gpu_set((4, 5), {"CUDA_VISIBLE_DEVICES": "0"}, EIGHT)
    assert result.indices == frozenset({4, 5})
    assert result.source == "from config"


def test_config_by_uuid_prefix() -> None:
    """Config may name GPUs by UUID or a unique UUID prefix."""
    result = resolve_gpu_set(("GPU-00000003",), None, EIGHT)
    assert result.indices == frozenset({3})


def test_cuda_visible_ordinals() -> None:
    """CUDA ordinals map to NVML indices when the GPUs are identical."""
    result = resolve_gpu_set(None, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, EIGHT)
    assert result.indices == frozenset({4, 5, 6, 7})
    assert "CUDA_VISIBLE_DEVICES=4,5,6,7" in result.describe()


def test_cuda_visible_uuids() -> None:
    """CUDA_VISIBLE_DEVICES may list UUIDs."""
    env = {"CUDA_VISIBLE_DEVICES": "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd"}
    assert resolve_gpu_set(None, env, EIGHT).indices == frozenset({1})


def test_cuda_stops_at_the_first_invalid_entry() -> None:
    """Like CUDA, entries after an invalid one are ignored."""
    assert resolve_gpu_set(None, {"CUDA_VISIBLE_DEVICES": "2,x,3"}, EIGHT).indices == frozenset({2})


def test_empty_cuda_visible_means_no_gpus() -> None:
    """CUDA_VISIBLE_DEVICES="" hides every GPU: the set is empty."""
    assert resolve_gpu_set(None, {"CUDA_VISIBLE_DEVICES": ""}, EIGHT).indices == frozenset()


def test_mixed_models_without_pci_order_fall_back_to_all() -> None:
    """Ordinals on mixed GPUs under FASTEST_FIRST cannot be mapped: all GPUs, with a note."""
    mixed = gpus("NVIDIA H200", "NVIDIA A10")
    result = resolve_gpu_set(None, {"CUDA_VISIBLE_DEVICES": "1"}, mixed)
    assert result.indices is None
    assert result.note is not None
    pci = resolve_gpu_set(
        None, {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, mixed
    )
    assert pci.indices == frozenset({1})


def test_nothing_known_means_all() -> None:
    """No config and no CUDA_VISIBLE_DEVICES: the unit owns all GPUs."""
    assert resolve_gpu_set(None, {}, EIGHT).indices is None


def test_systemctl_show_is_parsed() -> None:
    """The output of systemctl show becomes a unit state with its environment."""
    state = parse_show(
        "sglang.service",
        "ActiveState=active\nSubState=running\nMainPID=4242\n"
        "InvocationID=0123456789abcdef0123456789abcdef\n"
        'Environment=CUDA_VISIBLE_DEVICES=0,1 "NAME=a b"\nNRestarts=3\n',
    )
    assert state.running
    assert state.main_pid == 4242
    assert state.environment == {"CUDA_VISIBLE_DEVICES": "0,1", "NAME": "a b"}
    assert state.n_restarts == 3
    assert parse_environment('broken "quote') == {}


@given(st.text(alphabet=list("ab =\"'\\\n\t$x"), max_size=40))
def test_shell_words_split_as_shlex_does(text: str) -> None:
    """The one-pass splitter gives shlex's words (shlex itself is quadratic in a long word)."""
    try:
        expected: list[str] | None = shlex.split(text)
    except ValueError:
        expected = None
    assert shell_words(text) == expected


def test_only_the_units_control_process_speaks_for_its_run() -> None:
    """In start-pre/stop-post only systemd's ControlPID counts; a worker of a running unit never."""
    show = (
        "ActiveState={active}\nSubState={sub}\nMainPID=4242\nControlPID={control}\n"
        "InvocationID=0123456789abcdef0123456789abcdef\n"
    )
    starting = parse_show(
        "s.service", show.format(active="activating", sub="start-pre", control=77)
    )
    assert starting.is_control_process(77, trust_unknown=False)
    assert not starting.is_control_process(4242, trust_unknown=True)
    running = parse_show("s.service", show.format(active="active", sub="running", control=0))
    assert running.control_pid is None
    assert not running.is_control_process(4242, trust_unknown=True)
    stopping = parse_show(
        "s.service", show.format(active="deactivating", sub="stop-post", control=9)
    )
    assert stopping.is_control_process(9, trust_unknown=False)
    unknown = parse_show("s.service", "")
    assert unknown.is_control_process(9, trust_unknown=True)
    assert not unknown.is_control_process(9, trust_unknown=False)


def test_cuda_view_numbers_the_visible_gpus_in_the_order_given() -> None:
    """CUDA_VISIBLE_DEVICES=6,2: cuda:0 is GPU 6, cuda:1 GPU 2; a UUID names its GPU."""
    assert cuda_view({"CUDA_VISIBLE_DEVICES": "6,2"}, EIGHT).indices == (6, 2)
    uuid = EIGHT[5].uuid or ""
    assert cuda_view({"CUDA_VISIBLE_DEVICES": f"3,{uuid}"}, EIGHT).indices == (3, 5)
    assert cuda_view({}, EIGHT).indices == tuple(range(8))
    assert cuda_view(None, EIGHT).indices == tuple(range(8))


def test_cuda_view_stops_where_cuda_stops() -> None:
    """CUDA hides everything from the first entry that names no device; garbage too."""
    assert cuda_view({"CUDA_VISIBLE_DEVICES": "1,9,2"}, EIGHT).indices == (1,)
    assert cuda_view({"CUDA_VISIBLE_DEVICES": "1,GPU-nope,2"}, EIGHT).indices == (1,)
    assert cuda_view({"CUDA_VISIBLE_DEVICES": "1,x,2"}, EIGHT).indices == (1,)
    assert cuda_view({"CUDA_VISIBLE_DEVICES": "\u0661,2"}, EIGHT).indices == ()
    assert cuda_view({"CUDA_VISIBLE_DEVICES": "9" * 5000}, EIGHT).indices == ()
    assert cuda_view({"CUDA_VISIBLE_DEVICES": ""}, EIGHT).indices == ()


def test_cuda_view_of_mixed_models_needs_pci_order() -> None:
    """FASTEST_FIRST over mixed models cannot be told; PCI_BUS_ID can."""
    mixed = gpus("NVIDIA H200", "NVIDIA A100")
    unknown = cuda_view({"CUDA_VISIBLE_DEVICES": "1"}, mixed)
    assert unknown.indices is None
    assert unknown.note is not None
    assert "CUDA_DEVICE_ORDER" in unknown.note
    ordered = {"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert cuda_view(ordered, mixed).indices == (1, 0)


def test_a_huge_ordinal_is_no_crash_for_the_gpu_set_either() -> None:
    """5000 digits used to reach int() (ValueError past 4300 digits): now an invalid entry."""
    result = resolve_gpu_set(None, {"CUDA_VISIBLE_DEVICES": "1," + "9" * 5000}, EIGHT)
    assert result.indices == frozenset({1})


def _with_mig(readings: list[GpuReading], *indices: int) -> list[GpuReading]:
    return [
        replace(r, mig=MigMode(current=True, pending=True)) if r.index in indices else r
        for r in readings
    ]


def test_mig_gpus_leave_every_set_and_are_named() -> None:
    """A MIG-enabled GPU is never judged: "all GPUs" and a configured set both lose it, visibly."""
    readings = _with_mig(gpus(*["NVIDIA H200"] * 4), 1)
    everything = resolve_gpu_set(None, None, readings)
    assert everything.indices == frozenset({0, 2, 3})
    assert everything.unjudged == frozenset({1})
    assert "MIG mode on GPU 1: not judged" in everything.describe()
    configured = resolve_gpu_set((1,), None, readings)
    assert configured.indices == frozenset()
    assert configured.describe().startswith("GPUs none (from config); MIG mode on GPU 1")
    visible = resolve_gpu_set(None, {"CUDA_VISIBLE_DEVICES": "2,3"}, readings)
    assert visible.indices == frozenset({2, 3})
    assert visible.unjudged == frozenset()


def test_mig_pending_or_unknown_is_still_judged() -> None:
    """Only MIG mode in effect now exempts a GPU; a pending change or an unknown mode does not."""
    readings = gpus("NVIDIA H200", "NVIDIA H200")
    readings[0] = replace(readings[0], mig=MigMode(current=False, pending=True))
    result = resolve_gpu_set(None, None, readings)
    assert result.indices is None
    assert result.unjudged == frozenset()
