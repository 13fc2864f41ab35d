"""Where one train step's device time goes: a jax.profiler trace parsed into shares by category.

    python -m experiments.profile_step --model=k3:1024:12 [--seq_len=4096] [--batch=8] [--remat]
        [--set KEY=VALUE ...] [--steps=3] [--trace_dir=DIR] [--json=FILE]

Builds the model as `experiments.bench_train_step` does, runs two warm-up steps, traces ``--steps``
steps and reads the Perfetto JSON the profiler writes. Every device kernel is put in one category,
from the named scope it ran under (the model marks ``routed_experts``, ``attention_core``,
``kda_core``, ``attn_res`` and ``optimizer``) and else from its kernel name:

  expert matmuls       matmul kernels under routed_experts
  expert dispatch      the rest of routed_experts (sort, gathers, scatter-adds, activation)
  attention            attention_core (cuDNN / Pallas / XLA attention and their backward)
  KDA                  kda_core (the Pallas kernels or the jnp chunked form)
  AttnRes mixes        attn_res
  optimizer            optimizer (Muon's momentum, Adam, weight decay; its matmuls where named)
  fp32 matmuls         fp32/TF32 GEMM kernels not named otherwise: Muon's Newton-Schulz products
  dense matmuls        other matmul kernels (projections, dense FFN, LM head)
  copies/transposes    memcpy/memset, copy and transpose kernels
  norms/elementwise    everything else (fusions of elementwise work and reductions)

Prints the table (ms per step and share of the summed kernel time) and the top kernels, so the
next change starts from the measured split. With ``--no_command_buffers`` every kernel keeps its
HLO op, and `floor_gaps` sets each against its floor from the same compiled HLO (bytes over the HBM
bandwidth, FLOPs over the peak; `experiments.aot_report.kernel_floors`): the kernels that lose the
most time, GEMMs with their fraction of the peak. The slowest fusions outside the matmul categories are
also read from the compiled HLO (`top_fusions`, in the JSON): what each reads and writes (shapes,
bytes), its fused opcodes and the share of the HBM bandwidth it reaches, which names an fp32
intermediate written to memory or a reduction far from the bandwidth without a device HLO dump.
The name tests are in `categorize`. On a GPU, XLA runs most kernels inside CUDA graphs whose trace
events name the graph, not the HLO op; the kernel's own name (fusion names match the HLO's) is then
used, and library kernels (cuBLAS, cuDNN) are told apart by name only. ``--no_command_buffers``
turns the graphs off (XLA_FLAGS) so every kernel keeps its HLO op, at some cost in launch overhead.
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

if __name__ == "__main__" and "--no_command_buffers" in sys.argv:  # must precede the backend's start
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

import jax  # noqa: E402

from experiments.bench_train_step import build_config, synthetic_batch  # noqa: E402
from k3.backends import COMPILE_CACHE_HELP, use_compile_cache  # noqa: E402
from k3.steps import make_run  # noqa: E402
from pallas_kernels.common import device_pids  # noqa: E402

CATEGORIES = ("expert matmuls", "expert dispatch", "attention", "KDA", "AttnRes mixes", "optimizer",
              "fp32 matmuls", "dense matmuls", "copies/transposes", "norms/elementwise")
_MATMUL = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|matmul|\bdot\b|dot_general|ragged_dot|wgmma|sm90_|moe_decode")
_COPY = re.compile(r"memcpy|memset|\bcopy|transpose")
# Library kernels (cuDNN, cuBLAS) run inside XLA's CUDA graphs carry no HLO op name in the trace, so
# their names decide: cuDNN's fused attention, and fp32 (TF32) GEMMs, which in this train step are
# Muon's Newton-Schulz products (the parameters and their updates are fp32; the model's matmuls bf16).
_LIB_ATTENTION = re.compile(r"sdpa|fmha|flash_fprop|flash_bprop|flash_doc|mla_latent_decode")
_LIB_FP32_GEMM = re.compile(r"f32f32_tf32|tf32f32|sgemm")


def categorize(name: str, context: str) -> str:
    """The category of one kernel from its name and the text of its trace arguments (scopes, HLO op)."""
    text = f"{name} {context}".lower()
    matmul = bool(_MATMUL.search(text))
    if _LIB_ATTENTION.search(name.lower()):
        return "attention"
    if "optimizer" in text:
        return "optimizer"
    if "routed_experts" in text:
        return "expert matmuls" if matmul else "expert dispatch"
    if "attention_core" in text:
        return "attention"
    if "kda_core" in text or name.startswith("kda_"):
        return "KDA"
    if "attn_res" in text:
        return "AttnRes mixes"
    if _LIB_FP32_GEMM.search(name.lower()):
        return "fp32 matmuls"
    if matmul:
        return "dense matmuls"
    # The kernel's name only: JAX names backward-pass ops "transpose(jvp(...))" in their scopes,
    # which says nothing about whether the kernel moves data.
    if _COPY.search(name.lower()):
        return "copies/transposes"
    return "norms/elementwise"


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def _instructions(hlo_text: str):
    """(enclosing computation or None, instruction name, line) of every instruction of an HLO text.

    A computation's header starts at column 0 and ends with '{' (an ENTRY header's parameter list
    may hold '=' in its /*index=N*/ comments); its instructions are the indented lines after it."""
    comp = None
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            comp = m.group(1)
            continue
        m = _INSTR.match(line)
        if m and line.startswith(" "):
            yield comp, m.group(1), line


def hlo_op_context(hlo_text: str) -> dict:
    """Instruction name -> the op_names (JAX scopes) of it and of every instruction it calls, from
    the compiled module's HLO text. Fusions carry their root's op_name; their bodies name the rest."""
    comp_ops, instr_op, instr_calls = collections.defaultdict(list), {}, {}
    for comp, name, line in _instructions(hlo_text):
        op = _OP_NAME.search(line)
        instr_op[name] = op.group(1) if op else ""
        instr_calls[name] = _CALLS.findall(line)
        if comp is not None and op:
            comp_ops[comp].append(op.group(1))

    def context(name, depth=0):
        parts = [instr_op.get(name, "")]
        for c in instr_calls.get(name, []):
            parts += comp_ops.get(c, [])
        return " ".join(p for p in parts if p)

    # Kernel names in a GPU trace spell '.' and '-' as '_' (fusion.12 -> fusion_12): key both forms.
    out = {}
    for name in instr_op:
        out[name] = out[_norm(name)] = context(name)
    return out


_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64)\[([\d,]*)\]")
_OPCODE = re.compile(r"=\s*(?:\([^=]*?\)|\S+)\s+([a-z][\w\-]*)\(")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8}


def _shapes_bytes(text: str) -> tuple[list[str], int]:
    """The array shapes written in an HLO type (a tuple or one array) and their total bytes."""
    shapes, total = [], 0
    for dtype, dims in _SHAPE.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        shapes.append(f"{dtype}[{dims}]")
        total += n * _BYTES[dtype]
    return shapes, total


def _result_type(rhs: str) -> str:
    """The result type at the start of an instruction's right-hand side: '(a, b)' or one array."""
    rhs = rhs.lstrip()
    if rhs.startswith("("):
        return rhs.split(")", 1)[0]
    return rhs.split(" ", 1)[0]


