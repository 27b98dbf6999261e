"""Allow ``python -m gpuguard``."""

import sys

from gpuguard.entry import main

sys.exit(main())
