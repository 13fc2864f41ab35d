"""Benchmark of chunked Kimi Delta Attention: our Pallas kernel, the jnp reference, fla's Triton kernel and
jax-linear-attention's Mosaic GPU kernel.

    python -m pallas_kernels.bench_kda [--shapes=8x4096x16x128,2x16384x32x128,...]
        [--impls=pallas,reference,fla] [--chunk-size=64] [--out=FILE.json] [--warmup=5] [--iters=20] [--check | --no-check]
        [--seed=0]

Implementations (all on IDENTICAL inputs, made once per shape from a fixed seed):
  pallas     `pallas_kernels.kda.chunk_kda` with matmul_dtype='float32' (interpret mode on CPU,
             compiled elsewhere)
  pallas_bf16  the same with matmul_dtype='bfloat16' (bf16 operands and intermediates; the default
             for these bf16 inputs)
  reference  `k3.kda.ops.chunk_kda_reference` (plain jnp, fp32 HIGHEST-precision matmuls)
  fla        `fla.ops.kda.chunk_kda` (PyTorch + Triton) with use_qk_l2norm_in_kernel=True,
             safe_gate=True, lower_bound=-5; CUDA only, torch/fla are imported only when asked for.
  jla        jax-linear-attention's Mosaic GPU KDA (`k3.kda.ops` backend 'jla': chunk 64, bf16
             tensor-core operands, exact intra-chunk decay); Hopper and head dims 64/128 only.

Inputs follow `shared/bench/fla_kda_anchor.py`: q, k, v ~ N(0, 1) in bf16, g = -5 * sigmoid(N(0, 1))
in fp32 clamped to [-5, 0), beta ~ U(0, 1) in bf16, and a fixed random cotangent do ~ N(0, 1) in bf16.
q and k are NOT normalised beforehand: ours normalise them in kernels of their own
(`chunk_kda(qk_l2norm=True)`), the reference under the timer is l2_normalize(q), l2_normalize(k)
followed by the core, and fla normalises them inside its kernel (use_qk_l2norm_in_kernel=True).

What is measured, per shape and implementation:
  fwd      o = f(q, k, v, g, beta)
  fwd_bwd  (o, dq, dk, dv, dg, dbeta) from jax.vjp with the fixed do (fla: o.backward(do))
JAX functions are jitted and compiled ahead of time (compile time recorded apart), called `--warmup`
times, then timed as `--iters` calls dispatched back to back and waited for once, in 5 rounds (the
per-call mean of each round; median, p20 and p80 over the rounds). That is how a training loop runs
them and how `triton.testing.do_bench` times fla: CUDA events around calls queued without a host wait
(L2 flushed between calls; median and quantiles). The wall clock of single calls each waited for
(dispatch and the host's wait included, 0.3-0.5 ms more at 8x4096x16x128 on an H100) is kept as
'per_call' in the JSON.

Derived numbers use fixed models, the same for every implementation:
  FLOP   forward 1.71e5 and forward+backward 6.2e5 FLOP per token per head (chunk 64, K = V = 128);
         the model is only meaningful for K = V = 128 and is applied unscaled to other head sizes.
  bytes  the forward reads q, k, v (bf16), g (fp32), beta (bf16) and writes o (bf16):
         2*K*3 + 4*K + 2 + 2*V bytes per token-head.
  peaks  690e12 FLOP/s (bf16 8192^3 matmul through XLA on the H200) and 2.9e12 B/s (measured
         elementwise read+write), both from shared/ANCHORS.md.
Peak memory: JAX from the compiled executable's memory analysis (arguments + outputs + temporaries
- aliased); torch from max_memory_allocated during one call, plus the bytes of its arguments (which
JAX owns when shared through DLPack), so the two count the same things.

With --check (the default), before timing, o of every implementation is compared with the first
implementation that ran (relative error ||a - b|| / ||b|| in fp32), and the five gradients of pallas
vs reference, pallas vs fla and reference vs fla. Errors above 2e-2 are flagged and still timed.
With --accuracy (the default), for T <= 4096, every implementation's o and five gradients on batch
row 0 and the first two heads are compared with the float64 token recurrence (run on the host CPU,
same bf16 inputs, q and k normalised in float64): the accuracy contract is that our errors are no
larger than fla's own, recorded per quantity under case['accuracy']['within_fla'].
With --profile_dir=DIR, each JAX implementation's compiled modes are traced with jax.profiler and
every device kernel's ms per call is recorded under the mode's 'profile' (the Pallas kernels and the
XLA fusions around them: normalisation, the gate's cumsum, padding).
Failures (OOM, compile errors, ...) are recorded per case and the run goes on. The JSON file is
rewritten after every shape, so a run cut short keeps what it finished.
"""

import os

# Must precede the first import of jax: JAX then allocates on demand, and torch (fla) can share the GPU.
# JAX's allocator is still capped at XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) of the GPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import gc  # noqa: E402
import glob  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3.kda.ops import chunk_kda_reference, l2_normalize, recurrent_kda  # noqa: E402

