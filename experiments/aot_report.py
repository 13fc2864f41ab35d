"""Compile the train step for a GPU that is not attached, and read what XLA made of it.

    python -m experiments.aot_report [--models=k2:1024:12,k3:1024:12] [--target=h200] [--seq_len=4096]
        [--batches=8] [--remat] [--set KEY=VALUE ...] [--top=12] [--json=FILE] [--hlo_dir=DIR]
    python -m experiments.aot_report --decode --models=k3:1024:16,all_mla:1024:16 --contexts=4096,32768 --batches=8
    python -m experiments.aot_report --analyse=FILE.hlo      # a module saved by --hlo_dir, read again
    python -m experiments.aot_report --registers --models=k3:1024:12 --remat ...   # each Pallas kernel's registers
    python -m experiments.aot_report --ladder=experiments/configs/ladder_1e16.py --arms=k2,k3 --jobs=main,sweep
        [--population=4]                                   # the step of 4 runs of a shape at once

XLA's GPU compiler runs here, on the CPU, for the target's device description (a compile-only device
from `jax.experimental.topologies`; `TARGETS` holds the descriptions). Each model and batch size (and
with --decode, each context: one greedy step of `experiments.bench_decode`'s served model) gets:

- memory: XLA's buffer assignment for the step (arguments + outputs + temporaries - donated), the
  figure that decides an out-of-memory error, against the target's memory;
- kernels: what one step launches (fusions, custom calls, copies...; a loop body counts once per
  trip), so launch overhead can be estimated before a GPU is at hand;
- floors: per `experiments.profile_step` category, the bytes every kernel must move (its operands
  and results, once; an operand that a fusion only slices or gathers from, what it takes) and the
  FLOPs of its matmuls; a kernel cannot take less than
  max(bytes / HBM bandwidth, FLOPs / peak), and the table sums those per category. A measured
  profile divided by these floors says where a step is furthest from the hardware.

What it cannot know: kernels are not timed (no autotuning either, so XLA's GEMM choices can differ from
a run on the device, and a sort falls back to a slower algorithm); Pallas kernels are opaque calls
whose bytes are their operands and results (a kernel that reads part of an operand, like
`pallas_kernels.moe_decode`'s routed experts, is charged the whole of it). The step's Pallas kernels
and backends are those of a GPU (`k3.backends.targeting('gpu')`, `K3_PALLAS_INTERPRET=0`).

Requirements: the CUDA plugin of jaxlib's version, kept outside the project's environment (see
`pallas_kernels.compile_report`): `PYTHONPATH=/tmp/k3-triton python -m experiments.aot_report ...`.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import re
import time

import contextlib

import jax
import jax.numpy as jnp

from experiments.bench_train_step import apply_sets, build_config, synthetic_batch
from experiments.profile_step import _CALLS, _OP_NAME, CATEGORIES, _instructions, _shapes_bytes, categorize

# Device descriptions (datasheet and driver-reported figures) of the GPUs a step can be compiled for.
TARGETS = {
    "h200": dict(name="NVIDIA H200", compute_capability=(9, 0), core_count=132, memory_bytes=151_397_597_184,
                 hbm_bytes_per_s=4.8e12, peak_bf16_flops=989e12, l2_bytes=52_428_800, clock_ghz=1.98,
                 shared_memory_per_block=49_152, shared_memory_per_core=233_472,
                 shared_memory_per_block_optin=232_448),
    "h100": dict(name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), core_count=132,
                 memory_bytes=85_520_809_984, hbm_bytes_per_s=3.35e12, peak_bf16_flops=989e12,
                 l2_bytes=52_428_800, clock_ghz=1.98, shared_memory_per_block=49_152,
                 shared_memory_per_core=233_472, shared_memory_per_block_optin=232_448),
}


def target_config_text(t: dict) -> str:
    """The target as XLA's GpuTargetConfigProto in text form."""
    major, minor = t["compute_capability"]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: {t['shared_memory_per_block']}
  shared_memory_per_core: {t['shared_memory_per_core']}
  threads_per_core_limit: 2048
  core_count: {t['core_count']}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(t['hbm_bytes_per_s'])}
  l2_cache_size: {t['l2_bytes']}
  clock_rate_ghz: {t['clock_ghz']}
  device_memory_size: {t['memory_bytes']}
  shared_memory_per_block_optin: {t['shared_memory_per_block_optin']}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{t['name']}"
