"""``python -m scalebook.train``: the command line of :mod:`scalebook.train.cli`.

Source: Python documentation, "__main__ — Top-level code environment" (``__main__.py`` in packages).
"""

import sys

from scalebook.train.cli import main

if __name__ == "__main__":  # imported (say by a test that imports every module), it runs nothing
    sys.exit(main())
