"""``python -m jaxkv``: the demo (see :mod:`jaxkv.demo._cli`)."""

import importlib.util
import sys

if importlib.util.find_spec("flax") is None:  # the core installs without it
    sys.exit(
        "python -m jaxkv runs the demo, whose model is written in Flax NNX: "
        "install it with pip install 'jaxkv[demo]' (or pip install flax)."
    )

from jaxkv.demo import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
