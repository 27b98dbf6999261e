"""Which GPUs a unit owns (pure): its config entry, else CUDA_VISIBLE_DEVICES, else all.

Hosts often run two servers on disjoint GPUs; a unit's gate and recovery look only at its own
set, so one server's live use never blocks, and is never reaped by, the other's gate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gpuguard.core.mig import indices_text, mig_indices

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpuguard.core.values import GpuReading


@dataclass(frozen=True, slots=True)
class GpuSet:
    """A unit's GPUs as NVML indices (None: all GPUs), where that came from, and any caveat."""

    indices: frozenset[int] | None
    source: str
    note: str | None = None
    unjudged: frozenset[int] = frozenset()
    """GPUs of the set left out because MIG mode is on there (core/mig.py): ``indices`` lacks
    them, so the gate neither waits on nor reaps from them."""

    def describe(self) -> str:
        """For status lines: "GPUs 0,1,2,3 (from config)"."""
        if self.indices is None:
            text = f"all GPUs ({self.source})"
        else:
            listed = ",".join(str(i) for i in sorted(self.indices)) or "none"
            text = f"GPUs {listed} ({self.source})"
        if self.unjudged:
            text += (
                f"; MIG mode on GPU {indices_text(self.unjudged)}: not judged, whole-GPU "
                "figures cover other MIG instances"
            )
        return text


def resolve_gpu_set(
    configured: Sequence[int | str] | None,
    environment: dict[str, str] | None,
    gpus: Sequence[GpuReading],
) -> GpuSet:
    """The unit's GPU set from config, else from its CUDA_VISIBLE_DEVICES, else all GPUs.

    GPUs with MIG mode on are left out (and named in ``unjudged``): see core/mig.py.
    """
    return _without_mig(_resolve(configured, environment, gpus), gpus)


def _resolve(
    configured: Sequence[int | str] | None,
    environment: dict[str, str] | None,
    gpus: Sequence[GpuReading],
) -> GpuSet:
    if configured is not None:
        indices, unknown = _match(configured, list(gpus))
        note = f"configured GPUs not present: {', '.join(unknown)}" if unknown else None
        return GpuSet(frozenset(indices), "from config", note)
    visible = (environment or {}).get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return GpuSet(None, "no GPUs configured and no CUDA_VISIBLE_DEVICES")
    order = (environment or {}).get("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    return _from_cuda_visible(visible, order, gpus)


def _without_mig(gpu_set: GpuSet, gpus: Sequence[GpuReading]) -> GpuSet:
    """The set less its MIG-enabled GPUs; "all GPUs" becomes the GPUs without MIG."""
    mig = mig_indices(gpus)
    wanted = frozenset(g.index for g in gpus) if gpu_set.indices is None else gpu_set.indices
    unjudged = mig & wanted
    if not unjudged:
        return gpu_set
    return replace(gpu_set, indices=wanted - unjudged, unjudged=unjudged)


def _from_cuda_visible(visible: str, order: str, gpus: Sequence[GpuReading]) -> GpuSet:
    """Translate CUDA ordinals or UUIDs into NVML indices.

    CUDA numbers devices fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID; NVML enumerates in
    PCI order. With identical GPUs both orders agree; with mixed models an ordinal is ambiguous
    and we fall back to all GPUs rather than guess.
    """
    by_pci = sorted(gpus, key=lambda g: (g.pci_bus_id or "", g.index))
    entries = _entries(visible)
    source = f"CUDA_VISIBLE_DEVICES={visible}"
    ordinals = [e for e in entries if isinstance(e, int)]
    models = {g.name for g in gpus}
    if ordinals and order != "PCI_BUS_ID" and len(models) > 1:
        return GpuSet(
            None,
            source,
            "mixed GPU models and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA ordinals cannot be "
            "mapped; set the unit's gpus in the config",
        )
    ordered = [g.index for g in by_pci]
    indices: set[int] = set()
    unknown: list[str] = []
    for entry in entries:
        if isinstance(entry, int):
            if entry < len(ordered):
                indices.add(ordered[entry])
            else:
                unknown.append(str(entry))
        else:
            found, missing = _match([entry], list(gpus))
            indices.update(found)
            unknown.extend(missing)
    note = f"not present: {', '.join(unknown)}" if unknown else None
    return GpuSet(frozenset(indices), source, note)


@dataclass(frozen=True, slots=True)
class CudaView:
    """The GPUs a process sees as CUDA numbers them: device k is NVML's ``indices[k]``.

    ``indices`` is None when that cannot be told (mixed GPU models without
    CUDA_DEVICE_ORDER=PCI_BUS_ID), with the reason in ``note``.
    """

    indices: tuple[int, ...] | None
    note: str | None = None


def cuda_view(environment: dict[str, str] | None, gpus: Sequence[GpuReading]) -> CudaView:
    """How a process with ``environment`` numbers its CUDA devices, in NVML's indices.

    CUDA_VISIBLE_DEVICES picks and orders them (ordinals in CUDA's order, or UUIDs); CUDA
    stops at the first entry that names no device. Without it every GPU is visible.
    """
    env = environment or {}
    order = env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    if order != "PCI_BUS_ID" and len({g.name for g in gpus}) > 1:
        return CudaView(None, "mixed GPU models and CUDA_DEVICE_ORDER is not PCI_BUS_ID")
    ordered = [g.index for g in sorted(gpus, key=lambda g: (g.pci_bus_id or "", g.index))]
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return CudaView(tuple(ordered))
    indices: list[int] = []
    for entry in _entries(visible):
        if isinstance(entry, int):
            if entry >= len(ordered):
                break
            indices.append(ordered[entry])
            continue
        found, _ = _match([entry], list(gpus))
        if not found:
            break
        indices.extend(found)
    return CudaView(tuple(indices))


def _entries(visible: str) -> list[int | str]:
    """CUDA_VISIBLE_DEVICES as ordinals and UUIDs, up to its first invalid entry."""
    entries: list[int | str] = []
    for raw in visible.split(","):
        word = raw.strip()
        if not word:
            continue
        if word.isdecimal() and word.isascii() and len(word) <= 6:
            entries.append(int(word))
        elif word.startswith(("GPU-", "MIG-")):
            entries.append(word)
        else:
            break  # CUDA ignores everything from the first invalid entry on
    return entries


def _match(wanted: Sequence[int | str], gpus: list[GpuReading]) -> tuple[set[int], list[str]]:
    """NVML indices for config entries (indices, or UUIDs / unique UUID prefixes)."""
    found: set[int] = set()
    unknown: list[str] = []
    present = {g.index for g in gpus}
    for entry in wanted:
        if isinstance(entry, int):
            if entry in present or not gpus:
                found.add(entry)
            else:
                unknown.append(str(entry))
            continue
        hits = [g.index for g in gpus if g.uuid and g.uuid.startswith(entry)]
        if len(hits) == 1:
            found.add(hits[0])
        else:
            unknown.append(entry)
    return found, unknown
