"""A skip for tests that assume the host's PID namespace.

In a container's own PID namespace NVML's PIDs are the host's: gpuguard says so and judges
memory no process here explains as "used from outside this container" (a WARNING), so a test
that expects this /proc's PIDs in NVML's lists cannot hold there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuguard.core.containment import INIT_PID_NAMESPACE_INODE

HOST_PIDS = pytest.mark.skipif(
    Path("/proc/self/ns/pid").stat().st_ino != INIT_PID_NAMESPACE_INODE,
    reason="assumes the host's PID namespace (NVML's PIDs are then this /proc's)",
)
