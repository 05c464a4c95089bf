"""``python -m scalebook.train``: the command line of :mod:`scalebook.train.cli`."""

import sys

from scalebook.train.cli import main

sys.exit(main())
