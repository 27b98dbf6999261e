"""What an NVIDIA Xid code means for gpuguard: a faulty process, or a GPU no kill can free.

Data, pure. An application fault is cured by reaping the process; a reset-class fault needs a
GPU reset or a reboot, and every kill and restart before it is wasted. Taken from NVIDIA's Xid
catalog for Ampere and newer GPUs ("Resolution Bucket (Immediate Action)" column),
https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html; each entry keeps NVIDIA's
bucket next to gpuguard's class so a reader can check the mapping. The table with sources, and
the codes where gpuguard reads more than the bucket says, is docs/xid.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from gpuguard.core.values import StrEnum


class XidClass(StrEnum):
    """What an Xid asks of whoever runs the GPU."""

    APPLICATION = "application"
    """The process is at fault (or was killed for another fault): reap it; the GPU is usable."""
    RESET_GPU = "reset-gpu"
    """The GPU needs a reset (or a reboot) before it is usable; no kill frees it."""
    REBOOT = "reboot"
    """The host needs a reboot (NVIDIA's RESTART_BM); a GPU reset is not enough."""
    OPERATOR = "operator"
    """NVIDIA prescribes a workflow or support: a person must look; no kill helps."""
    INFORMATIONAL = "informational"
    """Nothing to do at once (NVIDIA's IGNORE): a note, or a pointer to another Xid."""
    UNKNOWN = "unknown"
    """Not in this catalogue (a newer driver, or unused): judged by NVML health alone."""


@dataclass(frozen=True, slots=True)
class XidInfo:
    """One catalogue entry: the code, NVIDIA's mnemonic and bucket, and gpuguard's class."""

    code: int
    mnemonic: str
    meaning: str
    nvidia_action: str
    xid_class: XidClass

    @property
    def kill_helps(self) -> bool:
        """Reaping the faulting process leaves a usable GPU."""
        return self.xid_class in (XidClass.APPLICATION, XidClass.INFORMATIONAL)


_A, _R, _B, _O, _I = (
    XidClass.APPLICATION,
    XidClass.RESET_GPU,
    XidClass.REBOOT,
    XidClass.OPERATOR,
    XidClass.INFORMATIONAL,
)

_ENTRIES: Final = (
    XidInfo(
        8, "ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT", "GPU stopped processing", "RESTART_APP", _A
    ),
    XidInfo(
        11,
        "ROBUST_CHANNEL_GR_ERROR_MISSING_HW",
        "invalid or corrupted push buffer stream",
        "RESTART_APP",
        _A,
    ),
    XidInfo(13, "ROBUST_CHANNEL_GR_EXCEPTION", "graphics engine exception", "RESTART_APP", _A),
    XidInfo(
        25,
        "ROBUST_CHANNEL_GR_ILLEGAL_NOTIFY",
        "invalid or illegal push buffer stream",
        "RESTART_APP",
        _A,
    ),
    XidInfo(
        31, "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "GPU memory page fault", "RESTART_APP", _A
    ),
    XidInfo(
        32,
        "ROBUST_CHANNEL_PBDMA_ERROR",
        "invalid or corrupted push buffer stream",
        "RESTART_APP",
        _A,
    ),
    XidInfo(43, "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "GPU stopped processing", "IGNORE", _A),
    XidInfo(
        44,
        "ROBUST_CHANNEL_GR_FAULT_DURING_CTXSW",
        "graphics engine fault during context switch",
        "IGNORE",
        _I,
    ),
    XidInfo(
        45,
        "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL",
        "preemptive cleanup, due to previous errors",
        "WORKFLOW_XID_45",
        _A,
    ),
    XidInfo(46, "ROBUST_CHANNEL_GPU_TIMEOUT_ERROR", "GPU stopped processing", "RESET_GPU", _R),
    XidInfo(48, "ROBUST_CHANNEL_GPU_ECC_DBE", "double bit ECC error", "WORKFLOW_XID_48", _R),
    XidInfo(
        61,
        "PMU_BREAKPOINT",
        "internal micro-controller breakpoint (unused on Ampere and newer)",
        "CONTACT_SUPPORT",
        _O,
    ),
    XidInfo(62, "PMU_HALT_ERROR", "internal micro-controller halt", "RESET_GPU", _R),
    XidInfo(63, "INFOROM_DRAM_RETIREMENT_EVENT", "GPU memory remapping event", "IGNORE", _I),
    XidInfo(64, "INFOROM_DRAM_RETIREMENT_FAILURE", "GPU memory remapping failure", "RESET_GPU", _R),
    XidInfo(68, "ROBUST_CHANNEL_NVDEC0_ERROR", "NVDEC0 exception", "RESTART_APP", _A),
    XidInfo(69, "ROBUST_CHANNEL_GR_CLASS_ERROR", "graphics engine class error", "RESTART_APP", _A),
    XidInfo(74, "NVLINK_ERROR", "NVLink error", "WORKFLOW_NVLINK_ERR", _O),
    XidInfo(
        79,
        "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS",
        "GPU has fallen off the bus",
        "RESTART_BM",
        _B,
    ),
    XidInfo(92, "EXCESSIVE_SBE_INTERRUPTS", "high single-bit ECC error rate", "IGNORE", _I),
    XidInfo(94, "ROBUST_CHANNEL_CONTAINED_ERROR", "contained memory error", "RESTART_APP", _A),
    XidInfo(95, "ROBUST_CHANNEL_UNCONTAINED_ERROR", "uncontained memory error", "RESET_GPU", _R),
    XidInfo(109, "ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", "context switch timeout", "RESET_GPU", _R),
    XidInfo(110, "SEC_FAULT_ERROR", "security fault", "RESET_GPU", _R),
    XidInfo(119, "GSP_RPC_TIMEOUT", "GSP RPC timeout", "RESET_GPU", _R),
    XidInfo(120, "GSP_ERROR", "GSP error", "RESET_GPU", _R),
    XidInfo(136, "ALI_TRAINING_FAIL", "link training failed", "RESET_GPU", _R),
    XidInfo(140, "UNRECOVERABLE_ECC_ERROR_ESCAPE", "ECC unrecovered error", "RESET_GPU", _R),
    XidInfo(143, "GPU_INIT_ERROR", "GPU initialization error", "RESET_GPU", _R),
    XidInfo(154, "GPU_RECOVERY_ACTION_CHANGED", "GPU recovery action changed", "XID_154", _I),
    XidInfo(155, "NVLINK_SW_DEFINED_ERROR", "NVLink software-defined error", "RESET_GPU", _R),
    XidInfo(156, "RESOURCE_RETIREMENT_EVENT", "resource retirement event", "RESET_GPU", _R),
    XidInfo(158, "GPU_FATAL_TIMEOUT", "GPU fatal timeout", "RESET_GPU", _R),
)

CATALOGUE: Final[dict[int, XidInfo]] = {entry.code: entry for entry in _ENTRIES}


def lookup(code: int) -> XidInfo:
    """The entry for ``code``; an unknown code is UNKNOWN, never assumed harmless."""
    known = CATALOGUE.get(code)
    if known is not None:
        return known
    return XidInfo(code, "", "not in gpuguard's catalogue", "", XidClass.UNKNOWN)
