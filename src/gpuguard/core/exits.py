"""gpuguard's exit statuses past a command's own outcome, in one place (sysexits.h's numbers).

A command's 0-3 are its result (a monitoring level for status and doctor, done or refused for
the others); these say it did not get that far, with the numbers sysexits.h gives them, so a
unit's RestartPreventExitStatus= and an operator's script can tell a typo from a failure.
"""

from __future__ import annotations

from typing import Final

EX_USAGE: Final = 64
"""A usage error: an unknown option or command, a --unit nobody knows (argparse would say 2)."""
EX_UNAVAILABLE: Final = 69
"""A service gpuguard needs did not answer (explain: journalctl could not read the journal)."""
EX_OSERR: Final = 71
"""serve-gate was not started the way gpuguard-gate.socket starts it."""
EX_CANTCREAT: Final = 73
"""The daemon cannot write its runtime or state directory (it runs as root)."""
EX_NOPERM: Final = 77
"""The command needs a permission this user lacks (root)."""
EX_CONFIG: Final = 78
"""The configuration file is invalid."""
