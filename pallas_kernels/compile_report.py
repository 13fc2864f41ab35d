"""What the GPU compiler makes of each Pallas Triton kernel, without a GPU: registers, spills, shared memory.

    python -m pallas_kernels.compile_report [--kernels=kda] [--shape=8x4096x16x128]
        [--variants=32:bfloat16] [--launch=pairs_bwd=8/1,...] [--backward=auto|fused|split|two]
        [--strip_precision=tf32|tf32x3|bf16x3|bf16x2|tf32_rounded] [--arch=9.0] [--json=FILE]

Every Pallas kernel of a whole train step: `python -m experiments.aot_report --registers ...`.

Each `pallas_call` of the traced function is lowered to its Triton module, compiled to PTX by XLA's
own Triton (the compilation handler of the CUDA plugin that matches the installed jaxlib), and the
PTX is assembled by `ptxas -v` for the target architecture. Per kernel the table gives the launch
(warps/stages), the registers per thread, the bytes spilled to local memory, the shared memory, and
how many tensor-core instructions the PTX holds (`wgmma` is Hopper's asynchronous warpgroup MMA,
`mma` the older per-warp one). A kernel at 255 registers that spills is the first suspect when it runs
far from its byte or FLOP floor; the wall-clock truth still comes from `bench_kda_split` on the GPU.

Requirements (no GPU, no CUDA driver): the CUDA plugin of the same version as jaxlib and a `ptxas`,
kept outside the project's environment because an installed CUDA plugin makes every JAX start-up
probe for a GPU:

    pip install --target /tmp/k3-triton "jax-cuda12-plugin==$(python -c 'import jaxlib; print(jaxlib.__version__)')" \\
        nvidia-cuda-nvcc-cu12==12.9.86
    PYTHONPATH=/tmp/k3-triton:$PYTHONPATH python -m pallas_kernels.compile_report

On a GPU machine with jax[cuda] installed nothing else is needed (`ptxas` from `nvidia-cuda-nvcc-cu12`
or the PATH). The report compiles with the installed jaxlib's Triton, so a kernel's figures can differ
slightly from another JAX version's.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

_TRITON_CALL = "__gpu$xla.gpu.triton"

PTXAS_HELP = ("no ptxas found: pass --ptxas, set PTXAS, put it on the PATH, or install "
              "nvidia-cuda-nvcc-cu12 (see `python -m pallas_kernels.compile_report --help`)")


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One `pallas_call` as lowered: its name, Triton module (MLIR bytecode) and launch."""

    name: str
    module: bytes
    num_warps: int
    num_stages: int


def capture_triton_kernels(fn, *args) -> list[TritonKernel]:
    """Lower `fn(*args)` for CUDA and return every Pallas Triton kernel it contains, in lowering order.

    args may be arrays or `jax.ShapeDtypeStruct`s; nothing runs. The capture wraps the Pallas Triton
    lowering for the duration of the call and restores it after."""
    from jax import export
    from jax._src.pallas.triton import lowering

    found: list[TritonKernel] = []
    original = lowering.lower_jaxpr_to_triton_module

    def spy(jaxpr, *a, **kw):
        result = original(jaxpr, *a, **kw)
        caller = sys._getframe(1).f_locals
        if "num_warps" not in caller or "num_stages" not in caller:
            raise RuntimeError("compile_report: this JAX version's Pallas Triton lowering is not the one "
                               "the report knows (no num_warps/num_stages at the call site)")
        buf = io.BytesIO()
        result.module.operation.write_bytecode(buf)
        name = caller.get("name") or jaxpr.debug_info.func_name
        found.append(TritonKernel(str(name), buf.getvalue(), int(caller["num_warps"]), int(caller["num_stages"])))
        return result

    lowering.lower_jaxpr_to_triton_module = spy
    try:
        export.export(jax.jit(fn), platforms=["cuda"],
                      disabled_checks=[export.DisabledSafetyCheck.custom_call(_TRITON_CALL)])(*args)
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    return found


