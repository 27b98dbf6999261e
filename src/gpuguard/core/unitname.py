r"""What gpuguard accepts as a systemd unit's name: the syntax every module checks, in one place.

systemd.unit(5): a unit name's prefix consists of ASCII letters, digits, ":", "-", "_", ".",
"\" (and "@" for a template's instance), and the whole name is at most 255 characters
(UNIT_NAME_MAX, 256 with its terminating NUL, in systemd's unit-name.h). A name is checked
before it reaches journalctl's argv, a drop-in's path or a gate request, so a forged one cannot
become an option or a path. ``UNIT_NAME`` is any unit (the journal follower, the drop-in's
directory, explain); a gate request and the configuration name a service (``SERVICE_NAME``).
"""

from __future__ import annotations

import re
from typing import Final

UNIT_NAME: Final = re.compile(r"[A-Za-z0-9:_.\\@-]{1,255}")
SERVICE_NAME: Final = re.compile(r"[A-Za-z0-9:_.\\@-]{1,247}\.service")