def hlo_fusion_summaries(hlo_text: str, names) -> dict:
    """What each named kernel (an HLO fusion; '.'/'-' may be spelled '_') reads, writes and computes.

    Returns {name: {'writes': [shapes], 'write_bytes': int, 'reads': [shapes], 'read_bytes': int,
    'ops': {opcode: count in the fused computation}}}; names not found are left out. The bytes are
    those of the fusion's operands and results (what the kernel must move at least once), so a
    kernel's time over them says how far it is from the HBM bandwidth."""
    wanted = {_norm(n): n for n in names}
    comps, instr = collections.defaultdict(list), {}
    for comp, name, line in _instructions(hlo_text):
        if comp is not None:
            comps[comp].append(line)
        if _norm(name) in wanted:
            instr[wanted[_norm(name)]] = line
    shapes_of = {}
    for lines in comps.values():  # every instruction's result type, for the operands' sizes
        for line in lines:
            shapes_of[_INSTR.match(line).group(1)] = _shapes_bytes(_result_type(line.split("=", 1)[1]))
    out = {}
    for name, line in instr.items():
        rhs = line.split("=", 1)[1]
        writes, write_bytes = _shapes_bytes(_result_type(rhs))
        args = rhs.split("fusion(", 1)[1].split(")", 1)[0] if "fusion(" in rhs else ""
        reads, read_bytes = [], 0
        for a, idx in re.findall(r"%([\w.\-]+)(?:#(\d+))?", args):
            sh, _ = shapes_of.get(a, ([], 0))
            if idx:  # element idx of a multi-output producer
                sh = sh[int(idx):int(idx) + 1]
            elif len(sh) > 1:  # a whole tuple passed on: counted by its elements' uses, not here
                continue
            reads += sh
            read_bytes += _shapes_bytes(" ".join(sh))[1]
        called = _CALLS.findall(line)
        ops = collections.Counter()
        for c in called:
            for body_line in comps.get(c, []):
                m = _OPCODE.search(body_line)
                if m and m.group(1) not in ("parameter", "constant"):
                    ops[m.group(1)] += 1
        out[name] = {"writes": writes, "write_bytes": write_bytes, "reads": reads, "read_bytes": read_bytes,
                     "ops": dict(ops.most_common())}
    return out


