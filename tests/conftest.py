import importlib
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

# Run-time type and shape checks over the whole package: beartype checks every
# annotated function and dataclass of every module on each call (at trace
# time under jit), jaxtyping's array annotations included. Entry points that
# validate their own arguments with named errors are marked
# @checks_own_arguments and skipped (those errors are what the suite checks).
# The namespace modules (the package's, its public sub-packages' ``__init__``
# and ``jaxkv.vllm``), which only re-export, are left out so their ``dir()`` stays
# exactly their API. Installed before any test imports jaxkv.
_PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxkv"
_TYPECHECKED = tuple(
    sorted(
        ".".join(path.relative_to(_PACKAGE.parent).with_suffix("").parts).removesuffix(
            ".__init__"
        )
        for path in _PACKAGE.rglob("*.py")
        if (path.name != "__init__.py" or path.parent.name.startswith("_"))
        and path != _PACKAGE / "vllm.py"
    )
)
importlib.import_module("tests._typecheck")  # the hook's checker, by name
install_import_hook(_TYPECHECKED, "tests._typecheck.typecheck")

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