"""


@contextlib.contextmanager
def _for_gpu():
    """Trace for a GPU: 'auto' backends resolve as on a GPU and Pallas kernels lower (not interpreted)."""
    from k3 import backends

    before = os.environ.get("K3_PALLAS_INTERPRET")
    os.environ["K3_PALLAS_INTERPRET"] = "0"
    try:
        with backends.targeting("gpu"):
            yield
    finally:
        if before is None:
            os.environ.pop("K3_PALLAS_INTERPRET")
        else:
            os.environ["K3_PALLAS_INTERPRET"] = before


def compile_only_device(target: str):
    """A device of the target GPU that XLA compiles for but nothing runs on."""
    from jax.experimental import topologies

    if target not in TARGETS:
        raise SystemExit(f"aot_report: unknown --target {target!r}; expected one of {sorted(TARGETS)}")
    try:
        topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                            target_config=target_config_text(TARGETS[target]))
    except Exception as err:  # noqa: BLE001 - any failure here means the compiler is missing
        import jaxlib

        raise SystemExit(
            f"aot_report: cannot make a compile-only CUDA device ({str(err).splitlines()[0][:200]}). Install "
            f"the CUDA plugin of jaxlib's version next to the project: `pip install --target /tmp/k3-triton "
            f"jax-cuda12-plugin=={jaxlib.__version__}` and run with PYTHONPATH=/tmp/k3-triton") from err
    return topo.devices[0]


def abstract_train_step(cfg, where=None, population: int = 1):
    """(train step traced for a GPU, abstract state, abstract batch) of `k3.steps.make_run` for
    ``cfg``; nothing is allocated. ``where``: a sharding to place the abstract arrays on.
    population > 1: the step of that many runs in one program, as `experiments.run_ladder` trains a
    sweep (the state stacked on a leading axis, the step vmapped over it, the batch shared)."""
    from k3.steps import make_run

    held = {}

    def build():
        run, state = make_run(cfg)
        held["run"] = run
        return state

    put = lambda s, lead=(): jax.ShapeDtypeStruct(lead + s.shape, s.dtype, sharding=where)  # noqa: E731
    members = (population,) if population > 1 else ()
    with _for_gpu():
        state = jax.tree.map(lambda s: put(s, members), jax.eval_shape(build))
    batch = {k: put(v) for k, v in synthetic_batch(cfg).items()}

    def step(state, batch):
        with _for_gpu():
            if population > 1:
                return jax.vmap(held["run"].step_fn, in_axes=(0, None))(state, batch)
            return held["run"].train_step(state, batch)

    return step, state, batch


def compile_step(cfg, device, population: int = 1):
    """(compiled train step, seconds): `abstract_train_step` placed on ``device`` and compiled."""
    from jax.sharding import SingleDeviceSharding

    t0 = time.perf_counter()
    step, state, batch = abstract_train_step(cfg, SingleDeviceSharding(device), population)
    compiled = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
    return compiled, time.perf_counter() - t0


def compile_decode_step(spec: str, context: int, batch: int, device, mla_decode: str = "auto",
                        moe_decode: str = "auto", kda_decode: str = "auto", sets=()):
    """(compiled step, seconds, rows): one greedy decode step of `experiments.bench_decode`'s served model
    (bf16 weights, served layout `k3.model.served`, a cache holding ``context`` tokens), abstract and on ``device``,
    for ``batch`` sequences in `k3.decode.decode_rows` rows, as a GPU decodes them; ``sets``: 'model.KEY=VALUE'
    settings applied to its config."""
    from jax.sharding import SingleDeviceSharding
    from flax import nnx

    from experiments.bench_decode import capacity, model_config
    from k3 import decode
    from k3.model import Model, served

    kind, d, layers = spec.split(":")
    where = SingleDeviceSharding(device)
    put = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where)  # noqa: E731
    t0 = time.perf_counter()
    with _for_gpu():
        cfg = model_config(kind, int(d), int(layers), "bfloat16", mla_decode, moe_decode, kda_decode, sets)
        model = nnx.eval_shape(lambda: served(Model(cfg, rngs=nnx.Rngs(0))))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params = jax.tree.map(lambda x: put(jax.ShapeDtypeStruct(
            x.shape, jnp.bfloat16 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype)), params)
        rest = jax.tree.map(put, rest)
        rows = decode.decode_rows(batch)
        cache = jax.tree.map(put, jax.eval_shape(lambda: decode.init_cache(
            nnx.merge(graphdef, params, rest), rows, capacity(context))))

        def step(params, rest, cache, tok):
            logits, cache = decode.extend(nnx.merge(graphdef, params, rest), tok[:, None], cache)
            return cache, jnp.argmax(logits[:, 0], -1).astype(jnp.int32)

        tok = put(jax.ShapeDtypeStruct((rows,), jnp.int32))
        compiled = jax.jit(step, donate_argnums=2).lower(params, rest, cache, tok).compile()
    return compiled, time.perf_counter() - t0, rows


def memory_gib(compiled) -> dict:
    """XLA's buffer assignment of a compiled step, GiB: arguments, outputs, temporaries, donated, total."""
    m = compiled.memory_analysis()
    gib = 2.0 ** 30
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return dict(arguments=m.argument_size_in_bytes / gib, outputs=m.output_size_in_bytes / gib,
                temporaries=m.temp_size_in_bytes / gib, donated=m.alias_size_in_bytes / gib, total=total / gib)


