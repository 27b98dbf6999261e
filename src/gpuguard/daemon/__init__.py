"""The watchdog daemon (`gpuguard run`): journal in, recovery out."""