DEFAULT_SHAPES = "8x4096x16x128,2x16384x32x128,1x65536x32x128,1x8192x96x128"
DEFAULT_IMPLS = "pallas,pallas_bf16,reference,fla"
KNOWN_IMPLS = ("pallas", "pallas_bf16", "reference", "fla", "jla")

LOWER_BOUND = -5.0
CHUNK_SIZE = 32
TUNING = {}  # `chunk_kda(tuning=...)` of the pallas impls (--tuning)
SEED = 0
TOLERANCE = 2e-2

FWD_FLOP_PER_TOKEN_HEAD = 1.71e5  # valid for K = V = 128, chunk 64 (shared/ANCHORS.md)
FWD_BWD_FLOP_PER_TOKEN_HEAD = 6.2e5
MATMUL_PEAK_FLOP_S = 690e12  # measured bf16 matmul through XLA on the H200
BANDWIDTH_PEAK_B_S = 2.9e12  # measured elementwise read+write on the H200

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta")
PROFILE_TOP = 30  # kernels kept per profiled mode
ACCURACY_MAX_T = 4096  # the float64 recurrence runs on the host CPU: rows up to this length
ACCURACY_HEADS = 2
MODES = ("fwd", "fwd_bwd")
MAX_ERROR_CHARS = 800


# ----------------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------------


class Skipped(Exception):
    """An implementation that does not apply here (e.g. fla without a CUDA GPU): recorded, not an error."""


def error_record(exc, phase):
    """A JSON-able record of an exception: phase, type, truncated text and whether it looks like an OOM."""
    text = f"{type(exc).__name__}: {exc}"
    lowered = text.lower()
    oom = any(s in lowered for s in ("resource_exhausted", "out of memory", "outofmemory", "oom"))
    return dict(phase=phase, type=type(exc).__name__, oom=oom, text=text[:MAX_ERROR_CHARS])


def summarize_ms(times_ms):
    """Median, p20 and p80 (and min, count) of a list of durations in ms."""
    t = np.asarray(times_ms, dtype=np.float64)
    p20, p50, p80 = np.percentile(t, [20, 50, 80])
    return dict(median_ms=float(p50), p20_ms=float(p20), p80_ms=float(p80), min_ms=float(t.min()), n=int(t.size))


def json_safe(x):
    """Recursively replaces non-finite floats (invalid in strict JSON) by their string spelling."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if math.isfinite(x) else str(x)
    if isinstance(x, np.integer):
        return int(x)
    return x


def parse_shapes(text):
    """'8x4096x16x128,1x128x2x32' -> [(B, T, H, K, V)] with V = K (a fifth field sets V)."""
    shapes = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        parts = [int(p) for p in item.split("x")]
        if len(parts) == 4:
            parts.append(parts[3])
        if len(parts) != 5 or min(parts) < 1:
            raise argparse.ArgumentTypeError(f"shape {item!r} is not BxTxHxK (or BxTxHxKxV) of positive ints")
        shapes.append(tuple(parts))
    if not shapes:
        raise argparse.ArgumentTypeError("no shapes given")
    return shapes


def parse_impls(text):
    impls = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in impls if s not in KNOWN_IMPLS]
    if unknown or not impls:
        raise argparse.ArgumentTypeError(f"unknown impls {unknown}; expected a list from {KNOWN_IMPLS}")
    return list(dict.fromkeys(impls))  # dedupe, keep order


def parse_tuning(text):
    """'backward=two,bk=16' -> {'backward': 'two', 'bk': 16} (every knob but backward, strip_precision,
    order and launch is an int); 'launch=keys_bwd/8/1+intra_bwd/8/1' -> {'launch': (('keys_bwd', 8, 1),
    ('intra_bwd', 8, 1))}, Triton (warps, stages) per kernel."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--tuning: expected key=value, got {item!r}")
        try:
            if key == "launch":
                out[key] = tuple((name, int(w), int(st)) for name, w, st in
                                 (entry.split("/") for entry in value.split("+")))
            else:
                out[key] = value if key in ("backward", "strip_precision", "order") else int(value)
        except ValueError:
            expected = "kernel/warps/stages joined by '+'" if key == "launch" else "an integer"
            raise argparse.ArgumentTypeError(f"--tuning: {key} must be {expected}, got {value!r}") from None
    return out


def shape_name(shape):
    B, T, H, K, V = shape
    return f"{B}x{T}x{H}x{K}" if K == V else f"{B}x{T}x{H}x{K}x{V}"


def package_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions():
    """Software and hardware versions, without importing torch (its version comes from package metadata)."""
    info = dict(
        python=sys.version.split()[0],
        platform=platform.platform(),
        jax=jax.__version__,
        jaxlib=package_version("jaxlib"),
        torch=package_version("torch"),
        triton=package_version("triton"),
        fla_core=package_version("fla-core"),
        flash_linear_attention=package_version("flash-linear-attention"),
        jax_linear_attention=package_version("jax-linear-attention"),
        flax=package_version("flax"),
        backend=jax.default_backend(),
        device_kind=jax.devices()[0].device_kind,
        n_devices=jax.device_count(),
    )
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()[:200]
    except (OSError, subprocess.SubprocessError) as exc:
        info["nvidia_smi"] = f"unavailable ({type(exc).__name__})"
    return info