# Instructions that launch nothing: views, tuples, control flow (whose bodies are walked instead).
_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
              "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id", "copy-done",
              "send-done", "recv-done", "all-reduce-done", "all-gather-done", "collective-permute-done"}
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRITON_NAME = re.compile(r'__gpu\$xla\.gpu\.triton".*?name = "([\w.\-]+)"')
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_CONTRACT_CFG = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def _parse(line: str) -> tuple[str, str, str, list[tuple[str, str]]]:
    """(name, result type, opcode, operands as (name, tuple index or '')) of one HLO instruction line."""
    lhs, rhs = line.split("=", 1)
    name = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)", lhs).group(1)
    rhs = rhs.lstrip()
    if rhs.startswith("("):  # a tuple type: no parentheses inside it
        close = rhs.index(")") + 1
        rtype, rest = rhs[:close], rhs[close:]
    else:
        rtype, _, rest = rhs.partition(" ")
    m = re.match(r"\s*([a-z][\w\-]*)\(", rest)
    if not m:
        return name, rtype, "", []
    depth, start = 0, m.end() - 1
    for i in range(start, len(rest)):
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        if depth == 0:
            return name, rtype, m.group(1), re.findall(r"%([\w.\-]+)(?:#(\d+))?", rest[start:i])
    return name, rtype, m.group(1), []


def _dot_flops(line: str, shapes: dict) -> float:
    """2 x output elements x contracted size of a dot (or a cuBLAS GEMM custom call) on one line."""
    _, rtype, _, ops = _parse(line)
    out, _ = _shapes_bytes(rtype)
    contract = _CONTRACT.search(line) or _CONTRACT_CFG.search(line)
    if not out or not ops or not contract:
        return 0.0
    lhs = shapes.get(ops[0][0], ([], 0))[0]
    if not lhs:
        return 0.0
    lhs_dims = [int(d) for d in re.findall(r"\[([\d,]*)\]", lhs[0])[0].split(",") if d]
    k = 1
    for d in re.findall(r"\d+", contract.group(1)):
        k *= lhs_dims[int(d)]
    n_out = 1
    for d in filter(None, re.findall(r"\[([\d,]*)\]", out[0])[0].split(",")):
        n_out *= int(d)
    return 2.0 * n_out * k


