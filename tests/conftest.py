import os

os.environ.setdefault("MPLBACKEND", "Agg")  # pictures render headless

import jax
from hypothesis import settings

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
