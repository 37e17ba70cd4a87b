#!/usr/bin/env bash
# One prepared GPU check (issue 6): environment, the test suite (quick hypothesis
# profile), the device's copy bandwidth, then benchmarks 1-4 at GPU sizes, and
# the achieved bandwidth of attention and KV writes as a fraction of the copy
# bandwidth. Runs on CPU too, at small sizes, so it never rots. Outputs go
# under $OUT when set. Benchmark-only wheels (ejkernel and its needs) are used
# when a .whl folder was carried along.
set -uo pipefail
cd "$(dirname "$0")/.."
# The whole check fits GPU_CHECK_BUDGET_S seconds (default 420): the
# benchmarks run first, each under its own timeout, and the tests get what is
# left (at least 60 s).
start=$SECONDS
budget=${GPU_CHECK_BUDGET_S:-420}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
on_gpu=$($PY -c "import jax; print(int(jax.default_backend() == 'gpu'))")
if [ "$on_gpu" = 1 ]; then
  pool_mib=4096; big_tokens=16384; reqs=256; ctx=4096; dtype=bfloat16; meta_reqs=256
  long_reqs=4; long_ctx=32768
else
  pool_mib=64; big_tokens=1024; reqs=8; ctx=256; dtype=float32; meta_reqs=64
  long_reqs=2; long_ctx=1024
fi

echo "== environment"
$PY -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv

echo "== copy bandwidth"
$PY - <<'PY' | tee "$OUT/copy_bandwidth.txt"
import statistics, time, jax, jax.numpy as jnp
n = (1 << 28) if jax.default_backend() == "gpu" else (1 << 24)  # 1 GiB / 64 MiB of u32
x = jnp.zeros((n,), jnp.uint32)
nbytes = x.nbytes
# Donated, so the output reuses the input: a fresh output buffer above 32 MiB is
# page-faulted in on every call on CPU, which is not bandwidth.
f = jax.jit(lambda x: x + jnp.uint32(1), donate_argnums=0)
x = jax.block_until_ready(f(x))
ts = []
for _ in range(20):
    t0 = time.perf_counter(); x = jax.block_until_ready(f(x)); ts.append(time.perf_counter() - t0)
t = statistics.median(ts)
print(f"copy_GBps {2 * nbytes / t / 1e9:.1f}  ({nbytes / 2**20:.0f} MiB read + written in {t * 1e3:.3f} ms)")
PY

echo "== 0. every kernel against XLA's path on this device (one case matrix)"
# On a GPU the Triton kernels run compiled here; the TPU kernels interpreted.
timeout 150 $PY -m pytest -q -p no:cacheprovider tests/test_attention_implementations.py \
  tests/test_kernel_lowering.py 2>&1 | tail -n 15 | tee "$OUT/kernels.log"

echo "== 1. paged decode attention ($reqs x $ctx, 32/8 heads of 128, $dtype)"
timeout 80 $PY benchmarks/bench_attention.py --num-reqs "$reqs" --context "$ctx" --dtype "$dtype" \
  --num-heads 32 --num-kv-heads 8 --iters 20 --json "$OUT/attention.json"
# Issue 55's other shapes, the typed pool's step alone against a copy of its bytes:
# a few long requests (split-KV), GQA 40:8 (5 query heads per KV head, padded),
# and head 96 (padded dims).
echo "== 1b. decode $long_reqs x $long_ctx"
timeout 45 $PY benchmarks/bench_attention.py --typed-only --num-reqs "$long_reqs" \
  --context "$long_ctx" --dtype "$dtype" --num-heads 32 --num-kv-heads 8 --iters 20 \
  --json "$OUT/attention_long.json"
echo "== 1c. decode $reqs x $ctx, GQA 40:8"
timeout 45 $PY benchmarks/bench_attention.py --typed-only --num-reqs "$reqs" --context "$ctx" \
  --dtype "$dtype" --num-heads 40 --num-kv-heads 8 --iters 20 --json "$OUT/attention_gqa5.json"
echo "== 1d. decode $reqs x $ctx, head 96"
timeout 45 $PY benchmarks/bench_attention.py --typed-only --num-reqs "$reqs" --context "$ctx" \
  --dtype "$dtype" --num-heads 32 --num-kv-heads 8 --head-dim 96 --iters 20 \
  --json "$OUT/attention_head96.json"
echo "== 2. KV write, 256 tokens"
timeout 40 $PY benchmarks/bench_kv_write.py --pool-mib "$pool_mib" --tokens 256 --iters 100 \
  --json "$OUT/kv_write_256.json"
