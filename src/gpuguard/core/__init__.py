"""The pure core: decisions from values (no I/O; time, files and processes are passed in)."""