def find_ptxas(explicit: str = "") -> str:
    """Path of a ptxas: the argument, $PTXAS, the PATH, then the nvidia-cuda-nvcc-cu12 wheel."""
    for cand in (explicit, os.environ.get("PTXAS", ""), shutil.which("ptxas") or ""):
        if cand and os.path.isfile(cand):
            return cand
    for root in sys.path:
        cand = os.path.join(root, "nvidia", "cuda_nvcc", "bin", "ptxas")
        if os.path.isfile(cand):
            return cand
    raise SystemExit(f"compile_report: {PTXAS_HELP}")


def _require_compiler():
    from jax._src.lib import triton
    import jaxlib

    # The CUDA plugin's start-up check needs a CUDA runtime; its Triton compiler does not.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    jax.devices()  # plugins register their Triton compiler when the backends initialise
    if not triton.has_compilation_handler("CUDA"):
        raise SystemExit(
            "compile_report: no Triton compiler for CUDA is registered. Install the CUDA plugin of "
            f"jaxlib's version ({jaxlib.__version__}) next to the project, e.g. `pip install --target "
            f"/tmp/k3-triton jax-cuda12-plugin=={jaxlib.__version__} nvidia-cuda-nvcc-cu12` and run with "
            "PYTHONPATH=/tmp/k3-triton (no GPU is needed)")
    return triton


_PTXAS_LINE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(stderr: str) -> dict:
    """registers, spill_store_bytes, spill_load_bytes, stack_bytes from `ptxas -v` output; also
    whether ptxas serialised wgmma instructions (its C7514 warning: accumulator read mid-pipeline)."""
    regs = _REGS.findall(stderr)
    frame = _PTXAS_LINE.findall(stderr)
    if not regs or not frame:
        raise ValueError(f"compile_report: ptxas output has no register/spill line:\n{stderr[-2000:]}")
    stack, stores, loads = (int(x) for x in frame[-1])
    return dict(registers=int(regs[-1]), spill_store_bytes=stores, spill_load_bytes=loads, stack_bytes=stack,
                wgmma_serialized="C7514" in stderr)


def count_mma(ptx: str) -> dict:
    """Tensor-core instructions in PTX text: Hopper's warpgroup `wgmma.mma_async` and per-warp `mma.sync`."""
    return dict(wgmma=len(re.findall(r"\bwgmma\.mma_async", ptx)), mma=len(re.findall(r"\bmma\.sync", ptx)))


def compile_kernel(kernel: TritonKernel, *, arch: str = "9.0", ptxas: str = "") -> dict:
    """Compile one captured kernel to PTX and assemble it; returns the report row for it."""
    triton = _require_compiler()
    result = triton.compile("cuda", kernel.module, arch, num_warps=kernel.num_warps, num_ctas=1,
                            num_stages=kernel.num_stages)
    sm = "sm_" + arch.replace(".", "") + ("a" if arch == "9.0" else "")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as fh:
            fh.write(result.asm)
        proc = subprocess.run([find_ptxas(ptxas), f"-arch={sm}", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"compile_report: ptxas failed on {kernel.name}:\n{proc.stderr[-2000:]}")
    return dict(kernel=kernel.name, warps=kernel.num_warps, stages=kernel.num_stages, smem_bytes=int(result.smem_bytes),
                ptx_lines=result.asm.count("\n"), **parse_ptxas(proc.stderr), **count_mma(result.asm))


def report(fn, *args, arch: str = "9.0", ptxas: str = "") -> list[dict]:
    """One row per distinct Pallas Triton kernel of `fn(*args)` (see `compile_kernel`), in lowering
    order; ``count`` says how many of its calls compiled to the same figures (e.g. a layer's kernel in
    every scanned group, or a forward kernel run again under remat)."""
    _require_compiler()
    rows, seen, by_stats = [], {}, {}
    for kernel in capture_triton_kernels(fn, *args):
        key = (kernel.name, kernel.module, kernel.num_warps, kernel.num_stages)
        if key not in seen:
            seen[key] = compile_kernel(kernel, arch=arch, ptxas=ptxas)
        row = seen[key]
        stats = tuple(sorted((k, v) for k, v in row.items() if k != "ptx_lines"))
        if stats in by_stats:
            by_stats[stats]["count"] += 1
        else:
            by_stats[stats] = dict(row, count=1)
            rows.append(by_stats[stats])
    return rows


def kda_forward_backward(shape, chunk: int, matmul_dtype: str, bk: int = 0, bki: int = 0, bp: int = 0, bv: int = 0,
                         bf: int = 0, *, launch=(), backward: str = "auto", strip_precision=None):
    """(fn, args): `pallas_kernels.kda`'s forward and backward kernels for one variant, as abstract
    shapes (bf16 q, k, v; fp32 g, beta), with the key blocks, launches and backward of
    `bench_kda_split`."""
    from pallas_kernels import kda as P

    B, T, H, K = shape
    x = jax.ShapeDtypeStruct((B, T, H, K), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((B, T, H, K), jnp.float32)
    beta = jax.ShapeDtypeStruct((B, T, H), jnp.float32)

    def loss(q, k, v, g, beta):
        cfg, inputs = P._prepare(q, k, v, g, beta, scale=None, initial_state=None, segment_ids=None,
                                 interpret=False, chunk_size=chunk, lower_bound=-5.0, check_gate=False,
                                 matmul_dtype=matmul_dtype, qk_l2norm=True)
        cfg = P.with_overrides(cfg, bk=bk, bki=bki, bp=bp, bv=bv, bf=bf, launch=launch, backward=backward,
                               strip_precision=strip_precision)
        o, _ = P._kda(cfg, *inputs)
        return o.astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4)), (x, x, x, g, beta)