def kernel_floors(hlo_text: str, *, hbm_bytes_per_s: float, peak_flops: float) -> dict:
    """Every kernel one execution of the compiled module launches, with its floor.

    Returns {'kernels': [{name, instr, category, calls, bytes, flops, floor_ms}] (per call figures, calls =
    launches per step), 'categories': {category: {kernels, bytes, flops, floor_ms}} (per step), 'launches',
    'unknown_trip_loops'}. Loop bodies count known_trip_count times (once if XLA does not know it)."""
    comps = collections.defaultdict(list)
    for comp, _, line in _instructions(hlo_text):
        comps[comp].append(line)
    entry = next((m.group(1) for m in map(re.compile(r"ENTRY\s+%?([\w.\-]+)").match, hlo_text.splitlines()) if m),
                 None)
    if entry is None:
        raise ValueError("aot_report: the HLO text has no ENTRY computation")
    shapes = {}
    for lines in comps.values():
        for line in lines:
            name, rtype, _, _ = _parse(line)
            shapes[name] = _shapes_bytes(rtype)
    # Fused computations that only slice or gather from a parameter (possibly through bitcasts) read
    # what they take, not the whole operand (the loss's gather of the target logits, a layer's slice
    # of a stacked weight).
    sliced = {}
    for c, lines in comps.items():
        params, uses = {}, collections.defaultdict(list)
        for line in lines:
            name, rtype, op, operands = _parse(line)
            if op == "parameter":
                params[name] = int(re.search(r"parameter\((\d+)\)", line).group(1))
            for pos, (a, _) in enumerate(operands):
                uses[a].append((op if pos == 0 else "", _shapes_bytes(rtype)[1], name))

        def taken(value, depth=0):
            """(opcode, bytes) of the uses of ``value``, looking through bitcasts."""
            out = []
            for op, b, user in uses[value]:
                out += taken(user, depth + 1) if op == "bitcast" and depth < 8 else [(op, b)]
            return out

        sliced[c] = {}
        for p, i in params.items():
            t = taken(p)
            if t and all(op in ("dynamic-slice", "slice", "gather") for op, _ in t):
                sliced[c][i] = sum(b for _, b in t)
    comp_ops = {c: " ".join(m.group(1) for m in map(_OP_NAME.search, lines) if m) for c, lines in comps.items()}
    dots_in = {c: [ln for ln in lines if re.search(r"\sdot\(", ln)] for c, lines in comps.items()}
    roots = {c: next((ln for ln in lines if ln.lstrip().startswith("ROOT")), "") for c, lines in comps.items()}

    kernels, unknown = {}, 0

    def walk(comp, mult):
        nonlocal unknown
        for line in comps.get(comp, []):
            name, rtype, op, operands = _parse(line)
            called = _CALLS.findall(line)
            if op == "while":
                trip = _TRIP.search(line)
                unknown += trip is None
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                walk(body, mult * (int(trip.group(1)) if trip else 1))
                continue
            if op == "conditional":
                for b in re.findall(r"%?([\w.\-]+)", _BRANCHES.search(line).group(1)):
                    walk(b, mult)
                continue
            if op == "call":
                for c in called:
                    walk(c, mult)
                continue
            if op in _NO_KERNEL or not op:
                continue
            _, out_bytes = _shapes_bytes(rtype)
            read = 0
            only_slices = sliced.get(called[0], {}) if op == "fusion" and called else {}
            for i, (a, idx) in enumerate(operands):
                sh, b = shapes.get(a, ([], 0))
                if i in only_slices:
                    read += only_slices[i]
                elif idx:
                    read += _shapes_bytes(" ".join(sh[int(idx):int(idx) + 1]))[1]
                elif len(sh) <= 1:
                    read += b
            moved = read + out_bytes
            root_ops = " ".join(roots.get(c, "") for c in called)
            if op in ("dynamic-update-slice", "scatter") or re.search(r"dynamic-update-slice\(|scatter\(", root_ops):
                moved = 2 * max(read - out_bytes, 0)  # in place: the updated buffer is neither read nor rewritten
            flops = 0.0
            if op == "custom-call" and "cublas" in line:
                flops = _dot_flops(line, shapes)
            for c in called:
                flops += sum(_dot_flops(d, shapes) for d in dots_in.get(c, []))
            triton = _TRITON_NAME.search(line)
            label = triton.group(1) if triton else ("gemm" if flops else name)
            lhs = shapes.get(operands[0][0], ([], 0))[0] if operands else []
            if flops and lhs and lhs[0].startswith("f32["):
                label = "sgemm"
            context = " ".join([(_OP_NAME.search(line).group(1) if _OP_NAME.search(line) else "")]
                               + [comp_ops.get(c, "") for c in called])
            if op in ("copy", "transpose"):
                label = f"{op} {label}"
            floor_ms = 1e3 * max(moved / hbm_bytes_per_s, flops / peak_flops)
            key = (name, comp)
            k = kernels.setdefault(key, dict(name=label if triton else name, instr=name,
                                             category=categorize(label, context),
                                             calls=0, bytes=moved, flops=flops, floor_ms=floor_ms))
            k["calls"] += mult

    walk(entry, 1)
    cats = {c: dict(kernels=0, bytes=0.0, flops=0.0, floor_ms=0.0) for c in CATEGORIES}
    for k in kernels.values():
        c = cats[k["category"]]
        c["kernels"] += k["calls"]
        c["bytes"] += k["bytes"] * k["calls"]
        c["flops"] += k["flops"] * k["calls"]
        c["floor_ms"] += k["floor_ms"] * k["calls"]
    return dict(kernels=sorted(kernels.values(), key=lambda k: -k["floor_ms"] * k["calls"]),
                categories=cats, launches=sum(k["calls"] for k in kernels.values()), unknown_trip_loops=unknown)