# ----------------------------------------------------------------------------------------------------
# Inputs and models
# ----------------------------------------------------------------------------------------------------


def make_inputs(shape, seed=None, lower_bound=LOWER_BOUND):
    """Fixed-seed (q, k, v, g, beta) and cotangent do for one shape, as JAX arrays on the default device
    (seed None: the --seed value).

    Normal and uniform draws are made in fp32 and rounded to bf16 (as torch.randn(..., dtype=bf16) does).
    """
    B, T, H, K, V = shape
    kq, kk, kv, kg, kb, kdo = jax.random.split(jax.random.key(SEED if seed is None else seed), 6)
    bf16 = jnp.bfloat16

    @jax.jit
    def build():
        q = jax.random.normal(kq, (B, T, H, K), jnp.float32).astype(bf16)
        k = jax.random.normal(kk, (B, T, H, K), jnp.float32).astype(bf16)
        v = jax.random.normal(kv, (B, T, H, V), jnp.float32).astype(bf16)
        g = lower_bound * jax.nn.sigmoid(jax.random.normal(kg, (B, T, H, K), jnp.float32))
        g = jnp.maximum(g, lower_bound)  # log decay in [lower_bound, 0)
        beta = jax.random.uniform(kb, (B, T, H), jnp.float32).astype(bf16)
        do = jax.random.normal(kdo, (B, T, H, V), jnp.float32).astype(bf16)
        return (q, k, v, g, beta), do

    inputs, do = build()
    jax.block_until_ready((inputs, do))
    return inputs, do


def derived_metrics(shape, mode, median_ms):
    """TFLOP/s, fractions of the measured peaks, GB/s (forward only) and Mtok/s under the fixed models."""
    B, T, H, K, V = shape
    token_heads = B * T * H
    seconds = median_ms * 1e-3
    flop = (FWD_FLOP_PER_TOKEN_HEAD if mode == "fwd" else FWD_BWD_FLOP_PER_TOKEN_HEAD) * token_heads
    out = dict(
        tflops=flop / seconds / 1e12,
        frac_matmul_peak=flop / seconds / MATMUL_PEAK_FLOP_S,
        mtok_per_s=B * T / seconds / 1e6,
    )
    if mode == "fwd":
        bytes_moved = (2 * K * 3 + 4 * K + 2 + 2 * V) * token_heads
        out.update(gbytes_per_s=bytes_moved / seconds / 1e9, frac_bandwidth=bytes_moved / seconds / BANDWIDTH_PEAK_B_S)
    return out


# ----------------------------------------------------------------------------------------------------
# Implementations
# ----------------------------------------------------------------------------------------------------


class JaxImpl:
    """A JAX core (pallas or reference) wrapped as jitted fwd and fwd+bwd functions, compiled ahead of time."""

    def __init__(self, name, core, inputs, do, normalizes=False):
        """normalizes: the core L2-normalises q and k itself; else they are normalised before it."""
        self.name = name
        self.inputs = inputs
        self.do = do
        norm = (lambda x: x) if normalizes else l2_normalize

        def forward(q, k, v, g, beta):
            o, _ = core(norm(q), norm(k), v, g, beta)
            return o

        def forward_backward(q, k, v, g, beta, do):
            # o is returned too, so no part of the forward can be dropped as dead code.
            o, pullback = jax.vjp(forward, q, k, v, g, beta)
            return o, pullback(do)

        self.functions = dict(fwd=(forward, tuple(inputs)), fwd_bwd=(forward_backward, (*inputs, do)))
        self.compiled = {}

    def build(self, mode):
        """Compiles one mode; returns compile timings and the memory analysis."""
        fn, args = self.functions[mode]
        t0 = time.perf_counter()
        lowered = jax.jit(fn).lower(*args)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        t3 = time.perf_counter()
        self.compiled[mode] = compiled
        rec = dict(lower_s=t1 - t0, compile_s=t2 - t1, first_call_s=t3 - t2)
        rec.update(jax_memory(compiled))
        return rec

    def outputs(self, mode):
        """fwd: o; fwd_bwd: (o, (dq, dk, dv, dg, dbeta)) as JAX arrays."""
        _, args = self.functions[mode]
        return jax.block_until_ready(self.compiled[mode](*args))

    def time(self, mode, warmup, iters):
        _, args = self.functions[mode]
        stats = summarize_ms(pipelined_ms(self.compiled[mode], args, warmup, iters))
        stats.update(timer="pipelined", per_call=summarize_ms(wall_times_ms(self.compiled[mode], args, 0, iters)))
        return stats

    def release(self):
        self.compiled.clear()


