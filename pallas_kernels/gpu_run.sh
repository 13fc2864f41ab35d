#!/usr/bin/env bash
# One GPU session for the Pallas KDA kernel: install the carried wheels, print the environment, run the
# kernel's tests compiled (not interpreted), then the benchmark. Run from the repository root on the
# GPU machine, with .whl/ carried along (fla-core, flash-linear-attention, ml-collections, einops):
#
#   bash pallas_kernels/gpu_run.sh [benchmark args, e.g. --shapes=8x4096x16x128 --impls=pallas,fla]
#
# Logs and results go to $OUT (default ./gpu_out): pytest_gpu.log, bench.log, bench_kda.json.
# A failing test does not stop the benchmark; the script's exit status is the benchmark's.
set -u -o pipefail

OUT="${OUT:-$PWD/gpu_out}"
export OUT
mkdir -p "$OUT"

# Caches under /tmp: fla's compiled Triton kernels (torch side) and JAX's compiled executables are
# reused between the test run and the benchmark within one machine session.
export TRITON_CACHE_DIR=/tmp/triton_cache
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache
mkdir -p "$TRITON_CACHE_DIR" "$JAX_COMPILATION_CACHE_DIR"

echo "== installing wheels"
ls -l .whl/*.whl || { echo "no .whl/*.whl: carry .whl"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || { echo "wheel install failed"; exit 1; }

echo "== environment"
nvidia-smi || echo "nvidia-smi failed"
python3 - <<'EOF'
import importlib.metadata as md, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("jax", "jaxlib", "jax-cuda13-plugin", "flax", "torch", "triton", "fla-core",
             "flash-linear-attention", "einops", "transformers", "ml-collections"):
    try:
        print(f"{name:24s} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name:24s} MISSING")
import jax
print("jax devices", jax.devices(), jax.devices()[0].device_kind)
try:
    import torch
    print("torch cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
except Exception as e:
    print("torch import failed:", repr(e)[:300])
EOF

echo "== tests (compiled Pallas: K3_PALLAS_INTERPRET=0)"
K3_PALLAS_INTERPRET=0 python3 -m pytest -q -x tests/test_pallas_kda.py 2>&1 | tee "$OUT/pytest_gpu.log"
echo "pytest exit status: $?"

echo "== benchmark"
PYTHONUNBUFFERED=1 python3 -m pallas_kernels.bench_kda --out="$OUT/bench_kda.json" "$@" 2>&1 | tee "$OUT/bench.log"
status=$?
echo "benchmark exit status: $status"
exit $status