def print_report(row: dict, top: int) -> None:
    """Markdown: memory (when compiled here), launches, the floors per category and the largest kernels."""
    fl = row["floors"]
    if "memory_gib" in row:
        mem = row["memory_gib"]
        rows = row.get("decode_rows")
        extra = f" ({rows} rows)" if rows and rows != row["tokens_per_step"] else ""
        print(f"\n## {row['model']} x {row['tokens_per_step']} tokens{extra}, context {row['seq_len']} "
              f"({row['target']}), compiled in {row['compile_s']:.0f} s")
        print(f"memory GiB: total {mem['total']:.1f} of {row['target_gib']:.1f} (arguments {mem['arguments']:.1f}, "
              f"temporaries {mem['temporaries']:.1f}, outputs {mem['outputs']:.1f}, donated {mem['donated']:.1f})")
    else:
        print(f"\n## {row['model']} ({row['target']})")
    print(f"kernels per step: {fl['launches']}" + (f" ({fl['unknown_trip_loops']} loops of unknown trip count "
                                                   "counted once)" if fl["unknown_trip_loops"] else ""))
    total = sum(c["floor_ms"] for c in fl["categories"].values())
    print("| category | kernels | GB moved | TFLOP | floor ms | share |\n|---|---|---|---|---|---|")
    for name, c in sorted(fl["categories"].items(), key=lambda kv: -kv[1]["floor_ms"]):
        if c["kernels"]:
            print(f"| {name} | {c['kernels']} | {c['bytes'] / 1e9:.2f} | {c['flops'] / 1e12:.2f} | "
                  f"{c['floor_ms']:.2f} | {c['floor_ms'] / total:.2f} |")
    print(f"| total | {fl['launches']} | {sum(c['bytes'] for c in fl['categories'].values()) / 1e9:.2f} | "
          f"{sum(c['flops'] for c in fl['categories'].values()) / 1e12:.2f} | {total:.2f} | 1.00 |")
    print("\nlargest floors (per step = per call x calls):\n| kernel | category | calls | MB per call | "
          "GFLOP per call | floor ms per step |\n|---|---|---|---|---|---|")
    for k in fl["kernels"][:top]:
        print(f"| {k['name']} | {k['category']} | {k['calls']} | {k['bytes'] / 1e6:.1f} | {k['flops'] / 1e9:.1f} | "
              f"{k['floor_ms'] * k['calls']:.3f} |")


