"""Adapters: one module per outside system (NVML, /proc, journal, systemd, signals, files)."""