def _norm(name: str) -> str:
    return re.sub(r"[.\-]", "_", name)


def parse_trace(path: str, n_steps: int, op_context: dict | None = None) -> dict:
    """Category -> ms per step, and the top kernels, from a Perfetto JSON trace; ``op_context`` maps
    HLO instruction names to their scopes (`hlo_op_context`)."""
    op_context = op_context or {}
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    pids = device_pids(events)
    if not pids:  # CPU-only runs: the XLA ops of the host threads
        pids = {e["pid"] for e in events if e.get("ph") == "X" and "hlo_op" in (e.get("args") or {})}
    per_cat = collections.Counter()
    per_kernel, calls = collections.Counter(), collections.Counter()
    per_op, op_calls = collections.Counter(), collections.Counter()
    kernel_cat, kernel_scope, op_kernel, samples = {}, {}, {}, []
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in pids or "dur" not in e:
            continue
        args = e.get("args", {}) or {}
        if "hlo_op" not in args and not str(e.get("name", "")).lower().startswith(("memcpy", "memset")):
            continue  # host-side events (the runtime's, Python's) on a device-less trace
        op = str(args.get("hlo_op", ""))
        scopes = op_context.get(op) or op_context.get(_norm(op)) or op_context.get(_norm(str(e.get("name", "")))) or ""
        context = " ".join(str(v) for v in args.values()) + " " + scopes
        if len(samples) < 40:
            samples.append({"name": e.get("name"), "args": args, "matched_scopes": bool(scopes)})
        cat = categorize(str(e.get("name", "")), context)
        per_cat[cat] += e["dur"] / 1e3 / n_steps
        per_kernel[e["name"]] += e["dur"] / 1e3 / n_steps
        calls[e["name"]] += 1 / n_steps
        kernel_cat[e["name"]] = cat
        kernel_scope.setdefault(e["name"], scopes[:300])
        if op and not op.startswith("command_buffer"):  # graphs off: the HLO instruction is known
            per_op[op] += e["dur"] / 1e3 / n_steps
            op_calls[op] += 1 / n_steps
            op_kernel.setdefault(op, (e["name"], cat))
    total = sum(per_cat.values())
    return {"total_ms": total, "ms": {c: per_cat.get(c, 0.0) for c in CATEGORIES},
            "share": {c: per_cat.get(c, 0.0) / total if total else 0.0 for c in CATEGORIES},
            "top": [(k, ms, kernel_cat[k]) for k, ms in per_kernel.most_common(25)],
            "top_scopes": {k: kernel_scope[k] for k, _ in per_kernel.most_common(60)},
            "kernels": {k: [ms, kernel_cat[k]] for k, ms in per_kernel.items()},
            "calls": {k: round(c, 3) for k, c in calls.items()}, "sample_events": samples,
            # ms per step, calls per step, kernel and category of the HLO instructions that took most
            # time (empty under CUDA graphs, whose events name the graph).
            "top_ops": [(op, ms, round(op_calls[op], 3), *op_kernel[op]) for op, ms in per_op.most_common(80)],
            # every HLO instruction's [ms per step, calls per step, kernel, category] (for `floor_gaps`)
            "ops": {op: [ms, op_calls[op], *op_kernel[op]] for op, ms in per_op.items()}}