def profile_kernels(impl, mode, trace_dir, calls=5):
    """Device time per call of each kernel (the Pallas kernels and the XLA fusions around them) of one
    compiled mode of a JAX implementation, from a jax.profiler trace of `calls` calls:
    {'total_ms': float, 'kernels': [[name, ms per call, calls per call], ...] largest first}."""
    from experiments.profile_step import parse_trace

    _, args = impl.functions[mode]
    run = impl.compiled[mode]
    jax.block_until_ready(run(*args))
    where = os.path.join(trace_dir, f"{impl.name}_{mode}")
    with jax.profiler.trace(where, create_perfetto_trace=True):
        for _ in range(calls):
            out = run(*args)
        jax.block_until_ready(out)
    traces = sorted(glob.glob(os.path.join(where, "**", "perfetto_trace.json.gz"), recursive=True),
                    key=os.path.getmtime)
    if not traces:
        raise RuntimeError(f"no perfetto_trace.json.gz under {where}")
    res = parse_trace(traces[-1], calls)
    kernels = sorted(((name, v[0], res["calls"][name]) for name, v in res["kernels"].items()), key=lambda r: -r[1])
    return dict(total_ms=res["total_ms"], kernels=[list(r) for r in kernels[:PROFILE_TOP]])


def pipelined_ms(run, args, warmup, iters, rounds=5):
    """Per-call ms of run(*args) in each of `rounds` rounds of `iters` calls dispatched back to back and
    waited for once (the host keeps the device's queue full), after `warmup` untimed calls."""
    for _ in range(warmup):
        jax.block_until_ready(run(*args))
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = run(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t0) * 1e3 / iters)
    return per_call


def wall_times_ms(run, args, warmup, iters):
    """Wall-clock ms of `iters` calls of run(*args), each waited for, after `warmup` untimed calls."""
    for _ in range(warmup):
        jax.block_until_ready(run(*args))
    times_ms = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        times_ms.append((time.perf_counter() - t0) * 1e3)
    return times_ms


def jax_memory(compiled):
    """Peak-memory estimate of a compiled executable: arguments + outputs + temporaries - aliased bytes."""
    try:
        ma = compiled.memory_analysis()
    except Exception as exc:  # not every backend implements it
        return dict(memory_error=f"{type(exc).__name__}: {exc}"[:200])
    if ma is None:
        return dict(memory_error="memory_analysis() returned None")
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
              "generated_code_size_in_bytes")
    mem = {f: int(getattr(ma, f, 0) or 0) for f in fields}
    peak = (mem["argument_size_in_bytes"] + mem["output_size_in_bytes"] + mem["temp_size_in_bytes"]
            - mem["alias_size_in_bytes"])
    return dict(peak_bytes=peak, memory=mem)


class FlaImpl:
    """fla's Triton chunk_kda on the same inputs, shared with JAX through DLPack (numpy copy as fallback)."""

    def __init__(self, inputs, do, lower_bound=LOWER_BOUND):
        import torch  # lazy: only when fla is asked for
        import torch.utils.dlpack
        import triton.testing
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        self.torch = torch
        self.do_bench = triton.testing.do_bench
        self.transfer = "dlpack"
        self.inputs = [self.to_torch(x) for x in inputs]
        self.do = self.to_torch(do)
        self.kwargs = dict(use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=lower_bound)
        self.chunk_kda = fla_chunk_kda
        self.leaves = None  # requires-grad copies of the inputs for fwd_bwd
        self.arg_bytes = sum(t.numel() * t.element_size() for t in self.inputs)

    def to_torch(self, x):
        torch = self.torch
        try:
            return torch.utils.dlpack.from_dlpack(x)
        except Exception:
            self.transfer = "numpy"
            host = np.asarray(x)
            if host.dtype == jnp.bfloat16:  # numpy has no bf16: move the bits
                return torch.from_numpy(host.view(np.uint16).copy()).view(torch.bfloat16).cuda()
            return torch.from_numpy(host.copy()).cuda()

    @staticmethod
    def to_jax(t):
        t = t.detach()
        try:
            return jax.dlpack.from_dlpack(t)
        except Exception:
            return jnp.asarray(t.float().cpu().numpy()).astype(str(t.dtype).replace("torch.", ""))

    def _fwd(self):
        return self.chunk_kda(*self.inputs, **self.kwargs)[0]

    def _fwd_bwd(self):
        o, _ = self.chunk_kda(*self.leaves, **self.kwargs)
        o.backward(self.do)
        return o

    def _call(self, mode):
        return self._fwd() if mode == "fwd" else self._fwd_bwd()

    def _zero_grads(self):
        for t in self.leaves:
            t.grad = None

    def build(self, mode):
        """First call (Triton compile and autotune), then one measured call for the peak memory."""
        torch = self.torch
        if mode == "fwd_bwd" and self.leaves is None:
            self.leaves = [t.detach().clone().requires_grad_(True) for t in self.inputs]
        arg_bytes = self.arg_bytes + (self.do.numel() * self.do.element_size() if mode == "fwd_bwd" else 0)
        t0 = time.perf_counter()
        out = self._call(mode)
        torch.cuda.synchronize()
        first_call_s = time.perf_counter() - t0
        del out
        if mode == "fwd_bwd":
            self._zero_grads()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = self._call(mode)
        torch.cuda.synchronize()
        peak_alloc = torch.cuda.max_memory_allocated() - base
        del out
        if mode == "fwd_bwd":
            self._zero_grads()
        return dict(first_call_s=first_call_s, peak_bytes=int(peak_alloc + arg_bytes),
                    memory=dict(torch_peak_allocated_bytes=int(peak_alloc), argument_bytes=int(arg_bytes)))

    def outputs(self, mode):
        if mode == "fwd":
            o = self._fwd()
            self.torch.cuda.synchronize()
            return self.to_jax(o)
        self._zero_grads()
        o = self._fwd_bwd()
        self.torch.cuda.synchronize()
        grads = tuple(self.to_jax(t.grad) for t in self.leaves)
        self._zero_grads()
        return self.to_jax(o), grads

    def time(self, mode, warmup, iters):
        """do_bench's median (and p20, p80); warmup/iters are not used: do_bench picks its own repeat counts."""
        del warmup, iters
        fn = self._fwd if mode == "fwd" else self._fwd_bwd
        kw = dict(warmup=50, rep=300, return_mode="median")
        if mode == "fwd_bwd":
            kw["grad_to_none"] = self.leaves
        try:
            res = self.do_bench(fn, quantiles=[0.5, 0.2, 0.8], **kw)
        except TypeError:  # a do_bench without quantiles: the median alone
            res = self.do_bench(fn, **kw)
        if mode == "fwd_bwd":
            self._zero_grads()
        if isinstance(res, (int, float)):
            return dict(median_ms=float(res), p20_ms=None, p80_ms=None, timer="triton.testing.do_bench")
        med, p20, p80 = (float(x) for x in res)
        return dict(median_ms=med, p20_ms=p20, p80_ms=p80, timer="triton.testing.do_bench")

    def release(self):
        self.inputs = self.do = self.leaves = None
        gc.collect()
        self.torch.cuda.empty_cache()


