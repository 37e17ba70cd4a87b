"""Serving your own model: a loop over the scheduler, the step builder and a
step function of yours, with sampling, stop tokens, streaming, warm-up and
fault resumption.
"""  # noqa: D205
