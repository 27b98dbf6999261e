"""One module per command: gather through the adapters, judge with the core, print.

Each module imports its adapters inside the functions that use them, so ``--help`` stays
instant and the gate's fast path loads neither pydantic, structlog nor psutil.
"""