def make_impl(name, inputs, do, interpret):
    """Builds one implementation; raises if it cannot be imported or set up (the caller records that)."""
    if name == "reference":
        core = lambda q, k, v, g, beta: chunk_kda_reference(q, k, v, g, beta, chunk_size=CHUNK_SIZE)  # noqa: E731
        return JaxImpl(name, core, inputs, do)
    if name in ("pallas", "pallas_bf16"):
        from pallas_kernels.kda import chunk_kda

        matmul_dtype = "bfloat16" if name == "pallas_bf16" else "float32"

        def core(q, k, v, g, beta):
            return chunk_kda(q, k, v, g, beta, chunk_size=CHUNK_SIZE, lower_bound=LOWER_BOUND,
                             interpret=interpret, matmul_dtype=matmul_dtype, tuning=TUNING or None,
                             qk_l2norm=True)

        return JaxImpl(name, core, inputs, do, normalizes=True)
    if name == "fla":
        if jax.default_backend() != "gpu":
            raise Skipped(f"fla needs a CUDA GPU (JAX backend is {jax.default_backend()})")
        return FlaImpl(inputs, do)
    if name == "jla":
        if jax.default_backend() != "gpu":
            raise Skipped(f"jla needs a Hopper GPU (JAX backend is {jax.default_backend()})")
        from k3.kda.ops import kda_core

        return JaxImpl(name, lambda q, k, v, g, beta: kda_core(q, k, v, g, beta, impl="jla"), inputs, do)
    raise ValueError(name)


# ----------------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------------


@jax.jit
def _rel_err(a, b):
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    num = jnp.linalg.norm(a - b)
    den = jnp.linalg.norm(b)
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.where(num > 0, jnp.inf, 0.0))


def rel_err(a, b):
    """||a - b|| / ||b|| computed in fp32 on the device."""
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {a.shape} vs {b.shape}")
    return float(_rel_err(a, b))


def run_checks(impls, case):
    """Compares o (and the gradients of pallas, reference, fla) before timing; records into case['check']."""
    check = dict(tolerance=TOLERANCE, o_rel_err={}, grad_rel_err={}, flags=[])
    case["check"] = check
    outs, grads = {}, {}
    for name, impl in impls.items():
        rec = case["impls"][name]
        for mode in MODES:
            if mode not in impl_ok_modes(rec):
                continue
            try:
                res = impl.outputs(mode)
                if mode == "fwd":
                    outs[name] = res
                else:
                    grads[name] = res[1]
                    outs.setdefault(name, res[0])
            except Exception as exc:
                rec[mode]["error"] = error_record(exc, "check")
    if not outs:
        return
    base = next(iter(outs))
    check["o_base"] = base
    for name, o in outs.items():
        try:
            err = rel_err(o, outs[base])
        except Exception as exc:
            check["o_rel_err"][name] = error_record(exc, "check")["text"]
            continue
        check["o_rel_err"][name] = err
        case["impls"][name]["o_rel_err"] = err
        if not err <= TOLERANCE:
            case["impls"][name]["flagged"] = True
            check["flags"].append(f"{name}: o rel err {err:.3g} vs {base} > {TOLERANCE}")
    for a, b in (("pallas", "reference"), ("pallas", "fla"), ("pallas_bf16", "fla"), ("reference", "fla"),
                 ("jla", "fla"), ("pallas_bf16", "jla")):
        if a in grads and b in grads:
            pair = {}
            for gname, ga, gb in zip(GRAD_NAMES, grads[a], grads[b]):
                try:
                    pair[gname] = rel_err(ga, gb)
                except Exception as exc:
                    pair[gname] = error_record(exc, "check")["text"]
                    continue
                if not pair[gname] <= TOLERANCE:
                    check["flags"].append(f"{a} vs {b}: {gname} rel err {pair[gname]:.3g} > {TOLERANCE}")
            check["grad_rel_err"][f"{a}_vs_{b}"] = pair
    del outs, grads


