"""``python -m jaxkv``: the demo (see :mod:`jaxkv.demo.cli`)."""

import sys

from jaxkv.demo.cli import main

if __name__ == "__main__":
    sys.exit(main())
