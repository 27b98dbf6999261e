"""Allow ``python -m gpuguard``."""

import sys

from gpuguard.cli import main

sys.exit(main())