def float64_reference(inputs, do, heads):
    """o and the five gradients of the float64 token recurrence (`k3.kda.ops.recurrent_kda`, on the CPU)
    for batch row 0 and the first `heads` heads of the bf16 inputs, as float64 numpy arrays."""
    cpu = jax.devices("cpu")[0]
    host = [np.asarray(x[:1, :, :heads].astype(jnp.float32), np.float64) for x in (*inputs, do)]
    with jax.enable_x64(True), jax.default_device(cpu):
        q, k, v, g, beta, cot = (jnp.asarray(x) for x in host)

        def forward(q, k, v, g, beta):
            o, _ = recurrent_kda(l2_normalize(q), l2_normalize(k), v, g, beta)
            return o

        o, pullback = jax.vjp(forward, q, k, v, g, beta)
        grads = pullback(cot)
        return np.asarray(o), tuple(np.asarray(x) for x in grads)


def run_accuracy(impls, case, inputs, do, heads):
    """Relative error (float64 norms) of every implementation's o and gradients against the float64
    recurrence on batch row 0, heads [0, heads); records case['accuracy'] and whether each of ours
    is within fla's own error (the accuracy contract)."""
    ref_o, ref_grads = float64_reference(inputs, do, heads)
    acc = dict(rows="batch 0", heads=heads, rel_err={})
    case["accuracy"] = acc
    for name, impl in impls.items():
        if "fwd_bwd" not in impl_ok_modes(case["impls"][name]):
            continue
        o, grads = impl.outputs("fwd_bwd")
        errs = {}
        for label, out, ref in zip(("o", *GRAD_NAMES), (o, *grads), (ref_o, *ref_grads)):
            out = np.asarray(out[:1, :, :heads].astype(jnp.float32), np.float64)
            errs[label] = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300))
        acc["rel_err"][name] = errs
        print(f"  error vs float64 recurrence, {name}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()),
              flush=True)
    fla = acc["rel_err"].get("fla")
    if fla:
        for name, errs in acc["rel_err"].items():
            if name != "fla":
                acc.setdefault("within_fla", {})[name] = {k: errs[k] <= fla[k] for k in errs}


def impl_ok_modes(rec):
    """Modes of an implementation's record that built without error."""
    return [m for m in MODES if isinstance(rec.get(m), dict) and "error" not in rec[m]]


# ----------------------------------------------------------------------------------------------------
# One shape
# ----------------------------------------------------------------------------------------------------


