"""gpuguard: keep GPU inference services out of restart loops caused by stale GPU memory."""

__version__ = "0.1.0"
