"""``python -m remat``: see :mod:`remat.cli`."""

import sys

from remat.cli import main

sys.exit(main())
