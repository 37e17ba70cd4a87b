"""Pools on a mesh of 8 simulated CPU devices (the checks run in subprocesses,
so the device-count flag never touches the rest of the suite)."""

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import pytest

import jaxkv

CHECK = Path(__file__).with_name("sharded_check.py")
TYPED_CHECK = Path(__file__).with_name("typed_sharded_check.py")


def _run_check(script: Path, *args: object) -> None:
    """Runs a check script in its own process (its own device count); OK or fail."""
    out = subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=script.parent.parent,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.strip().endswith("OK")


def test_the_suite_itself_keeps_its_default_devices():
    """Importing the check scripts (doctest collection) must not set the flag."""
    assert "device_count" not in os.environ.get("XLA_FLAGS", "")


@pytest.mark.slow
def test_sharded_pools_match_single_device_runs():
    """Every mesh shape of 8 devices (tensor only, both axes, data only), both
    axis types and a packed pool, in one process (one JAX start)."""
    _run_check(
        CHECK,
        "1x8:explicit:pools",
        "2x4:explicit:pools",
        "4x2:explicit:pools",
        "8x1:explicit:pools",
        "2x4:auto:pools",
        "2x4:explicit:packed",
    )


@pytest.mark.slow
def test_stacked_typed_pools_on_meshes_scan_over_layers_in_place():
    """A layer scan over one stacked typed pool per rank, on four meshes and
    both axis types: each rank's bytes equal the rank-local single-device run,
    attention equals the global model's, no collective, no pool-sized temp."""
    _run_check(TYPED_CHECK, "1x8:explicit", "2x4:explicit", "8x1:explicit", "2x4:auto")


def test_local_config_splits_heads_and_mamba_states():
    cfg = jaxkv.tiny_hybrid_config(num_heads=8, num_kv_heads=4, head_size=16)
    local = jaxkv.plan.local_runner_config(cfg, tensor_parallel=8)
    attn = local.layer("layers.0.self_attn")
    attn_spec: Any = attn.spec
    assert attn_spec.num_kv_heads == 1  # 4 heads over 8 ranks: replicated
    assert attn.num_heads == 1
    mamba: Any = local.layer("layers.2.mixer").spec
    assert mamba.shapes == ((3, 16), (1, 16, 16))  # channels and heads split
    assert mamba.page_size_bytes == attn_spec.page_size_bytes  # pools still shared
    mla = jaxkv.MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=16, dtype="float32"
    )
    cfg = jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(name="m", spec=mla, backend=jaxkv.get_backend("FLASHMLA"))
        ]
    )
    assert jaxkv.plan.local_runner_config(cfg, tensor_parallel=4).layer("m").spec == mla


def test_heads_that_do_not_split_are_refused():
    spec = jaxkv.FullAttentionSpec(
        block_size=16, num_kv_heads=3, head_size=8, dtype="float32"
    )
    layer = jaxkv.LayerConfig(
        name="l", spec=spec, backend=jaxkv.get_backend("JAX_PAGED"), num_heads=12
    )
    cfg = jaxkv.RunnerConfig(layers=[layer])
    with pytest.raises(ValueError, match="3 KV heads cannot be split over .* 4"):
        jaxkv.plan.local_runner_config(cfg, tensor_parallel=4)
    mesh = jax.make_mesh((1, 1), ("data", "tensor"))
    with pytest.raises(ValueError, match="tensor_axis='model' is not an axis"):
        jaxkv.shard_plan(cfg, mesh=mesh, tensor_axis="model", num_blocks=4)


ENGINE = Path(__file__).with_name("engine_mesh_check.py")


@pytest.mark.slow
def test_engine_on_meshes_serves_what_one_device_serves():
    """1x8 (KV heads replicated over the tensor ranks) against one
    single-device reference run. The Engine is a ServingLoop: 2x4, 4x2 and 8x1
    are served by ``serve_mesh_check.py``.
    """  # noqa: D205
    _run_check(ENGINE, "1x8")


@pytest.mark.slow
def test_an_8_bit_cache_on_a_mesh_serves_what_one_device_serves():
    """Int8 pages with per-token-head scales on a 2x4 mesh (one KV head per
    tensor rank: the scales shard with their heads) against one device.
    """  # noqa: D205
    _run_check(ENGINE, "--quant", "int8_per_token_head", "2x4")


SERVE = Path(__file__).with_name("serve_mesh_check.py")


@pytest.mark.slow
def test_serving_loop_on_meshes_serves_what_one_device_serves():
    """2x4 (Explicit axes), 4x2 (Auto axes), 8x1: data-parallel ranks and a
    tensor-parallel model through one ServingLoop, with and without overlap,
    preemption and prefix caching; no pool-moving collective. Requests moved
    from a 1x4 prefill loop to a 2x2 decode loop and back decode as never moved.
    """  # noqa: D205
    _run_check(SERVE, "2x4", "4x2-auto", "8x1")


FAULTS = Path(__file__).with_name("mesh_fault_check.py")


@pytest.mark.slow
def test_a_fault_on_one_rank_of_two_resumes_to_the_fault_free_tokens():
    """Rank 1's scheduler raises while rank 0 has applied the step (advance,
    resolve; overlap on and off): each rank's step applied once.
    """  # noqa: D205
    _run_check(FAULTS)


MULTIHOST = Path(__file__).with_name("multihost_check.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_over_loopback_serve_what_one_process_serves():
    """jax.distributed with gloo: a 2 x 4 mesh over two processes of 4 devices."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(MULTIHOST), str(pid), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=MULTIHOST.parent.parent,
        )
        for pid in (0, 1)
    ]
    outs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=240)
            outs.append(out)
    finally:
        for proc in procs:  # never leave a process waiting for its peer
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert "OK" in outs[0], outs[0][-3000:]