def profile_compiled(step, state, batch, n_steps: int, trace_dir: str) -> tuple[dict, dict]:
    """Traces ``n_steps`` of an AOT-compiled train step; returns (breakdown, the new state)."""
    hlo = step.as_text()
    op_context = hlo_op_context(hlo)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(n_steps):
            state, m = step(state, batch)
        jax.block_until_ready(m)
    traces = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                    key=os.path.getmtime)
    if not traces:
        raise SystemExit(f"no perfetto_trace.json.gz under {trace_dir}")
    res = parse_trace(traces[-1], n_steps, op_context)
    res["top_fusions"] = top_fusions(res, hlo)
    res["floor_gaps"] = floor_gaps(res.pop("ops"), hlo)
    return res, state


def floor_gaps(ops: dict, hlo_text: str, n: int = 40, hbm_bytes_per_s: float = 0.0, peak_flops: float = 0.0) -> dict:
    """Each traced HLO kernel against its floor: where the step loses time to the hardware.

    ``ops``: {HLO instruction: [ms per step, calls per step, kernel name, category]} (`parse_trace`;
    only known when CUDA graphs are off, ``--no_command_buffers``). Floors come from
    `experiments.aot_report.kernel_floors` on the same compiled HLO: max(bytes moved / HBM bandwidth,
    FLOPs / bf16 peak) per call. Returns {} when the device's rates are unknown (a CPU) or no op
    matched; else 'matched_ms' (the traced time joined to a floor), 'floor_ms', 'lost_ms_by_category'
    (measured minus floor, summed per category), and 'top': the ``n`` kernels that lose most, each
    with op, kernel, category, ms, calls, floor_ms, lost_ms, x_floor, and the TFLOP/s and peak fraction
    of the matmuls (a GEMM's shape is in the HLO under its op name); 'below': the ``n`` kernels that ran
    furthest under their floor, which no kernel can: their byte or FLOP count is wrong (an operand
    charged whole that the kernel reads in part, say), so they name what the floors overstate.
    """
    from experiments.aot_report import kernel_floors
    from k3.hardware import device_hbm_bandwidth, device_peak_flops

    rate, peak = device_hbm_bandwidth(hbm_bytes_per_s), device_peak_flops(peak_flops)
    if not (rate and peak and ops):
        return {}
    floors = {k["instr"]: k for k in kernel_floors(hlo_text, hbm_bytes_per_s=rate, peak_flops=peak)["kernels"]}
    rows, lost = [], collections.Counter()
    for op, (ms, calls, kernel, cat) in ops.items():
        f = floors.get(op)
        if f is None:
            continue
        floor = f["floor_ms"] * calls
        row = {"op": op, "kernel": kernel, "category": cat, "ms": ms, "calls": calls, "floor_ms": floor,
               "lost_ms": ms - floor, "x_floor": ms / floor if floor else None}
        if f["flops"]:
            row["tflops"] = f["flops"] * calls / (ms / 1e3) / 1e12
            row["peak_frac"] = row["tflops"] * 1e12 / peak
        rows.append(row)
        lost[cat] += ms - floor
    if not rows:
        return {}
    rows.sort(key=lambda r: -r["lost_ms"])
    below = [r for r in reversed(rows) if r["lost_ms"] < 0][:n]
    return {"matched_ms": sum(r["ms"] for r in rows), "floor_ms": sum(r["floor_ms"] for r in rows),
            "lost_ms_by_category": dict(lost.most_common()), "top": rows[:n], "below": below}


_NOT_FUSIONS = ("dense matmuls", "expert matmuls", "fp32 matmuls")


def top_fusions(res: dict, hlo_text: str, n: int = 30, hbm_bytes_per_s: float = 0.0) -> list[dict]:
    """The ``n`` slowest kernels outside the matmul categories that are HLO fusions: each with its
    ms and calls per step, category and `hlo_fusion_summaries` entry, plus ``hbm_frac`` where the
    device's HBM bandwidth is known (`k3.hardware`): the time to read its operands and write its
    results once per call, over its measured time (1 = at that floor; a scanned body's fusion is one
    HLO instruction called once per layer)."""
    from k3.hardware import device_hbm_bandwidth

    kernels = sorted(((ms, name, cat) for name, (ms, cat) in res["kernels"].items() if cat not in _NOT_FUSIONS),
                     reverse=True)
    summaries = hlo_fusion_summaries(hlo_text, [name for _, name, _ in kernels[: 3 * n]])
    rate = device_hbm_bandwidth(hbm_bytes_per_s)
    out = []
    for ms, name, cat in kernels[: 3 * n]:
        if name not in summaries:
            continue
        row = {"name": name, "ms": ms, "category": cat, "calls": res.get("calls", {}).get(name), **summaries[name]}
        moved = row["read_bytes"] + row["write_bytes"]
        if rate and row["calls"]:
            row["hbm_frac"] = moved * row["calls"] / rate / (ms / 1e3)
        out.append(row)
        if len(out) == n:
            break
    return out


