"""``python -m stripefs.fsclient.fuse mount|umount ...``: what the detached mount daemon runs."""

import sys

from ._daemon import main

sys.exit(main(sys.argv[1:]))
