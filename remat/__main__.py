"""``python -m remat``: see :mod:`remat.cli.commands`."""

import sys

from remat.cli.commands import main

sys.exit(main())
