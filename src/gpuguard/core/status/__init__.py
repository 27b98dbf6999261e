"""Judge an inventory and render it for an operator: one screen of text, or versioned JSON (pure).

The exit status follows the monitoring-plugin convention (0 OK, 1 WARNING, 2 CRITICAL,
3 UNKNOWN) so the same command serves a human at a terminal and a Nagios/Icinga-style check.
One step per module: ``report`` the values (the context in, the report out), ``judge`` the
findings and the level (with ``gpufindings`` and ``holderfindings``), ``text`` the screen,
``document`` the JSON, ``words`` the phrases the findings and the screen share.
"""