def write_hlo(directory: str, tag: str, hlo: str) -> None:
    """Writes a compiled module's HLO text to DIRECTORY/TAG.hlo (for `--analyse`)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{tag}.hlo"), "w") as fh:
        fh.write(hlo)


def ladder_floors(a, t: dict) -> list[dict]:
    """One row per (arm, size) of a ladder's planned runs: memory, kernels per step, the step's floor,
    and the summed floor of the planned runs at that size (steps x floor; branches not included)."""
    from experiments.run_ladder import LadderError, load_ladder, plan_runs

    try:
        ladder = load_ladder(a.ladder)
        runs = plan_runs(ladder, arms=[x for x in a.arms.split(",") if x] or None,
                         jobs=[j for j in a.jobs.split(",") if j])
    except LadderError as err:
        raise SystemExit(f"aot_report: {err}") from None
    rows, by_shape = [], {}
    for run in runs:
        by_shape.setdefault((run["arm"], run["size"]), []).append(run)
    # --set applies to every run; checked here, before the compiler is loaded
    cfgs = {shape: apply_sets(copy.deepcopy(group[0]["cfg"]), a.set) for shape, group in by_shape.items()}
    device = compile_only_device(a.target)
    pop = max(1, a.population)
    print(("" if pop == 1 else f"each step trains {pop} runs of the shape at once (--population)\n")
          + "| arm | size | runs | steps | GiB | kernels/step | floor ms/step | runs' floor s |\n"
          "|---|---|---|---|---|---|---|---|")
    for (arm, size), group in by_shape.items():
        compiled, seconds = compile_step(cfgs[arm, size], device, pop)
        hlo = compiled.as_text()
        if a.hlo_dir:
            write_hlo(a.hlo_dir, f"ladder_{arm}_{size}_pop{pop}", hlo)
        floors = kernel_floors(hlo, hbm_bytes_per_s=t["hbm_bytes_per_s"], peak_flops=t["peak_bf16_flops"])
        step_ms = sum(c["floor_ms"] for c in floors["categories"].values())
        steps = sum(r["steps"] for r in group) / pop  # a population's step advances pop runs
        row = dict(arm=arm, size=size, runs=len(group), population=pop, steps=steps, compile_s=seconds,
                   memory_gib=memory_gib(compiled), launches=floors["launches"], floor_ms_per_step=step_ms,
                   floor_s=steps * step_ms / 1e3, categories=floors["categories"])
        rows.append(row)
        print(f"| {arm} | {size} | {len(group)} | {steps:.0f} | {row['memory_gib']['total']:.1f} | "
              f"{floors['launches']} | "
              f"{step_ms:.2f} | {row['floor_s']:.0f} |", flush=True)
    print(f"total floor of the planned runs: {sum(r['floor_s'] for r in rows):.0f} s")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(command="python -m experiments.aot_report " + " ".join(os.sys.argv[1:]), rows=rows), fh,
                      indent=1)
    return rows


def main(argv=None):
    # The CUDA plugin's start-up check needs a CUDA runtime, its compiler does not (before JAX starts).
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="k2:1024:12,k3:1024:12")
    p.add_argument("--target", default="h200", help=f"one of {sorted(TARGETS)}")
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--batches", default="8", help="comma-separated batch sizes (rows of seq_len tokens)")
    p.add_argument("--remat", action="store_true", help="rematerialise each scanned layer group")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (repeatable; with --ladder, applied to every run; with --decode, "
                        "model.KEY=VALUE settings of the decoded model)")
    p.add_argument("--top", type=int, default=12, help="kernels listed by floor")
    p.add_argument("--json", default="")
    p.add_argument("--hlo_dir", default="", help="also write each compiled module's HLO text there")
    p.add_argument("--decode", action="store_true",
                   help="compile one greedy decode step (experiments.bench_decode's served model; --models "
                        "entries KIND:D_MODEL:LAYERS with KIND k3 or all_mla) instead of the train step")
    p.add_argument("--contexts", default="4096", help="--decode: comma-separated cached context lengths")
    p.add_argument("--mla_decode", default="auto", help="--decode: model.mla.decode_impl")
    p.add_argument("--moe_decode", default="auto", help="--decode: model.moe.decode_impl")
    p.add_argument("--kda_decode", default="auto", help="--decode: model.kda.decode_impl")
    p.add_argument("--ladder", default="", metavar="FILE.py",
                   help="instead of --models: each (arm, size) of that ladder file's planned runs "
                        "(experiments.run_ladder), with each run's steps x floor: the device time it cannot beat")
    p.add_argument("--arms", default="", help="--ladder: comma-separated arms (default all)")
    p.add_argument("--jobs", default="main", help="--ladder: comma-separated run_ladder jobs to plan")
    p.add_argument("--population", type=int, default=1,
                   help="--ladder: compile the step of this many runs of a shape at once (run_ladder's population)")
    p.add_argument("--registers", action="store_true",
                   help="instead of XLA's compile: registers and spills of every Pallas kernel of each train "
                        "step (pallas_kernels.compile_report; needs a ptxas too)")
    p.add_argument("--analyse", default="", metavar="FILE.hlo",
                   help="only read a module written by --hlo_dir (no compiler needed; no memory figures)")
    a = p.parse_args(argv)
    if a.target not in TARGETS:
        raise SystemExit(f"aot_report: unknown --target {a.target!r}; expected one of {sorted(TARGETS)}")
    t = TARGETS[a.target]
    if a.analyse:
        try:
            text = open(a.analyse).read()
        except OSError as err:
            raise SystemExit(f"aot_report: cannot read --analyse file: {err}") from None
        floors = kernel_floors(text, hbm_bytes_per_s=t["hbm_bytes_per_s"], peak_flops=t["peak_bf16_flops"])
        print_report(dict(model=a.analyse, target=a.target, floors=floors), a.top)
        return [floors]
    if a.registers:
        from pallas_kernels import compile_report

        out = {}
        for spec in filter(None, a.models.split(",")):
            for batch in (int(b) for b in a.batches.split(",") if b):
                style, d, layers = spec.split(":")
                cfg = build_config(style, int(d), int(layers), a.seq_len, batch, a.remat, a.set)
                step, state, batch_ = abstract_train_step(cfg)
                out[f"{spec} x {batch}"] = rows = compile_report.report(step, state, batch_, arch=".".join(
                    str(x) for x in t["compute_capability"]))
                compile_report.print_table(rows, spec)
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(dict(command="python -m experiments.aot_report " + " ".join(argv or os.sys.argv[1:]),
                               jax=jax.__version__, kernels=out), fh, indent=1)
        return out
    if a.ladder:
        return ladder_floors(a, t)
    device = compile_only_device(a.target)
    rows = []
    for spec in filter(None, a.models.split(",")):
        try:
            style, d, layers = spec.split(":")
            d, layers = int(d), int(layers)
        except ValueError:
            raise SystemExit(f"aot_report: --models entries are STYLE:D_MODEL:LAYERS; got {spec!r}") from None
        runs = [(b, c) for b in (int(x) for x in a.batches.split(",") if x)
                for c in ([int(x) for x in a.contexts.split(",") if x] if a.decode else [a.seq_len])]
        for batch, length in runs:
            if a.decode:
                compiled, seconds, decode_rows = compile_decode_step(spec, length, batch, device, a.mla_decode,
                                                                    a.moe_decode, a.kda_decode, a.set)
                tag = f"{style}_{d}_{layers}_decode_b{batch}_c{length}"
            else:
                cfg = build_config(style, d, layers, length, batch, a.remat, a.set)
                compiled, seconds = compile_step(cfg, device)
                decode_rows = None
                tag = f"{style}_{d}_{layers}_b{batch}"
            hlo = compiled.as_text()
            if a.hlo_dir:
                write_hlo(a.hlo_dir, tag, hlo)
            floors = kernel_floors(hlo, hbm_bytes_per_s=t["hbm_bytes_per_s"], peak_flops=t["peak_bf16_flops"])
            row = dict(model=spec + (" decode" if a.decode else ""), target=a.target,
                       target_gib=t["memory_bytes"] / 2 ** 30, seq_len=length, batch=batch,
                       tokens_per_step=batch if a.decode else batch * length, decode_rows=decode_rows,
                       remat=a.remat, sets=list(a.set),
                       compile_s=seconds, memory_gib=memory_gib(compiled),
                       floors=dict(floors, kernels=floors["kernels"][: max(a.top, 50)]), jax=jax.__version__)
            rows.append(row)
            print_report(row, a.top)
            if a.json:
                with open(a.json, "w") as fh:
                    json.dump(dict(command="python -m experiments.aot_report " + " ".join(argv or os.sys.argv[1:]),
                                   rows=rows), fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
