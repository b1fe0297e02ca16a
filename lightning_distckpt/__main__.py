"""``python -m lightning_distckpt ...``: the command line (see :mod:`lightning_distckpt.cli`)."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
