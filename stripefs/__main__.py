"""``python -m stripefs ...`` is the ``stripefs`` command."""

import sys

from .cli import main

sys.exit(main())