def profile(model: str, seq_len: int, batch: int, remat: bool, sets, steps: int, trace_dir: str) -> dict:
    style, d, layers = model.split(":")
    cfg = build_config(style, int(d), int(layers), seq_len, batch, remat, sets)
    run, state = make_run(cfg)
    b = jax.device_put(synthetic_batch(cfg))
    # One compilation serves both the HLO text (scopes of each kernel) and the steps.
    step = run.train_step.lower(state, b).compile()
    for _ in range(2):
        state, m = step(state, b)
    jax.block_until_ready(m)
    out, _ = profile_compiled(step, state, b, steps, trace_dir)
    out.update({"model": model, "sets": list(sets), "tokens_per_step": batch * seq_len,
                "device": jax.devices()[0].device_kind})
    return out


def print_breakdown(res: dict) -> None:
    print(f"\n{res['model']} {' '.join(res['sets'])}: {res['total_ms']:.1f} ms of kernels per step "
          f"({res['tokens_per_step']} tokens, {res['device']})")
    for c in CATEGORIES:
        print(f"  {c:<20}{res['ms'][c]:>10.2f} ms{100 * res['share'][c]:>8.1f}%")
    print("  top kernels (ms/step, category):")
    for name, ms, cat in res["top"][:15]:
        print(f"    {ms:>9.2f}  {cat:<18} {name[:90]}")
    if res.get("top_fusions"):
        print("  slowest non-matmul fusions (ms/step, MB read + written per call, share of HBM bandwidth, ops):")
        for f in res["top_fusions"][:12]:
            frac = f"{f['hbm_frac']:.0%}" if f.get("hbm_frac") is not None else "n/a"
            ops = ", ".join(f"{k} {v}" for k, v in list(f["ops"].items())[:5])
            print(f"    {f['ms']:>9.2f}  {(f['read_bytes'] + f['write_bytes']) / 2**20:>9.1f} MB  {frac:>5}  "
                  f"{f['name'][:40]:<40} {ops}")
    gaps = res.get("floor_gaps")
    if gaps:
        print(f"  against the floors: {gaps['matched_ms']:.1f} ms traced per HLO op, floor {gaps['floor_ms']:.1f} ms; "
              "lost per category: " + ", ".join(f"{c} {ms:.1f}" for c, ms in gaps["lost_ms_by_category"].items()))
        print("  kernels losing most (ms/step, floor, x floor, peak fraction of a matmul, category, op, kernel):")
        for r in gaps["top"][:15]:
            _print_gap(r)
        if gaps.get("below"):
            print("  kernels under their floor (the floor's bytes or FLOPs overstated; same columns):")
            for r in gaps["below"][:8]:
                _print_gap(r)


def _print_gap(r: dict) -> None:
    pk = f"{r['peak_frac']:.0%}" if "peak_frac" in r else "-"
    xf = f"{r['x_floor']:.1f}x" if r["x_floor"] else "-"
    print(f"    {r['ms']:>8.2f} {r['floor_ms']:>7.2f} {xf:>7} {pk:>5}  {r['category']:<18} {r['op'][:28]:<28} "
          f"{r['kernel'][:40]}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="k3:1024:12")
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--remat", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--trace_dir", default="")
    p.add_argument("--no_command_buffers", action="store_true",
                   help="turn XLA's CUDA graphs off so that every kernel names its HLO op")
    p.add_argument("--json", default="")
    p.add_argument("--compile_cache", default="", help=COMPILE_CACHE_HELP)
    a = p.parse_args()
    use_compile_cache(a.compile_cache)
    trace_dir = a.trace_dir or tempfile.mkdtemp(prefix="k3_trace_")
    res = profile(a.model, a.seq_len, a.batch, a.remat, a.set, a.steps, trace_dir)
    print_breakdown(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
