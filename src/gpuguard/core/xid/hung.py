"""Kernel lines of the NVIDIA driver that mean a GPU stopped making progress (pure).

Not Xids, and not about one process: the driver saying the GPU itself hangs. Each text is
matched literally, from a line journald read from /dev/kmsg (``_TRANSPORT=kernel``, which no
client can send), and kept with its source:

* ``nvidia-modeset: ERROR: GPU:0: Error while waiting for GPU progress: 0x0000ca7d:0 2:0:200:192``
  — nvidia-modeset (NVKMS) waited five seconds for the GPU's display channel to move and it did
  not; it repeats while the GPU stays hung (NVIDIA/open-gpu-kernel-modules pull request #1252's
  excerpt; nokyan/resources issue #472). ``GPU:N`` is NVKMS's own numbering, not NVML's index.
* ``NVRM: krcWatchdog_IMPL: RC watchdog: GPU is probably locked!  Notify Timeout Seconds: 7``
  — the resource manager's watchdog found a channel stuck past its timeout
  (NVIDIA/open-gpu-kernel-modules pull request #1031's excerpt).

A kill does not help a hung GPU: status says a reset or reboot may be needed. The scan is linear
and bounded (``SCAN_CHARS``); what follows the phrase is escaped and cut, for people only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from gpuguard.core.escaping import escape

MODESET_PROGRESS: Final = "Error while waiting for GPU progress"
RC_WATCHDOG: Final = "RC watchdog: GPU is probably locked"
MARKERS: Final = (MODESET_PROGRESS, RC_WATCHDOG)
"""The literal phrases: also the journalctl ``--grep`` pre-filters (each escaped as a regex)."""
SOURCES: Final = {
    MODESET_PROGRESS: "nvidia-modeset waited for GPU progress in vain",
    RC_WATCHDOG: "the NVIDIA driver's RC watchdog found the GPU locked",
}
SCAN_CHARS: Final = 512
_DETAIL_CHARS: Final = 200
_GPU_CHARS: Final = 16


@dataclass(frozen=True, slots=True)
class HungGpuLine:
    """One kernel line saying a GPU hangs: what said it, the GPU as the line names it, the text."""

    said: str
    """Which of ``SOURCES`` said it, in words."""
    gpu: str | None
    """The GPU as the line names it (``GPU:0``, NVKMS's numbering); None when it names none."""
    text: str
    """The line from the driver's prefix on, escaped and cut: for people only."""
    monotonic_s: float | None
    realtime_s: float | None
    boot_id: str | None

    def to_json(self) -> dict[str, Any]:
        """The line as the daemon's snapshot keeps it (``xid.hung``); ``time`` is added there."""
        return {"said": self.said, "gpu": self.gpu, "text": self.text, "boot_id": self.boot_id}


def parse_hung_entry(entry: Mapping[str, object]) -> HungGpuLine | None:
    """The hung-GPU line a kernel journal entry carries, or None."""
    if not isinstance(entry, Mapping) or entry.get("_TRANSPORT") != "kernel":
        return None
    message = entry.get("MESSAGE")
    if isinstance(message, list) and all(isinstance(b, int) and 0 <= b <= 255 for b in message):
        message = bytes(message[: 4 * SCAN_CHARS]).decode("utf-8", errors="replace")
    if not isinstance(message, str):
        return None
    text = message[: SCAN_CHARS * 2]
    marker = next((m for m in MARKERS if text.find(m, 0, SCAN_CHARS + len(m)) >= 0), None)
    if marker is None:
        return None
    start = max(text.find("nvidia-modeset: "), text.find("NVRM: "), 0)
    return HungGpuLine(
        said=SOURCES[marker],
        gpu=_gpu(text) if marker == MODESET_PROGRESS else None,
        text=escape(text[start : start + _DETAIL_CHARS]),
        monotonic_s=_seconds(entry.get("__MONOTONIC_TIMESTAMP")),
        realtime_s=_seconds(entry.get("__REALTIME_TIMESTAMP")),
        boot_id=_boot(entry.get("_BOOT_ID")),
    )


def _gpu(text: str) -> str | None:
    """``GPU:N`` after ``ERROR: `` when it is one (digits only), else None."""
    at = text.find("ERROR: GPU:", 0, SCAN_CHARS)
    if at < 0:
        return None
    digits = text[at + len("ERROR: GPU:") : at + len("ERROR: GPU:") + _GPU_CHARS].split(":", 1)[0]
    return f"GPU:{digits}" if digits.isascii() and digits.isdigit() else None


def _seconds(value: object) -> float | None:
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 19:
        return int(value) / 1_000_000
    return None


def _boot(value: object) -> str | None:
    return value if isinstance(value, str) and len(value) <= 64 else None