def run_case(shape, impl_names, args, interpret):
    """Builds, checks and times every implementation on one shape; returns the case record."""
    B, T, H, K, V = shape
    case = dict(shape=shape_name(shape), B=B, T=T, H=H, K=K, V=V, token_heads=B * T * H, impls={})
    if (K, V) != (128, 128):
        case["note"] = "FLOP model is for K = V = 128; TFLOP/s here apply it unscaled"
    print(f"\n=== {case['shape']} (B={B}, T={T}, H={H}, K={K}, V={V}) ===", flush=True)
    try:
        inputs, do = make_inputs(shape)
    except Exception as exc:
        case["error"] = error_record(exc, "inputs")
        print(f"  inputs failed: {case['error']['text']}", flush=True)
        return case

    impls = {}
    for name in impl_names:
        rec = case["impls"].setdefault(name, {})
        try:
            impls[name] = make_impl(name, inputs, do, interpret)
        except Skipped as why:
            rec["skipped"] = str(why)
            print(f"  {name}: skipped: {why}", flush=True)
            continue
        except Exception as exc:
            rec["error"] = error_record(exc, "setup")
            print(f"  {name}: setup failed: {rec['error']['text'][:300]}", flush=True)
            continue
        for mode in MODES:
            try:
                rec[mode] = impls[name].build(mode)
                print(f"  {name} {mode}: built in {rec[mode].get('compile_s', rec[mode]['first_call_s']):.2f}s"
                      f", peak {rec[mode].get('peak_bytes', 0) / 2**30:.2f} GiB", flush=True)
            except Exception as exc:
                rec[mode] = dict(error=error_record(exc, "build"))
                print(f"  {name} {mode}: build failed: {rec[mode]['error']['text'][:300]}", flush=True)

    if args.check:
        try:
            run_checks(impls, case)
            for flag in case["check"]["flags"]:
                print(f"  CHECK FLAG: {flag}", flush=True)
            print(f"  o rel err vs {case['check'].get('o_base')}: {case['check']['o_rel_err']}", flush=True)
            for pair, errs in case["check"]["grad_rel_err"].items():
                print(f"  grad rel err {pair}: {errs}", flush=True)
        except Exception as exc:
            case["check_error"] = error_record(exc, "check")
            print(f"  check failed: {case['check_error']['text'][:300]}", flush=True)

    if args.accuracy and T <= ACCURACY_MAX_T:
        try:
            run_accuracy(impls, case, inputs, do, min(H, ACCURACY_HEADS))
        except Exception as exc:
            case["accuracy_error"] = error_record(exc, "accuracy")
            print(f"  accuracy failed: {case['accuracy_error']['text'][:300]}", flush=True)

    for name, impl in impls.items():
        rec = case["impls"][name]
        for mode in impl_ok_modes(rec):
            try:
                stats = impl.time(mode, args.warmup, args.iters)
                stats.update(derived_metrics(shape, mode, stats["median_ms"]))
                rec[mode].update(stats)
                print(f"  {name} {mode}: {stats['median_ms']:.3f} ms (p20 {fmt(stats['p20_ms'])}, "
                      f"p80 {fmt(stats['p80_ms'])}), {stats['tflops']:.1f} TFLOP/s", flush=True)
            except Exception as exc:
                rec[mode]["error"] = error_record(exc, "time")
                print(f"  {name} {mode}: timing failed: {rec[mode]['error']['text'][:300]}", flush=True)

    if args.profile_dir:
        for name, impl in impls.items():
            if not isinstance(impl, JaxImpl):
                continue
            for mode in impl_ok_modes(case["impls"][name]):
                rec = case["impls"][name][mode]
                try:
                    rec["profile"] = profile_kernels(impl, mode, args.profile_dir)
                    print(f"  {name} {mode}: device {rec['profile']['total_ms']:.3f} ms per call; " + ", ".join(
                        f"{k} {ms:.3f}" for k, ms, _ in rec["profile"]["kernels"][:12]), flush=True)
                except Exception as exc:
                    rec["profile_error"] = error_record(exc, "profile")
                    print(f"  {name} {mode}: profile failed: {rec['profile_error']['text'][:300]}", flush=True)

    fla_ms = case["impls"].get("fla", {}).get("fwd_bwd", {}).get("median_ms")
    for name in ("pallas", "pallas_bf16", "reference", "jla"):
        ours_ms = case["impls"].get(name, {}).get("fwd_bwd", {}).get("median_ms")
        if fla_ms and ours_ms:
            case["impls"][name]["fla_over_ours_fwd_bwd"] = fla_ms / ours_ms
            fla_fwd = case["impls"]["fla"].get("fwd", {}).get("median_ms")
            ours_fwd = case["impls"][name].get("fwd", {}).get("median_ms")
            if fla_fwd and ours_fwd:
                case["impls"][name]["fla_over_ours_fwd"] = fla_fwd / ours_fwd

    for impl in impls.values():
        impl.release()
    del impls, inputs, do
    gc.collect()
    return case