echo "== 2. KV write, $big_tokens tokens"
timeout 40 $PY benchmarks/bench_kv_write.py --pool-mib "$pool_mib" --tokens "$big_tokens" --iters 30 --layers 4 \
  --json "$OUT/kv_write_big.json"
echo "== 2b. layer scan over a stacked typed pool (compile time)"
timeout 70 $PY benchmarks/bench_layer_scan.py --json "$OUT/layer_scan.json"
echo "== 3. step loop"
timeout 50 $PY benchmarks/bench_step_loop.py --json "$OUT/step_loop.json"
echo "== 4. host overhead per step ($meta_reqs requests)"
timeout 40 $PY benchmarks/bench_step_metadata.py --num-reqs "$meta_reqs" --iters 50 \
  --json "$OUT/step_metadata.json"

echo "== 5. serving loop vs a dense fori_loop"
timeout 60 $PY benchmarks/bench_serve.py --json "$OUT/serve.json"

echo "== figures against the issue's targets (summary.json)"
$PY - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
copy = float((out / "copy_bandwidth.txt").read_text().split()[1])
print(f"copy bandwidth (x + 1 over a donated buffer, read + written): {copy:.1f} GB/s")
summary = {"copy_GBps": copy}

def load(name):
    path = out / f"{name}.json"
    return json.loads(path.read_text())["results"] if path.exists() else None

def line(key, text, value, target):
    summary[key] = {"value": value, "target": target}
    print(f"{text}: {value:.3g} (target {target})")

r = load("attention")
if r:
    for pool, key, path in (("word", "jaxkv_ms", "decode_path"),
                            ("typed", "typed_ms", "typed_decode_path")):
        gbps = r["kv_bytes"] / (r[key] / 1e3) / 1e9
        line(f"decode_{pool}_fraction_of_copy",
             f"decode, {pool} pool ({r[path]}): {r['kv_bytes'] / 2**20:.0f} MiB of K/V at "
             f"{gbps:.1f} GB/s, fraction of {copy:.0f} GB/s", gbps / copy, ">= 0.80 (first bar 0.50)")
    if "mixed_jaxkv_ms" in r:
        decode_gbps = r["kv_bytes"] / r["typed_ms"] * 1e3 / 1e9
        mixed_gbps = r["mixed_kv_bytes"] / r["mixed_jaxkv_ms"] * 1e3 / 1e9
        line("mixed_over_decode_time_per_byte",
             f"mixed batch ({r['mixed_path']}): {mixed_gbps:.1f} GB/s; decode's time per byte "
             "over it", decode_gbps / mixed_gbps, "<= 2")
for name, text, target in (
    ("attention_long", "decode, a few long requests (split-KV)", ">= 0.60 (4 x 32k)"),
    ("attention_gqa5", "decode, GQA 40:8", ">= 0.80"),
    ("attention_head96", "decode, head 96", ">= 0.80"),
):
    r = load(name)
    if r:
        gbps = r["kv_bytes"] / (r["typed_ms"] / 1e3) / 1e9
        line(f"{name}_fraction_of_copy",
             f"{text} ({r['typed_decode_path']}): {r['kv_bytes'] / 2**20:.0f} MiB at "
             f"{gbps:.1f} GB/s, fraction of copy", gbps / copy, target)
for name in ("kv_write_256", "kv_write_big"):
    r = load(name)
    if r:
        r = r["bfloat16"]
        for pool, key in (("word", "jaxkv_ms"), ("typed", "typed_ms")):
            gbps = 2 * r["bytes_written"] / (r[key] / 1e3) / 1e9
            line(f"{name}_{pool}_fraction_of_copy",
                 f"{name}, {pool} pool: {gbps:.1f} GB/s moved, fraction of copy",
                 gbps / copy, ">= 0.70 (16,384 tokens)")
r = load("serve")
if r:
    line("serve_over_dense", "serving step / dense fori_loop", r["jaxkv_over_dense"], "<= 1.5")
r = load("layer_scan")
if r:
    line("scan_compile_32_over_2", "layer-scan compile, 32 / 2 layers",
         r["deep_over_shallow"], "<= 1.5")
(out / "summary.json").write_text(json.dumps(summary, indent=1))
PY

left=$((budget - (SECONDS - start)))
[ "$left" -lt 60 ] && left=60
echo "== tests (JAXKV_QUICK=1, ${left} s left)"
JAXKV_QUICK=1 timeout "$left" $PY -m pytest -q -p no:cacheprovider tests jaxkv 2>&1 \
  | tail -n 40 | tee "$OUT/tests.log"
