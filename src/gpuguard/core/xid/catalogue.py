"""What an NVIDIA Xid code means for gpuguard: a faulty process, or a GPU no kill can free.

Data, pure. An application fault is cured by reaping the process; a reset-class fault needs a
GPU reset or a reboot, and every kill and restart before it is wasted. The whole of NVIDIA's Xid
catalog for Ampere and newer GPUs (codes 1-172, "Resolution Bucket (Immediate Action)" column),
https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, as ``CATALOGUE_SOURCE``
says; each entry keeps NVIDIA's bucket, and gpuguard's class follows from it (``BUCKET_CLASS``)
except where ``DEVIATIONS`` says otherwise. docs/xid.md is the table, with the reasons.
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


_A, _R, _B, _O, _I, _U = (
    XidClass.APPLICATION,
    XidClass.RESET_GPU,
    XidClass.REBOOT,
    XidClass.OPERATOR,
    XidClass.INFORMATIONAL,
    XidClass.UNKNOWN,
)

CATALOGUE_SOURCE: Final = (
    "NVIDIA Xid Catalog for Ampere and newer GPUs "
    "(docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html), sheet 'Catalog', as "
    "leptonai/gpud's gen-catalog mirrored it on 2025-10-29T00:35:32Z "
    "(components/accelerator/nvidia/xid/catalog_generated.go, commit b9842de2b111); "
    "read for gpuguard on 2026-12-01"
)
"""Which catalogue this is: NVIDIA publishes it as a web page and a spreadsheet, unversioned."""

BUCKET_CLASS: Final[dict[str, XidClass]] = {
    "RESTART_APP": _A,
    "RESET_GPU": _R,
    "RESTART_BM": _B,
    "RESTART_VM": _B,
    "IGNORE": _I,
    "XID_154": _I,
    "CONTACT_SUPPORT": _O,
    "CHECK_MECHANICALS": _O,
    "UPDATE_SWFW": _O,
    "CHECK_UVM": _O,
}
"""NVIDIA's immediate-action bucket → gpuguard's class; ``WORKFLOW_*`` is operator, no bucket
(codes the catalogue lists without one) unknown."""

DEVIATIONS: Final[dict[int, XidClass]] = {43: _A, 45: _A, 48: _R}
"""Where gpuguard reads more than the bucket (docs/xid.md, "Where gpuguard reads more")."""

# (code, NVIDIA's mnemonic, meaning, NVIDIA's immediate action): every row of the catalogue.
_ROWS: Final[tuple[tuple[int, str, str, str], ...]] = (
    (1, "ROBUST_CHANNEL_FIFO_ERROR_FIFO_METHOD", "Unused", "CONTACT_SUPPORT"),
    (2, "ROBUST_CHANNEL_FIFO_ERROR_SW_METHOD", "Unused", "CONTACT_SUPPORT"),
    (3, "ROBUST_CHANNEL_FIFO_ERROR_UNK_METHOD", "Unused", "CONTACT_SUPPORT"),
    (4, "ROBUST_CHANNEL_FIFO_ERROR_CHANNEL_BUSY", "Unused", "CONTACT_SUPPORT"),
    (5, "ROBUST_CHANNEL_FIFO_ERROR_RUNOUT_OVERFLOW", "Unused", "CONTACT_SUPPORT"),
    (6, "ROBUST_CHANNEL_FIFO_ERROR_PARSE_ERR", "Unused", "CONTACT_SUPPORT"),
    (7, "ROBUST_CHANNEL_FIFO_ERROR_PTE_ERR", "Unused", "CONTACT_SUPPORT"),
    (8, "ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT", "GPU stopped processing", "RESTART_APP"),
    (9, "ROBUST_CHANNEL_GR_ERROR_INSTANCE", "Unused", "CONTACT_SUPPORT"),
    (10, "ROBUST_CHANNEL_GR_ERROR_SINGLE_STEP", "Unused", "CONTACT_SUPPORT"),
    (
        11,
        "ROBUST_CHANNEL_GR_ERROR_MISSING_HW",
        "invalid or corrupted push buffer stream",
        "RESTART_APP",
    ),
    (12, "ROBUST_CHANNEL_GR_ERROR_SW_METHOD", "Unused", "CONTACT_SUPPORT"),
    (
        13,
        "ROBUST_CHANNEL_GR_EXCEPTION / ROBUST_CHANNEL_GR_ERROR_SW_NOTIFY",
        "graphics engine exception",
        "RESTART_APP",
    ),
    (14, "ROBUST_CHANNEL_FAKE_ERROR", "Unused", "IGNORE"),
    (15, "ROBUST_CHANNEL_SCANLINE_TIMEOUT", "Unused", "CONTACT_SUPPORT"),
    (16, "ROBUST_CHANNEL_VBLANK_CALLBACK_TIMEOUT", "Unused", "CONTACT_SUPPORT"),
    (17, "ROBUST_CHANNEL_PARAMETER_ERROR", "Unused", "CONTACT_SUPPORT"),
    (18, "ROBUST_CHANNEL_BUS_MASTER_TIMEOUT_ERROR", "Unused", "CONTACT_SUPPORT"),
    (19, "ROBUST_CHANNEL_DISP_MISSED_NOTIFIER", "Unused", "CONTACT_SUPPORT"),
    (20, "ROBUST_CHANNEL_MPEG_ERROR_SW_METHOD", "Unused", "CONTACT_SUPPORT"),
    (21, "ROBUST_CHANNEL_ME_ERROR_SW_METHOD", "Unused", "CONTACT_SUPPORT"),
    (22, "ROBUST_CHANNEL_VP_ERROR_SW_METHOD", "Unused", "CONTACT_SUPPORT"),
    (23, "ROBUST_CHANNEL_RC_LOGGING_ENABLED", "Unused", "CONTACT_SUPPORT"),
    (24, "ROBUST_CHANNEL_GR_SEMAPHORE_TIMEOUT", "Unused", "CONTACT_SUPPORT"),
    (
        25,
        "ROBUST_CHANNEL_GR_ILLEGAL_NOTIFY",
        "invalid or illegal push buffer stream",
        "RESTART_APP",
    ),
    (26, "ROBUST_CHANNEL_FIFO_ERROR_FBISTATE_TIMEOUT", "Unused", "CONTACT_SUPPORT"),
    (27, "ROBUST_CHANNEL_VP_ERROR", "Unused", "CONTACT_SUPPORT"),
    (28, "ROBUST_CHANNEL_VP2_ERROR", "Unused", "CONTACT_SUPPORT"),
    (29, "ROBUST_CHANNEL_BSP_ERROR", "Unused", "CONTACT_SUPPORT"),
    (30, "ROBUST_CHANNEL_BAD_ADDR_ACCESS", "Unused", "CONTACT_SUPPORT"),
    (31, "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "GPU memory page fault", "RESTART_APP"),
    (32, "ROBUST_CHANNEL_PBDMA_ERROR", "invalid or corrupted push buffer stream", "RESTART_APP"),
    (33, "ROBUST_CHANNEL_SEC_ERROR", "Unused", "CONTACT_SUPPORT"),
    (34, "ROBUST_CHANNEL_MSVLD_ERROR", "Unused", "CONTACT_SUPPORT"),
    (35, "ROBUST_CHANNEL_MSPDEC_ERROR", "Unused", "CONTACT_SUPPORT"),
    (36, "ROBUST_CHANNEL_MSPPP_ERROR", "Unused", "CONTACT_SUPPORT"),
    (37, "ROBUST_CHANNEL_FECS_ERR_UNIMP_FIRMWARE_METHOD", "Driver firmware error", "IGNORE"),
    (38, "ROBUST_CHANNEL_FECS_ERR_WATCHDOG_TIMEOUT", "Driver firmware error", "IGNORE"),
    (39, "ROBUST_CHANNEL_CE0_ERROR", "Copy Engine Exception", "RESTART_APP"),
    (40, "ROBUST_CHANNEL_CE1_ERROR", "Copy Engine Exception", "RESTART_APP"),
    (41, "ROBUST_CHANNEL_CE2_ERROR", "Copy Engine Exception", "RESTART_APP"),
    (42, "ROBUST_CHANNEL_VIC_ERROR", "Unused", "CONTACT_SUPPORT"),
    (43, "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "GPU stopped processing", "IGNORE"),
    (
        44,
        "ROBUST_CHANNEL_GR_FAULT_DURING_CTXSW",
        "graphics engine fault during context switch",
        "IGNORE",
    ),
    (
        45,
        "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL",
        "preemptive cleanup, due to previous errors",
        "WORKFLOW_XID_45",
    ),
    (46, "ROBUST_CHANNEL_GPU_TIMEOUT_ERROR", "GPU stopped processing", "RESET_GPU"),
    (47, "ROBUST_CHANNEL_NVENC0_ERROR", "Unused", "CONTACT_SUPPORT"),
    (48, "ROBUST_CHANNEL_GPU_ECC_DBE", "double bit ECC error", "WORKFLOW_XID_48"),
    (49, "SILENT_RUNNING_CONSTANT_LEVEL_SET_BY_REGISTRY", "Unused", "CONTACT_SUPPORT"),
    (50, "SILENT_RUNNING_LEVEL_TRANSITION_DUE_TO_RC_ERROR", "Unused", "CONTACT_SUPPORT"),
    (51, "SILENT_RUNNING_STRESS_TEST_FAILURE", "Unused", "CONTACT_SUPPORT"),
    (52, "SILENT_RUNNING_LEVEL_TRANS_DUE_TO_TEMP_RISE", "Unused", "CONTACT_SUPPORT"),
    (53, "SILENT_RUNNING_TEMP_REDUCED_CLOCKING", "Unused", "CONTACT_SUPPORT"),
    (
        54,
        "SILENT_RUNNING_PWR_REDUCED_CLOCKING",
        "Auxiliary power is not connected to the GPU board",
        "CHECK_MECHANICALS",
    ),
    (55, "SILENT_RUNNING_TEMPERATURE_READ_ERROR", "Unused", "CONTACT_SUPPORT"),
    (56, "DISPLAY_CHANNEL_EXCEPTION", "Unused", "CONTACT_SUPPORT"),
    (57, "FB_LINK_TRAINING_FAILURE_ERROR", "Unused", "CONTACT_SUPPORT"),
    (58, "FB_MEMORY_ERROR", "Unused", "CONTACT_SUPPORT"),
    (59, "PMU_ERROR", "Unused", "CONTACT_SUPPORT"),
    (60, "ROBUST_CHANNEL_SEC2_ERROR", "Video processor exception", "RESTART_APP"),
    (
        61,
        "PMU_BREAKPOINT",
        "internal micro-controller breakpoint (unused on Ampere and newer)",
        "CONTACT_SUPPORT",
    ),
    (62, "PMU_HALT_ERROR", "internal micro-controller halt", "RESET_GPU"),
    (63, "INFOROM_DRAM_RETIREMENT_EVENT", "GPU memory remapping event", "IGNORE"),
    (64, "INFOROM_DRAM_RETIREMENT_FAILURE", "GPU memory remapping failure", "RESET_GPU"),
    (65, "ROBUST_CHANNEL_NVENC1_ERROR", "Unused", "CONTACT_SUPPORT"),
    (66, "ROBUST_CHANNEL_FECS_ERR_REG_ACCESS_VIOLATION", "Illegal access by driver", "IGNORE"),
    (67, "ROBUST_CHANNEL_FECS_ERR_VERIF_VIOLATION", "Illegal access by driver", "IGNORE"),
    (68, "ROBUST_CHANNEL_NVDEC0_ERROR", "NVDEC0 exception", "RESTART_APP"),
    (69, "ROBUST_CHANNEL_GR_CLASS_ERROR", "graphics engine class error", "RESTART_APP"),
    (70, "ROBUST_CHANNEL_CE3_ERROR", "CE3: Unknown Error", "RESTART_APP"),
    (71, "ROBUST_CHANNEL_CE4_ERROR", "CE4: Unknown Error", "RESTART_APP"),
    (72, "ROBUST_CHANNEL_CE5_ERROR", "CE5: Unknown Error", "RESTART_APP"),
    (73, "ROBUST_CHANNEL_NVENC2_ERROR", "Unused", "CONTACT_SUPPORT"),
    (74, "NVLINK_ERROR", "NVLink error", "WORKFLOW_NVLINK_ERR"),
    (75, "ROBUST_CHANNEL_CE6_ERROR", "CE6: Unknown Error", "RESTART_APP"),
    (76, "ROBUST_CHANNEL_CE7_ERROR", "CE7: Unknown Error", "RESTART_APP"),
    (77, "ROBUST_CHANNEL_CE8_ERROR", "CE8: Unknown Error", "RESTART_APP"),
    (78, "VGPU_START_ERROR", "vGPU Start Error", "UPDATE_SWFW"),
    (79, "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "GPU has fallen off the bus", "RESTART_BM"),
    (80, "PBDMA_PUSHBUFFER_CRC_MISMATCH", "Corrupted data sent to GPU", "RESTART_APP"),
    (81, "ROBUST_CHANNEL_VGA_SUBSYSTEM_ERROR", "Unused", "CONTACT_SUPPORT"),
    (82, "ROBUST_CHANNEL_NVJPG0_ERROR", "NVJPG0 Error", "RESTART_APP"),
    (83, "ROBUST_CHANNEL_NVDEC1_ERROR", "NVDEC1 Error", "RESTART_APP"),
    (84, "ROBUST_CHANNEL_NVDEC2_ERROR", "NVDEC2 Error", "RESTART_APP"),
    (85, "ROBUST_CHANNEL_CE9_ERROR", "CE9: Unknown Error", "RESTART_APP"),
    (86, "ROBUST_CHANNEL_OFA0_ERROR", "OFA Exception", "RESTART_APP"),
    (87, "NVTELEMETRY_DRIVER_REPORT", "Unused", "CONTACT_SUPPORT"),
    (88, "ROBUST_CHANNEL_NVDEC3_ERROR", "NVDEC3 Error", "RESTART_APP"),
    (89, "ROBUST_CHANNEL_NVDEC4_ERROR", "NVDEC4 Error", "RESTART_APP"),
    (90, "LTC_ERROR", "Unused", "CONTACT_SUPPORT"),
    (91, "RESERVED_XID", "Unused", "CONTACT_SUPPORT"),
    (92, "EXCESSIVE_SBE_INTERRUPTS", "high single-bit ECC error rate", "IGNORE"),
    (
        93,
        "INFOROM_ERASE_LIMIT_EXCEEDED",
        "Non-fatal violation of provisioned InfoROM wear limit",
        "IGNORE",
    ),
    (94, "ROBUST_CHANNEL_CONTAINED_ERROR", "contained memory error", "RESTART_APP"),
    (95, "ROBUST_CHANNEL_UNCONTAINED_ERROR", "uncontained memory error", "RESET_GPU"),
    (96, "ROBUST_CHANNEL_NVDEC5_ERROR", "NVDEC5 Error", "RESTART_APP"),
    (97, "ROBUST_CHANNEL_NVDEC6_ERROR", "NVDEC6 Error", "RESTART_APP"),
    (98, "ROBUST_CHANNEL_NVDEC7_ERROR", "NVDEC7 Error", "RESTART_APP"),
    (99, "ROBUST_CHANNEL_NVJPG1_ERROR", "NVJPG1 Error", "RESTART_APP"),
    (100, "ROBUST_CHANNEL_NVJPG2_ERROR", "NVJPG2 Error", "RESTART_APP"),
    (101, "ROBUST_CHANNEL_NVJPG3_ERROR", "NVJPG3 Error", "RESTART_APP"),
    (102, "ROBUST_CHANNEL_NVJPG4_ERROR", "NVJPG4 Error", "RESTART_APP"),
    (103, "ROBUST_CHANNEL_NVJPG5_ERROR", "NVJPG5 Error", "RESTART_APP"),
    (104, "ROBUST_CHANNEL_NVJPG6_ERROR", "NVJPG6 Error", "RESTART_APP"),
    (105, "ROBUST_CHANNEL_NVJPG7_ERROR", "NVJPG7 Error", "RESTART_APP"),
    (106, "SMBPBI_TEST_MESSAGE", "SMBPBI Test Message", "IGNORE"),
    (107, "SMBPBI_TEST_MESSAGE_SILENT", "SMBPBI Test Message Silent", "IGNORE"),
    (108, "NVLINK_REMOTE_TRANSLATION_ERROR", "Unused", "IGNORE"),
    (109, "ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", "context switch timeout", "RESET_GPU"),
    (110, "SEC_FAULT_ERROR", "security fault", "RESET_GPU"),
    (111, "BUNDLE_ERROR_EVENT", "Unused", "CONTACT_SUPPORT"),
    (112, "DISP_SUPERVISOR_ERROR", "Unused", "CONTACT_SUPPORT"),
    (113, "DP_LT_FAILURE", "Unused", "CONTACT_SUPPORT"),
    (114, "HEAD_RG_UNDERFLOW", "Unused", "CONTACT_SUPPORT"),
    (115, "CORE_CHANNEL_REGS", "Unused", "CONTACT_SUPPORT"),
    (116, "WINDOW_CHANNEL_REGS", "Unused", "CONTACT_SUPPORT"),
    (117, "CURSOR_CHANNEL_REGS", "Unused", "CONTACT_SUPPORT"),
    (118, "HEAD_REGS", "Unused", "CONTACT_SUPPORT"),
    (119, "GSP_RPC_TIMEOUT", "GSP RPC timeout", "RESET_GPU"),
    (120, "GSP_ERROR", "GSP error", "RESET_GPU"),
    (121, "C2C_ERROR", "C2C Error", "IGNORE"),
    (122, "SPI_PMU_RPC_READ_FAIL", "Unused", "CONTACT_SUPPORT"),
    (123, "SPI_PMU_RPC_WRITE_FAIL", "Unused", "CONTACT_SUPPORT"),
    (124, "SPI_PMU_RPC_ERASE_FAIL", "Unused", "CONTACT_SUPPORT"),
    (125, "INFOROM_FS_ERROR", "Unused", "CONTACT_SUPPORT"),
    (126, "ROBUST_CHANNEL_CE10_ERROR", "CE10: Unknown Error", "RESTART_APP"),
    (127, "ROBUST_CHANNEL_CE11_ERROR", "CE11: Unknown Error", "RESTART_APP"),
    (128, "ROBUST_CHANNEL_CE12_ERROR", "CE12: Unknown Error", "RESTART_APP"),
    (129, "ROBUST_CHANNEL_CE13_ERROR", "CE13: Unknown Error", "RESTART_APP"),
    (130, "ROBUST_CHANNEL_CE14_ERROR", "CE14: Unknown Error", "RESTART_APP"),
    (131, "ROBUST_CHANNEL_CE15_ERROR", "CE15: Unknown Error", "RESTART_APP"),
    (132, "ROBUST_CHANNEL_CE16_ERROR", "CE16: Unknown Error", "RESTART_APP"),
    (133, "ROBUST_CHANNEL_CE17_ERROR", "CE17: Unknown Error", "RESTART_APP"),
    (134, "ROBUST_CHANNEL_CE18_ERROR", "CE18: Unknown Error", "RESTART_APP"),
    (135, "ROBUST_CHANNEL_CE19_ERROR", "CE19: Unknown Error", "RESTART_APP"),
    (136, "ALI_TRAINING_FAIL", "link training failed", "RESET_GPU"),
    (137, "NVLINK_PRIV_ERR", "NVLink Privilege Error", "IGNORE"),
    (138, "ROBUST_CHANNEL_DLA_ERROR", "Unused", "CONTACT_SUPPORT"),
    (139, "ROBUST_CHANNEL_OFA1_ERROR", "OFA1 Error", "RESTART_APP"),
    (140, "UNRECOVERABLE_ECC_ERROR_ESCAPE", "ECC unrecovered error", "RESET_GPU"),
    (141, "ROBUST_CHANNEL_FAST_PATH_ERROR", "CUDA Fast Path Error", "IGNORE"),
    (142, "ROBUST_CHANNEL_NVENC3_ERROR", "NVENC3 Error", "CONTACT_SUPPORT"),
    (143, "GPU_INIT_ERROR", "GPU initialization error", "RESET_GPU"),
    (144, "NVLINK_SAW_ERROR", "NVLINK: SAW Error", "WORKFLOW_NVLINK5_ERR"),
    (145, "NVLINK_RLW_ERROR", "NVLINK: RLW Error", "WORKFLOW_NVLINK5_ERR"),
    (146, "NVLINK_TLW_ERROR", "NVLINK: TLW Error", "WORKFLOW_NVLINK5_ERR"),
    (147, "NVLINK_TREX_ERROR", "NVLINK: TREX Error", "WORKFLOW_NVLINK5_ERR"),
    (148, "NVLINK_NVLPW_CTRL_ERROR", "NVLINK: NVLPW_CTRL Error", "WORKFLOW_NVLINK5_ERR"),
    (149, "NVLINK_NETIR_ERROR", "NVLINK: NETIR Error", "WORKFLOW_NVLINK5_ERR"),
    (150, "NVLINK_MSE_ERROR", "NVLINK: MSE Error", "WORKFLOW_NVLINK5_ERR"),
    (151, "ROBUST_CHANNEL_KEY_ROTATION_ERROR", "Key rotation Error", "RESTART_VM"),
    (152, "ROBUST_CHANNEL_DLA_SMMU_ERROR", "DLA SMMU Error", "IGNORE"),
    (153, "ROBUST_CHANNEL_DLA_TIMEOUT", "DLA timeout Error", "IGNORE"),
    (154, "GPU_RECOVERY_ACTION_CHANGED", "GPU recovery action changed", "XID_154"),
    (155, "NVLINK_SW_DEFINED_ERROR", "NVLink software-defined error", "RESET_GPU"),
    (156, "RESOURCE_RETIREMENT_EVENT", "resource retirement event", "RESET_GPU"),
    (157, "RESOURCE_RETIREMENT_FAILURE", "Resource Retirement Failure", "IGNORE"),
    (158, "GPU_FATAL_TIMEOUT", "GPU fatal timeout", "RESET_GPU"),
    (159, "ROBUST_CHANNEL_CHI_NON_DATA_ERROR", "CHI Non-Data Error", "CHECK_UVM"),
    (160, "CHANNEL_RETIREMENT_EVENT", "Channel Retirement Event", "IGNORE"),
    (161, "CHANNEL_RETIREMENT_FAILURE", "Channel Retirement Failure", "IGNORE"),
    (162, "PSHC_REENGAGED", "Power Smoothing HW Circuitry capability reengaged", ""),
    (163, "PSHC_DISENGAGED", "Power Smoothing HW Circuitry capability disengaged", ""),
    (164, "PSHC_LOW_LIFETIME", "Power Smoothing HW Circuitry low lifetime reached", ""),
    (165, "PSHC_ZERO_LIFETIME", "Power Smoothing HW Circuitry lifetime exhausted", ""),
    (
        166,
        "NVLINK_SECURE_CRYPTO_ERR",
        "CC traffic seen prior to link properly being configured for encrypted traffic",
        "",
    ),
    (167, "PCIE_FATAL_TIMEOUT", "PCIE_FATAL_TIMEOUT", ""),
    (168, "REDUCED_GPU_MEMORY_CAPACITY", "Errors found in WPR (write protected region)", ""),
    (169, "SEC2_HALT_ERROR", "Internal micro-controller halt", ""),
    (170, "NVLINK_SECURE_OTHER", "Interrupt seen in CC mode", ""),
    (
        171,
        "UNCORRECTABLE_DRAM_ERROR",
        "Additional to Xid 48: more details on the fault, to tell DRAM from SRAM",
        "",
    ),
    (
        172,
        "UNCORRECTABLE_SRAM_ERROR",
        "Additional to Xid 48: more details on the fault, to tell DRAM from SRAM",
        "",
    ),
)


def class_of(code: int, bucket: str) -> XidClass:
    """The class of a catalogued code: its deviation, else its bucket's."""
    if code in DEVIATIONS:
        return DEVIATIONS[code]
    if bucket.startswith("WORKFLOW_"):
        return _O
    return BUCKET_CLASS.get(bucket, _U)


CATALOGUE: Final[dict[int, XidInfo]] = {
    code: XidInfo(code, mnemonic, meaning, bucket, class_of(code, bucket))
    for code, mnemonic, meaning, bucket in _ROWS
}


def lookup(code: int) -> XidInfo:
    """The entry for ``code``; an unknown code is UNKNOWN, never assumed harmless."""
    known = CATALOGUE.get(code)
    if known is not None:
        return known
    return XidInfo(code, "", "not in gpuguard's catalogue", "", XidClass.UNKNOWN)
