"""One module per command: gather through the adapters, judge with the core, return a result.

cli.py imports a command's module only when that command runs, and the gate server imports
every module before its first fork, so a command imports at its top what it uses. Lazy, with a
reason beside each, are only the imports a command's usual path skips and that cost time it
would pay: the gate's full path (the in-process gate on idle GPUs stays light), the
configuration in relay.py (the client of the gate server loads neither pydantic, structlog nor
psutil), a unit's pydantic settings in context.py, the container engine and the exporter in
status.py.
"""