def print_table(rows: list[dict], label: str = "") -> None:
    print("| variant | kernel | lowered | warps/stages | registers | spill store/load B | smem KiB | wgmma | mma |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {label} | {r['kernel']} | {r.get('count', 1)} | {r['warps']}/{r['stages']} | {r['registers']} | "
              f"{r['spill_store_bytes']}/{r['spill_load_bytes']} | {r['smem_bytes'] / 1024:.0f} | "
              f"{r['wgmma']}{' (serialised)' if r['wgmma_serialized'] else ''} | {r['mma']} |", flush=True)


def main(argv=None):
    from pallas_kernels import kda as P
    from pallas_kernels.bench_kda_split import parse_launch

    # The CUDA plugin's start-up check needs a CUDA runtime; its Triton compiler does not.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--kernels", default="kda", choices=("kda",))
    ap.add_argument("--shape", default="8x4096x16x128", help="B x T x H x K (K = V)")
    ap.add_argument("--variants", default="32:bfloat16",
                    help="comma-separated chunk:matmul_dtype[:bk[:bki[:bp[:bv[:bf]]]]], as bench_kda_split")
    ap.add_argument("--launch", type=parse_launch, default=(), help="kernel=warps/stages,...")
    ap.add_argument("--backward", default="auto", choices=("auto",) + tuple(P._BACKWARDS))
    ap.add_argument("--strip_precision", default=None, choices=P._STRIP_PRECISIONS)
    ap.add_argument("--arch", default="9.0", help="compute capability to compile for (9.0: H100/H200)")
    ap.add_argument("--ptxas", default="")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    shape = tuple(int(x) for x in a.shape.split("x"))
    if len(shape) != 4:
        raise SystemExit(f"--shape must be B x T x H x K; got {a.shape!r}")
    out = dict(command="python -m pallas_kernels.compile_report " + " ".join(sys.argv[1:] if argv is None else argv),
               jax=jax.__version__, arch=a.arch, shape=shape, variants={})
    for variant in filter(None, a.variants.split(",")):
        chunk, dtype, *blocks = variant.split(":")
        fn, args = kda_forward_backward(shape, int(chunk), dtype, *(int(b) for b in blocks), launch=a.launch,
                                        backward=a.backward, strip_precision=a.strip_precision)
        rows = report(fn, *args, arch=a.arch, ptxas=a.ptxas)
        print_table(rows, variant)
        out["variants"][variant] = rows
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main()
