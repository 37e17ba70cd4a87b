import os
import pathlib

os.environ.setdefault("MPLBACKEND", "Agg")  # pictures render headless
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One worker per core (pytest -n auto): each worker's XLA runs on one
    # thread, so workers do not contend for the cores.
    # (Only XLA flags: a token without "--" ends XLA's parsing of the
    # variable, and the check scripts' subprocesses append their device count
    # to it.)
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
    ).strip()

import jax
from hypothesis import settings
from jaxtyping import install_import_hook

# Run-time shape and dtype checks: every function and dataclass of each module
# whose signatures carry jaxtyping array annotations (found by scanning the
# package, so a new one is checked too) is checked by beartype on each call
# (at trace time under jit) for the whole suite; entry points marked
# @checks_own_arguments are skipped (their named errors are what the suite
# checks). Installed before any test imports jaxkv. Modules without array
# annotations are left alone: their bad-input errors are jaxkv's own, which
# the suite checks word for word.
_PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxkv"
_TYPECHECKED = tuple(
    sorted(
        ".".join(path.relative_to(_PACKAGE.parent).with_suffix("").parts)
        for path in _PACKAGE.rglob("*.py")
        if "from jaxtyping import" in (text := path.read_text())
        or "@checks_own_arguments" in text
    )
)
install_import_hook(_TYPECHECKED, "beartype.beartype")

# Deterministic examples by default, so CI is reproducible; set
# JAXKV_HYPOTHESIS_PROFILE=random to explore new ones locally.
settings.register_profile("jaxkv", derandomize=True, print_blob=True)
settings.register_profile("random", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("JAXKV_HYPOTHESIS_PROFILE", "jaxkv"))

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
# fp32 matmuls at full precision on every backend (GPUs default to TF32), so
# results compare with NumPy references and the dense oracle exactly.
jax.config.update("jax_default_matmul_precision", "highest")
