#!/usr/bin/env bash
# One prepared GPU check: environment, the test suite (quick hypothesis
# profile), the KV-write benchmark at GPU sizes and the device's copy bandwidth.
# Runs on CPU too (small sizes) so it never rots. Outputs go under $OUT if set.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$(mktemp -d)}"
PY="${PYTHON:-python3}"
on_gpu=$($PY -c "import jax; print(int(jax.default_backend() == 'gpu'))")
if [ "$on_gpu" = 1 ]; then pool_mib=4096; big_tokens=16384; else pool_mib=64; big_tokens=1024; fi

echo "== environment"
$PY -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv

echo "== tests (JAXKV_QUICK=1)"
JAXKV_QUICK=1 timeout 300 $PY -m pytest -q -x -p no:cacheprovider tests jaxkv 2>&1 | tail -n 15 | tee "$OUT/tests.log"

echo "== copy bandwidth"
$PY - <<'PY' | tee "$OUT/copy_bandwidth.txt"
import statistics, time, jax, jax.numpy as jnp
n = (1 << 28) if jax.default_backend() == "gpu" else (1 << 24)  # 1 GiB / 64 MiB of u32
x = jnp.zeros((n,), jnp.uint32)
f = jax.jit(lambda x: x + jnp.uint32(1))
jax.block_until_ready(f(x))
ts = []
for _ in range(20):
    t0 = time.perf_counter(); jax.block_until_ready(f(x)); ts.append(time.perf_counter() - t0)
t = statistics.median(ts)
print(f"copy_GBps {2 * x.nbytes / t / 1e9:.1f}  ({x.nbytes / 2**20:.0f} MiB read + written in {t * 1e3:.3f} ms)")
PY

echo "== KV write, 256 tokens"
$PY benchmarks/bench_kv_write.py --pool-mib "$pool_mib" --tokens 256 --iters 100 \
  --json "$OUT/kv_write_256.json"
echo "== KV write, $big_tokens tokens"
$PY benchmarks/bench_kv_write.py --pool-mib "$pool_mib" --tokens "$big_tokens" --iters 50 \
  --json "$OUT/kv_write_big.json"

echo "== fraction of copy bandwidth (bytes moved = K/V read + written)"
$PY - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
copy = float((out / "copy_bandwidth.txt").read_text().split()[1])
for name in ("kv_write_256", "kv_write_big"):
    r = json.loads((out / f"{name}.json").read_text())["results"]["bfloat16"]
    gbps = 2 * r["bytes_written"] / (r["jaxkv_ms"] / 1e3) / 1e9
    print(f"{name}: {gbps:.1f} GB/s = {gbps / copy:.1%} of copy bandwidth ({copy:.0f} GB/s)")
PY
