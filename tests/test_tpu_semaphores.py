"""The TPU attention kernel's DMA starts and waits balance, under the TPU
interpreter that simulates DMAs and their semaphores (``pltpu.InterpretParams``).

CI's usual interpret mode runs a kernel's DMAs at once, so a wait for bytes
that never come (a hang on a TPU) passes there; here it hangs, and the
subprocess's timeout fails the test. The simulating interpreter takes no ref
bitcasts, so it runs a case whose pages the kernel gathers (waves of 2, the
last part-empty): the waits are the same code for every page layout.
"""  # noqa: D205

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import numpy as np
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    import jaxkv.attention._pallas_tpu as tpu
    from tests.attention_cases import CASES, build, run

    def simulated(*args, **kwargs):
        if kwargs.get("interpret"):
            kwargs["interpret"] = pltpu.InterpretParams(detect_races=True)
        return pl.pallas_call(*args, **kwargs)

    tpu.pl = type("pl", (), {**vars(pl), "pallas_call": staticmethod(simulated)})
    case = next(c for c in CASES if c.name == "mixed_kv_waves_window")
    built = build(case)
    got, want = run(built, "pallas_tpu"), run(built, "xla")
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    print("balanced")
    """
)


def test_every_dma_wait_meets_its_bytes_in_the_simulating_interpreter():
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        env={"JAX_PLATFORMS": "cpu", **__import__("os").environ},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "balanced" in done.stdout