# ----------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def markdown_table(cases):
    """One row per (shape, implementation)."""
    lines = [
        "| shape | impl | fwd ms | fwd+bwd ms | TFLOP/s fwd+bwd | frac of matmul peak | peak GiB | fla/ours fwd+bwd | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        star = "" if (case["K"], case["V"]) == (128, 128) else "*"
        if "error" in case:
            lines.append(f"| {case['shape']} | - | - | - | - | - | - | - | {case['error']['text'][:80]} |")
            continue
        for name, rec in case["impls"].items():
            fwd, fb = rec.get("fwd", {}), rec.get("fwd_bwd", {})
            notes = [f"skipped: {rec['skipped']}"] if "skipped" in rec else []
            if rec.get("flagged"):
                notes.append(f"FLAG o err {rec['o_rel_err']:.2g}")
            elif rec.get("o_rel_err") is not None and name != case.get("check", {}).get("o_base"):
                notes.append(f"o err {rec['o_rel_err']:.1e}")
            for where in (rec, fwd, fb):
                err = where.get("error")
                if err:
                    notes.append(("OOM " if err["oom"] else "") + err["text"][:80].replace("|", "/").replace("\n", " "))
            peak = fb.get("peak_bytes", fwd.get("peak_bytes"))
            tflops = fb.get("tflops")
            frac = fb.get("frac_matmul_peak")
            ratio = rec.get("fla_over_ours_fwd_bwd")
            lines.append(
                f"| {case['shape']} | {name} | {fmt(fwd.get('median_ms'))} | {fmt(fb.get('median_ms'))} | "
                f"{fmt(tflops, '.1f')}{star if tflops is not None else ''} | {fmt(frac, '.3f')} | "
                f"{fmt(None if peak is None else peak / 2**30, '.2f')} | {fmt(ratio, '.2f')} | {'; '.join(notes)} |"
            )
    lines.append("")
    lines.append("TFLOP/s use the K=V=128 model (6.2e5 FLOP/token-head fwd+bwd); '*' marks other head sizes. "
                 "fla/ours > 1 means ours is faster. JAX times: calls queued back to back (per-call mean, median of 5 "
                 "rounds); fla's: do_bench medians.")
    return "\n".join(lines)


def write_json(path, report):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(json_safe(report), f, indent=1)
    os.replace(tmp, path)


def default_out():
    out_dir = os.environ.get("OUT")
    return os.path.join(out_dir, "bench_kda.json") if out_dir else "bench_kda.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES),
                   help=f"comma-separated BxTxHxK (K = V), default {DEFAULT_SHAPES}")
    p.add_argument("--impls", type=parse_impls, default=parse_impls(DEFAULT_IMPLS),
                   help=f"comma-separated from {KNOWN_IMPLS}; outputs are checked against the first that runs")
    p.add_argument("--out", default=None, help="JSON file (default $OUT/bench_kda.json, else ./bench_kda.json)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before timing (JAX impls)")
    p.add_argument("--iters", type=int, default=20, help="timed calls (JAX impls)")
    p.add_argument("--chunk-size", type=int, default=CHUNK_SIZE, choices=(16, 32, 64),
                   help="chunk of the pallas and reference implementations (default 64)")
    p.add_argument("--accuracy", action=argparse.BooleanOptionalAction, default=True,
                   help=f"errors of every implementation (o and gradients) against the float64 token "
                        f"recurrence on batch row 0, {ACCURACY_HEADS} heads, for T <= {ACCURACY_MAX_T}")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare outputs and gradients before timing (default on)")
    p.add_argument("--profile_dir", default="",
                   help="trace each JAX implementation's compiled modes here and record every kernel's "
                        "device ms per call (Pallas kernels and the XLA fusions around them)")
    p.add_argument("--seed", type=int, default=SEED, help="seed of the inputs and the cotangent")
    p.add_argument("--tuning", type=parse_tuning, default={},
                   help="knobs of the pallas impls, e.g. backward=two,bk=16,bp=16,bv=32 or "
                        "launch=keys_bwd/8/1+intra_bwd/8/1 (chunk_kda's tuning)")
    args = p.parse_args(argv)
    if args.warmup < 0 or args.iters < 1:
        p.error("--warmup must be >= 0 and --iters >= 1")
    args.out = args.out or default_out()
    return args


def main(argv=None):
    args = parse_args(argv)
    global CHUNK_SIZE, TUNING, SEED
    CHUNK_SIZE, TUNING, SEED = args.chunk_size, args.tuning, args.seed
    interpret = jax.default_backend() == "cpu"  # the Pallas kernel runs interpreted on CPU only
    report = dict(
        versions=versions(),
        config=dict(
            shapes=[shape_name(s) for s in args.shapes], impls=args.impls, warmup=args.warmup, iters=args.iters,
            check=args.check, tolerance=TOLERANCE, seed=SEED, chunk_size=CHUNK_SIZE, lower_bound=LOWER_BOUND,
            pallas_interpret=interpret, pallas_tuning=TUNING,
            fwd_flop_per_token_head=FWD_FLOP_PER_TOKEN_HEAD, fwd_bwd_flop_per_token_head=FWD_BWD_FLOP_PER_TOKEN_HEAD,
            matmul_peak_flop_s=MATMUL_PEAK_FLOP_S, bandwidth_peak_b_s=BANDWIDTH_PEAK_B_S,
            fwd_bytes_per_token_head="2*K*3 + 4*K + 2 + 2*V",
            notes=[
                "FLOP model valid for K = V = 128 (chunk 64); applied unscaled to other head sizes.",
                "JAX: per-call mean of --iters calls queued back to back and waited for once (median of 5 "
                "rounds); single waited calls under 'per_call'. fla: triton do_bench (CUDA events around "
                "queued calls, L2 flushed).",
                "pallas: chunk_kda(qk_l2norm=True) normalises q, k in its own kernels; reference: "
                "l2_normalize(q), l2_normalize(k) under the timer; fla normalises in the kernel.",
                "fwd_bwd returns o and all five gradients.",
            ],
        ),
        cases=[],
    )
    print(json.dumps(report["versions"]), flush=True)
    for shape in args.shapes:
        try:
            case = run_case(shape, args.impls, args, interpret)
        except Exception as exc:  # anything unforeseen: record and go on with the next shape
            case = dict(shape=shape_name(shape), K=shape[3], V=shape[4], impls={},
                        error=error_record(exc, "case"), traceback=traceback.format_exc()[-2000:])
        report["cases"].append(case)
        write_json(args.out, report)
        jax.clear_caches()
    print("\n" + markdown_table(report["cases"]), flush=True)
    print(f"\nwrote {args.out}", flush=True)
    return report


if __name__ == "__main__":
    main()
