"""Memory and communication planner: does a config fit a device mesh, and what will a step cost?

    python -m launch.plan --config=experiments/configs/k3_full.py --mesh=fsdp:16,expert:64 --device=h200 \
        [--batch=GLOBAL_SEQUENCES --seq=TOKENS --remat=full|none --mfu=0.4 --headroom=0.1] [--json]
    python -m launch.plan --config=experiments/configs/k3_full.py --suggest --devices=1024 --device=h200

(the command line is `launch.plan`; this module is its library). ``--config.x=...`` overrides work
as in `launch.train` (e.g. ``--config.model.moe.capacity_factor=1.25``,
``--config.mesh.rule_overrides=...``). Everything is derived from abstract shapes (``nnx.eval_shape``
of the model, ``jax.eval_shape`` of the optimizer's init), the sharding rules of `k3.sharding`
resolved on a mesh that need not exist (a `PlanMesh` of axis sizes), and the model code's own layer
layout (`k3.model.plan_layers`). Nothing is allocated: 2.78T parameters on 1024 devices plan in
seconds.

Per-device bytes (1 GB = 1e9 bytes):
  parameters   sum over parameters of  bytes(p) / S(p),  S(p) = product of the mesh axes that
               `Sharder.spec` lets shard p (divisibility-aware); the dtype is the one the model
               really creates (`k3.nn.param` makes float32 parameters).
  optimizer    the leaves of ``jax.eval_shape(tx.init)`` for the real `k3.optim.build_optimizer`, each
               sharded like the parameter it mirrors: Muon matrices 1 buffer (momentum), AdamW leaves 2
               (mu, nu), in the parameter dtype; optax keeps no separate master copy.
  gradients    bytes(params) (the train step differentiates w.r.t. the stored float32 parameters); with
               optim.grad_accum = A > 1 the step adds each micro-batch's gradients into one running
               sum: 2 x bytes(params).
  optimizer transient  Muon's Newton-Schulz working set during the update (`muon_work`); the update
               runs after the backward, so the total counts the larger of it and the activations
               (each with the gradients alive beside it).
  activations  an ESTIMATE of the peak, see `activation_estimate` and `layer_residual_bytes`. What a
               layer keeps for its backward comes from its mechanisms' formulas (`k3.kda.cost`,
               `k3.mla.cost`, `k3.moe.cost`, `k3.ffn`, `k3.attn_res`). The KDA, MLA and MoE formulas
               follow the residuals JAX traces for the layer (tests in `tests/test_plan.py` hold each
               within 2%), with the MoE's routed outputs counted as the compiled step keeps them;
               XLA's softmax scores (`k3.mla.cost.MLA_SCORE_BYTES`) are measured. Compiled for the
               H200 (`experiments.aot_report`), K2 and K3 1024:12 plan 2-7% above XLA's buffer
               assignment with and without remat (32K and 64K tokens; one remat policy 2% below).

Collective bytes sent per device per step (ring algorithms: all-gather and reduce-scatter of an array
of S bytes over n devices send S (n-1)/n, all-reduce 2 S (n-1)/n, all-to-all of an S-byte buffer
S (n-1)/n), in the compute dtype (XLA reshards at the matmul operand, after the cast), per micro-batch
and times grad_accum; see `collective_estimate`. Times use the device table's link bandwidths: a group
of devices inside one node runs at the intra-node rate, a group spanning nodes at the inter-node rate
(all-to-all: its cross-node share at the inter-node rate). Compute time = k3.params' 'full' FLOPs
(x 4/3 with remat: the forward runs twice) / (peak * MFU), plus the Newton-Schulz FLOPs of one Muon
update / (peak * MFU), which do not overlap the model's. Verdict: FITS when parameters + optimizer +
the larger of (activations + the gradients alive at their peak) and (gradients + optimizer transient)
<= device memory * (1 - headroom). With remat the gradients made so far sit under each recomputed
group's working set; without it the backward frees each layer's residuals as it makes that layer's
gradients, so the activations' peak holds only the running sum of gradient accumulation.

``--suggest --devices=N`` plans every mesh over (data, fsdp, expert | n_experts, context=1, tensor in
{1, 2, 4, 8}) at one sequence per device per micro-batch (or ``--batch``) and ranks the fitting ones
by estimated throughput. When none fits it searches again, saying so: with a capacity factor if the
config is dropless, then with context parallelism (the default rules shard dense parameters over
``context`` too; `context_fsdp_overrides` adds it to any FSDP rule an override leaves without it).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3 import optim as k3_optim
from k3.attn_res import MIX_BACKENDS, attn_res_bytes, stream_carry_bytes
from k3.config import layer_kinds, validate
from k3.backends import BackendError
from k3.ffn import dense_residual_bytes, dense_tensor_bytes
from k3.hardware import PEAK_BF16_FLOPS
from k3.kda.cost import (KDA_LAYER_BYTES, kda_chunk_layer_bytes, kda_context_bytes, kda_input_bytes,
                         kda_pallas_core_bytes, kda_residual_bytes)
from k3.mla.cost import MLA_SCORE_BYTES, mla_context_bytes, mla_residual_bytes, mla_scores
from k3.mla.layer import ATTENTION
from k3.model import LAYER_LOOPS, SAVES_EXPERT_PRODUCTS, SAVES_KDA_INPUTS, SAVES_WEIGHT_CASTS, Model, plan_layers
from k3.moe.cost import (expert_product_bytes, moe_all_to_all_bytes, moe_dispatch, moe_dispatch_rows,
                         moe_residual_bytes, moe_tensor_bytes, router_bias_bytes)
from k3.kda.layer import CONV_BACKENDS
from k3.kda.ops import KDA_CORES
from k3.moe.layer import EXPERT_BACKENDS
from k3.nn import norm_bytes
from k3.params import ROUTED, abstract_model, count_params, flops_per_token
from k3.sharding import DEFAULT_RULES, MESH_AXES, Sharder, mesh_shape, parse_rules, spec_axes


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator kind. Bandwidths are bytes/s sent per device in one direction."""

    description: str
    memory_bytes: float
    bf16_flops: float  # dense bf16 peak, FLOP/s
    intra_node_bw: float  # NVLink / ICI
    inter_node_bw: float  # InfiniBand / DCN, per device
    devices_per_node: int
    note: str = ""

    @property
    def platform(self) -> str:
        """The JAX platform the device is ('gpu' or 'tpu'): it decides what 'auto' kernels run."""
        return "tpu" if "TPU" in self.description else "gpu"


# Nominal datasheet numbers. NVLink's quoted figure counts both directions; a collective's bytes sent
# move at half of it. The H200 memory is the nominal 141e9 bytes: the lent H200 reports about
# 139 GiB (1.49e11 bytes) usable, so this errs on the safe side by about 5%.
DEVICES: dict[str, Device] = {
    "h200": Device("NVIDIA H200 SXM", 141e9, PEAK_BF16_FLOPS["H200"], 450e9, 50e9, 8,
                   "141e9 B HBM3e (nominal), NVLink4 900 GB/s bidirectional, 400 Gb/s IB per GPU"),
    "h100": Device("NVIDIA H100 SXM 80GB", 80e9, PEAK_BF16_FLOPS["H100"], 450e9, 50e9, 8,
                   "80e9 B HBM3 (nominal), NVLink4 900 GB/s bidirectional, 400 Gb/s IB per GPU"),
    "a100-80g": Device("NVIDIA A100 SXM 80GB", 80e9, PEAK_BF16_FLOPS["A100"], 300e9, 25e9, 8,
                       "80e9 B HBM2e, NVLink3 600 GB/s bidirectional, 200 Gb/s IB per GPU"),
    "b200": Device("NVIDIA B200 (HGX)", 180e9, PEAK_BF16_FLOPS["B200"], 900e9, 50e9, 8,
                   "180e9 B HBM3e, NVLink5 1.8 TB/s bidirectional, 400 Gb/s IB per GPU"),
    "tpu-v5p": Device("Google TPU v5p", 95e9, PEAK_BF16_FLOPS["TPU v5p"], 90e9, 6.25e9, 8960,
                      "95e9 B HBM2e; a whole pod is one ICI torus (approximate per-axis ring rate); "
                      "DCN across pods ~200 Gb/s per 4-chip host"),
}

GB = 1e9


class PlanError(ValueError):
    """A bad mesh, device, batch or sequence request; the message names the problem."""


# ---------------------------------------------------------------------------------------------
# Mesh without devices


class PlanMesh:
    """Axis sizes only: all that `Sharder.spec` reads from a mesh (``.shape``). Hashable."""

    def __init__(self, sizes: tuple[tuple[str, int], ...]):
        self.sizes = tuple(sizes)
        self.shape = dict(self.sizes)
        self.size = math.prod(s for _, s in self.sizes)

    def __eq__(self, other):
        return isinstance(other, PlanMesh) and other.sizes == self.sizes

    def __hash__(self):
        return hash(self.sizes)

    def __repr__(self):
        return f"PlanMesh({self.sizes})"


def plan_sharder(sizes: Mapping[str, int], rules=DEFAULT_RULES) -> Sharder:
    """A `Sharder` over a device-less mesh of ``sizes`` (axis -> size, all of `MESH_AXES`)."""
    return Sharder(PlanMesh(tuple((a, int(sizes.get(a, 1))) for a in MESH_AXES)), tuple(rules))


def parse_mesh(text: str, devices: int | None = None) -> dict[str, int]:
    """'data:1,fsdp:64,expert:64' -> sizes of all five mesh axes (missing = 1; one may be -1).

    ``devices`` (optional) is the device count the sizes must multiply to; a -1 needs it.
    Raises PlanError naming the unknown axis, the malformed entry or the size mismatch.
    """
    sizes = {a: 1 for a in MESH_AXES}
    seen = set()
    for item in filter(None, (s.strip() for s in text.split(","))):
        if ":" not in item:
            raise PlanError(f"--mesh entry {item!r} is not 'axis:size'")
        axis, size = (s.strip() for s in item.split(":", 1))
        if axis not in MESH_AXES:
            raise PlanError(f"--mesh: unknown mesh axis {axis!r}; mesh axes are {', '.join(MESH_AXES)}")
        if axis in seen:
            raise PlanError(f"--mesh: axis {axis!r} given twice")
        seen.add(axis)
        try:
            sizes[axis] = int(size)
        except ValueError:
            raise PlanError(f"--mesh: size of {axis!r} must be an integer, got {size!r}") from None
    if -1 in sizes.values() and not devices:
        raise PlanError("--mesh has a -1 axis: pass --devices=N to fill it")
    if devices and -1 not in sizes.values() and math.prod(sizes.values()) != devices:
        raise PlanError(f"--mesh sizes multiply to {math.prod(sizes.values())} devices, not --devices={devices}")
    n = devices or math.prod(s for s in sizes.values() if s > 0)
    try:
        return mesh_shape(sizes, n)
    except ValueError as e:
        raise PlanError(f"--mesh: {e}") from None


def _shards(sharder: Sharder, axes) -> int:
    return math.prod(sharder.size(a) for a in axes)


def _group_link(sizes: Mapping[str, int], axes, device: Device) -> tuple[int, int]:
    """(group size n, members inside the first member's node q) for a collective over ``axes``.

    Devices are laid out row-major in `MESH_AXES` order (tensor innermost), as `k3.sharding.make_mesh`
    does, and nodes are runs of ``devices_per_node`` consecutive devices.
    """
    strides, s = {}, 1
    for a in reversed(MESH_AXES):
        strides[a] = s
        s *= sizes[a]
    offsets = np.zeros(1, np.int64)
    for a in axes:
        offsets = (offsets[:, None] + strides[a] * np.arange(sizes[a])[None, :]).reshape(-1)
    return int(offsets.size), int(np.sum(offsets // device.devices_per_node == 0))


def collective_seconds(nbytes: float, sizes, axes, device: Device, kind: str) -> float:
    """Seconds to send ``nbytes`` per device in a collective over mesh ``axes``.

    kind 'ring' (all-gather, reduce-scatter, all-reduce): intra-node rate when the group fits in a
    node, else the inter-node rate. kind 'a2a': the cross-node share at the inter-node rate and the
    rest at the intra-node rate, concurrently.
    """
    if nbytes <= 0:
        return 0.0
    n, q = _group_link(sizes, axes, device)
    if kind == "a2a" and n > 1:
        remote = (n - q) / (n - 1)
        return max(nbytes * remote / device.inter_node_bw, nbytes * (1 - remote) / device.intra_node_bw)
    return nbytes / (device.intra_node_bw if q == n else device.inter_node_bw)


# ---------------------------------------------------------------------------------------------
# Parameters and optimizer state


@dataclasses.dataclass
class ParamInfo:
    """One parameter: path, shape, bytes, logical axes, Muon or AdamW, routed expert or not, and where
    it lives in the layer layout (``region``: 'top', 'head', 'body', 'tail'; ``layer``: the unrolled
    layer's index in its list, None for the body and top level)."""

    path: tuple
    shape: tuple[int, ...]
    itemsize: int
    dtype: str
    axes: tuple
    muon: bool
    routed: bool
    region: str
    layer: int | None
    ns: tuple[int, int, int] | None = None  # Muon: (matrices, short side m, long side n); else None
    elems: int = dataclasses.field(init=False)
    nbytes: int = dataclasses.field(init=False)
    name: str = dataclasses.field(init=False)

    def __post_init__(self):
        self.elems = math.prod(self.shape)
        self.nbytes = self.elems * self.itemsize
        self.name = "/".join(str(p) for p in self.path)


def param_infos(params_state, per_head: bool = False) -> list[ParamInfo]:
    """`ParamInfo` of every parameter of an (abstract) ``nnx.State`` of ``nnx.Param``."""
    out = []
    for path, var in nnx.to_flat_state(params_state):
        axes = tuple(var.get_metadata().get("out_sharding") or (None,) * len(var.shape))
        name = str(path[-1])
        region = {"head_layers": "head", "body": "body", "tail_layers": "tail"}.get(str(path[0]), "top")
        layer = int(path[1]) if region in ("head", "tail") else None
        dims = k3_optim.param_dimension_numbers(name, axes, per_head)
        out.append(ParamInfo(
            path=tuple(path), shape=tuple(var.shape), itemsize=np.dtype(var.dtype).itemsize,
            dtype=np.dtype(var.dtype).name, axes=axes, muon=dims is not None,
            routed=name in ROUTED and "experts" in axes and "expert_embed" in axes,
            region=region, layer=layer, ns=None if dims is None else _ns_matrices(tuple(var.shape), dims)))
    return out


def _ns_matrices(shape: tuple[int, ...], dims) -> tuple[int, int, int]:
    """(number of matrices, short side, long side) that Muon orthogonalises in a parameter of ``shape``."""
    r = math.prod(shape[i] for i in dims.reduction_axis)
    o = math.prod(shape[i] for i in dims.output_axis)
    return math.prod(shape) // (r * o), min(r, o), max(r, o)


NS_STEPS = 5  # Newton-Schulz steps per Muon update (`k3.muon`, optax's default)


def muon_work(infos: list[ParamInfo], shards: list[int], mu_bytes: int) -> dict:
    """Per-device Newton-Schulz FLOPs of one optimizer update and the update's transient bytes.

    Per Muon matrix m x n (m <= n): NS_STEPS x (4 m^2 n + 2 m^3) FLOPs (Gram, M X, and A^2), and
    live while it runs: X in the momentum dtype (``mu_bytes``) plus per matrix three m x m in that
    dtype (A, A^2, M) and the first Gram matrix in fp32. Counted as if every matrix were in flight at
    once (XLA may schedule them so), meant as an upper bound; measured against it: for K2 and K3 1024:12
    with bf16 moments it gives 12.7 and 8.2 GiB where the H200 compile of the update
    (`experiments.bench_optimizer`'s temp GiB) keeps 3.5 and 0.4 GiB. XLA's CPU compile keeps 15.5
    and 9.4 GiB: it runs each bf16 dot on fp32 copies of its operands. Each parameter's share
    is divided by its shard count: exact when the matrices are split over the batch axes (experts
    over 'expert'), XLA's partitioning of the matmuls otherwise (whose collectives are not counted).
    Returns {'flops', 'transient', 'largest'} per device; 'largest' is the largest single
    parameter's share of the transient.
    """
    flops = transient = largest = 0.0
    for p, n_shards in zip(infos, shards):
        if p.ns is None:
            continue
        b, m, n = p.ns
        flops += NS_STEPS * (4 * m * m * n + 2 * m ** 3) * b / n_shards
        one = (mu_bytes * b * m * n + (3 * mu_bytes + 4) * b * m * m) / n_shards
        transient, largest = transient + one, max(largest, one)
    return {"flops": flops, "transient": transient, "largest": largest}


def param_shard_axes(info: ParamInfo, sharder: Sharder) -> tuple[tuple[str, ...], ...]:
    """Per dimension, the mesh axes that shard it (the rules resolved with divisibility)."""
    return tuple(spec_axes(e) for e in sharder.spec(info.axes, info.shape))


def param_shards(infos: list[ParamInfo], sharder: Sharder) -> list[int]:
    """Per parameter, how many ways it is split: the product of the mesh axes that shard it."""
    return [r[0] for r in _resolve(infos, sharder, ())]


def _resolve(infos: list[ParamInfo], sharder: Sharder, token_axes: tuple) -> list[tuple]:
    """Per parameter (shard count, gather axes, shard count kept while gathered, all-reduce axes);
    see `param_comm`. Parameters of equal axes and shape resolve once."""
    memo: dict = {}
    out = []
    for p in infos:
        key = (p.axes, p.shape, p.routed)
        if key not in memo:
            dims = param_shard_axes(p, sharder)
            all_axes = [a for d in dims for a in d]
            ep = set(dims[p.axes.index("experts")]) if p.routed else set()
            gather = tuple(a for a in all_axes if a in token_axes and a not in ep)
            keep = _shards(sharder, [a for a in all_axes if a not in gather])
            reduce = tuple(a for a in token_axes if a not in all_axes)
            memo[key] = (_shards(sharder, all_axes), gather, keep, reduce)
        out.append(memo[key])
    return out


def param_bytes(infos: list[ParamInfo], sharder: Sharder, shards: list[int] | None = None) -> dict:
    """Per-device parameter bytes: total, per parameter (name -> bytes), and the replicated ones.

    ``shards``: `param_shards` when already computed. Returns {'total', 'global', 'per_param':
    {name: bytes}, 'replicated': [(bytes, name)] largest first (parameters with no sharded
    dimension on a multi-device mesh)}.
    """
    shards = param_shards(infos, sharder) if shards is None else shards
    per, replicated = {}, []
    for p, n in zip(infos, shards):
        per[p.name] = p.nbytes / n
        if n == 1 and sharder.mesh.size > 1:
            replicated.append((p.nbytes, p.name))
    replicated.sort(reverse=True)
    return {"total": sum(per.values()), "global": sum(p.nbytes for p in infos), "per_param": per,
            "replicated": replicated}


def _key_str(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def optimizer_leaves(cfg, params_state, infos: list[ParamInfo]) -> list[tuple[int | None, int, str]]:
    """The optimizer state's leaves as (index of the mirrored parameter or None, bytes, kind).

    From ``jax.eval_shape`` of the real optimizer's init. A leaf mirrors a parameter when its key path
    ends with the parameter's path and it has its shape (as `k3.sharding.tree_shardings_like` decides);
    kind is 'muon' or 'adam' (from the optax partition it sits under) or 'other' (counts, coefficients).
    """
    tx, _ = k3_optim.build_optimizer(cfg, params_state)
    state = jax.eval_shape(tx.init, params_state)
    by_path = {tuple(str(x) for x in p.path): (i, p.shape) for i, p in enumerate(infos)}
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        names = tuple(_key_str(k) for k in path)
        shape = tuple(np.shape(leaf))
        nbytes = math.prod(shape) * np.dtype(leaf.dtype).itemsize
        hit = None
        for start in range(len(names)):
            cand = by_path.get(names[start:])
            if cand is not None and cand[1] == shape:
                hit = cand[0]
                break
        kind = "other"
        if hit is not None:
            kind = "muon" if "muon" in names else "adam"
        out.append((hit, nbytes, kind))
    return out


def optimizer_bytes(leaves, infos: list[ParamInfo], sharder: Sharder, shards: list[int] | None = None) -> dict:
    """Per-device optimizer-state bytes, each leaf sharded like its parameter: {'total', 'muon',
    'adam', 'other'} (Muon momentum, AdamW moments, replicated scalars)."""
    shards = param_shards(infos, sharder) if shards is None else shards
    out = {"muon": 0.0, "adam": 0.0, "other": 0.0}
    for idx, nbytes, kind in leaves:
        out[kind] += nbytes / (shards[idx] if idx is not None else 1)
    out["total"] = sum(out.values())
    return out


def optimizer_bytes_by_rule(infos: list[ParamInfo], optim_name: str, sharder: Sharder | None = None) -> float:
    """What the Muon/AdamW split of `k3.optim` implies: 1 buffer per Muon matrix, 2 per AdamW
    parameter ('adamw': 2 per parameter), in the parameter dtype; per device with ``sharder``."""
    shards = [1] * len(infos) if sharder is None else param_shards(infos, sharder)
    total = 0.0
    for p, s in zip(infos, shards):
        n = 1 if (optim_name == "muon" and p.muon) else 2
        total += n * p.nbytes / s
    return total


# ---------------------------------------------------------------------------------------------
# Layout of the run on the mesh


@dataclasses.dataclass
class Layout:
    """Batch and sequence on the mesh, and the divisors of the activations' sharded widths.

    ``batch_axes``/``context_axes``: mesh axes that split B / T (size > 1); ``token_axes`` both.
    ``micro``: sequences per device per micro-batch; ``t``: local tokens per sequence; ``tokens``:
    local tokens per micro-batch (micro * t); divisors ``*_div`` of heads, FFN widths and vocabulary.
    ``expert_axes``/``P``: the expert-parallel group and its size; ``C``: all-to-all rows per
    destination device (0 without expert parallelism; `k3.moe.cost.moe_dispatch_rows`); ``dispatch``:
    'padded' (fixed [P, C] buffers travel) or 'ragged' (only the routed rows travel; the receive
    buffer still has P C rows; `k3.moe.cost.moe_dispatch`).
    ``attention``/``kda_core``/``kda_conv``/``experts``: the `k3.mla.ATTENTION` / `k3.kda.ops.KDA_CORES`
    / `k3.kda.layer.CONV_BACKENDS` / `k3.moe.layer.EXPERT_BACKENDS` entries the config runs on the
    planned device's platform ('auto' resolved there).
    """

    batch_axes: tuple[str, ...]
    context_axes: tuple[str, ...]
    micro: int
    accum: int
    t: int
    seq: int
    kda_heads_div: int
    mla_heads_div: int
    mlp_div: int
    shared_div: int
    expert_mlp_div: int
    vocab_div: int
    expert_axes: tuple[str, ...]
    P: int
    C: int
    dispatch: str = "padded"
    attention: str = "xla"
    kda_core: str = "chunk"
    kda_conv: str = "xla"
    experts: str = "ragged"

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Mesh axes that split the tokens (batch, then sequence)."""
        return self.batch_axes + self.context_axes

    @property
    def tokens(self) -> int:
        """Local tokens per micro-batch."""
        return self.micro * self.t

    @property
    def cp(self) -> int:
        """Context-parallel degree: shards of the sequence."""
        return self.seq // self.t


def _axes_shards(sharder, names, shape, dim) -> tuple[tuple[str, ...], int]:
    axes = spec_axes(sharder.spec(names, shape)[dim])
    return axes, _shards(sharder, axes)


def make_layout(cfg, sharder: Sharder, batch: int, seq: int, capacity_factor: float | None = None,
                platform: str = "gpu") -> Layout:
    """Resolves batch/sequence/width sharding as the model code does, and the kernels the config runs
    on ``platform``; raises PlanError when the batch or sequence does not divide (the checks of
    `k3.steps.make_sharder`) or a kernel cannot run there."""
    m = cfg.model
    try:
        attention = ATTENTION.resolve(m.mla.attention_impl, platform)
        kda_core = KDA_CORES.resolve(m.kda.impl, platform)
        experts = EXPERT_BACKENDS.resolve(m.moe.expert_impl, platform)
        kda_conv = CONV_BACKENDS.resolve(m.kda.conv_impl, platform)
    except BackendError as e:
        raise PlanError(str(e)) from e
    accum = cfg.optim.grad_accum
    if batch <= 0 or seq <= 0:
        raise PlanError(f"batch and seq must be positive, got batch={batch} seq={seq}")
    if batch % accum:
        raise PlanError(f"--batch={batch} is not a multiple of optim.grad_accum={accum}")
    micro_global = batch // accum
    batch_devices = _shards(sharder, sharder.axes_for("batch"))
    if micro_global % batch_devices:
        raise PlanError(f"the micro-batch of {micro_global} sequences (batch / grad_accum) is not a multiple "
                        f"of the {batch_devices} devices that split the batch "
                        f"({'*'.join(sharder.axes_for('batch'))}); pass --batch={batch_devices * accum} or a multiple")
    if seq % sharder.size("context"):
        raise PlanError(f"--seq={seq} is not a multiple of context={sharder.size('context')}")
    spec = sharder.spec(("batch", "seq"), (micro_global, seq))
    b_axes, c_axes = spec_axes(spec[0]), spec_axes(spec[1])
    E = m.moe.n_experts
    expert_axes, P = _axes_shards(sharder, ("experts",), (E,), 0)
    f_axes = tuple(a for a in spec_axes(sharder.spec(("experts", "expert_mlp"), (E, m.moe.expert_dim))[1])
                   if a not in b_axes + c_axes)
    t = seq // _shards(sharder, c_axes)
    micro = micro_global // _shards(sharder, b_axes)
    cf = m.moe.capacity_factor if capacity_factor is None else capacity_factor
    C = moe_dispatch_rows(m.moe, micro * t, P, cf)
    dispatch = moe_dispatch(m.moe)
    return Layout(
        batch_axes=b_axes, context_axes=c_axes, micro=micro, accum=accum, t=t, seq=seq,
        kda_heads_div=_axes_shards(sharder, ("act_heads",), (m.kda.n_heads,), 0)[1],
        mla_heads_div=_axes_shards(sharder, ("act_heads",), (m.mla.n_heads,), 0)[1],
        mlp_div=_axes_shards(sharder, ("mlp",), (m.dense_ffn_dim,), 0)[1],
        shared_div=_axes_shards(sharder, ("mlp",), (max(m.moe.shared_dim, 1),), 0)[1],
        expert_mlp_div=_shards(sharder, f_axes),
        vocab_div=_axes_shards(sharder, ("act_vocab",), (m.vocab_size,), 0)[1],
        expert_axes=expert_axes, P=P, C=C, dispatch=dispatch, attention=attention, kda_core=kda_core,
        experts=experts, kda_conv=kda_conv)


# ---------------------------------------------------------------------------------------------
# Activations

_LAYOUTS: dict = {}


def _layers(m):
    """(`layer_kinds`, `plan_layers`) of a model config, cached by the fields that decide them. The
    layer loop is resolved here, as for the abstract model the plan reads its parameters from."""
    key = (m.n_layers, m.mixer, m.mla_period, m.first_k_dense, LAYER_LOOPS.resolve(m.layer_loop))
    if key not in _LAYOUTS:
        _LAYOUTS[key] = (layer_kinds(m), plan_layers(m))
    return _LAYOUTS[key]


# Each mechanism's per-layer formulas, keyed by the layer kinds of `k3.config.layer_kinds` (mixer,
# FFN). Residuals: (m, lay, a, qk_clip) -> ({term: bytes}, transient bytes); context gathers:
# (m, lay, a) -> bytes per pass before the ring factor; tensor-parallel collectives:
# (m, lay, a, tp) -> [bytes per collective and pass]; all-to-alls: (m, lay, a, passes) -> bytes.
MIXER_RESIDUALS = {"kda": kda_residual_bytes, "mla": mla_residual_bytes}
FFN_RESIDUALS = {"dense": dense_residual_bytes, "moe": moe_residual_bytes}
CONTEXT_GATHERS = {"kda": kda_context_bytes, "mla": mla_context_bytes}
FFN_TENSOR_PARALLEL = {"dense": dense_tensor_bytes, "moe": moe_tensor_bytes}
FFN_ALL_TO_ALL = {"moe": moe_all_to_all_bytes}


def layer_residual_bytes(m, mixer: str, ffn: str, lay: Layout, a: int, qk_clip: bool) -> dict:
    """Estimated bytes one layer keeps for its backward pass, per device, and its largest transient.

    N = local tokens per micro-batch, D = d_model, a = compute-dtype bytes; head counts and FFN
    widths are per device (divided by their tensor-parallel shards).
      stream   2 NORM N D + 2 N D a    the two pre-norms' inputs (NORM = `k3.nn.norm_bytes`) and the
                                      sublayer outputs
      attn_res (Block AttnRes) the two depth mixes, `k3.attn_res.attn_res_bytes`
      mixer    ``mixer``'s entry of `MIXER_RESIDUALS`: `k3.kda.cost.kda_residual_bytes`,
               `k3.mla.cost.mla_residual_bytes`
      ffn      ``ffn``'s entry of `FFN_RESIDUALS`: `k3.ffn.dense_residual_bytes` (term 'ffn'),
               `k3.moe.cost.moe_residual_bytes`
    The transient is the larger of the mixer's and the FFN's (attention-score gradients or QK-Clip
    logits, all-to-all buffers); ``qk_clip`` is optim.qk_clip.
    Returns {'total': bytes, 'transient': bytes, term: bytes ...}.
    """
    N, D = lay.tokens, m.d_model
    out = {"stream": 2 * norm_bytes(a) * N * D + 2 * N * D * a}
    out.update(attn_res_bytes(m, N, a))
    transient = 0.0
    for table, kind in ((MIXER_RESIDUALS, mixer), (FFN_RESIDUALS, ffn)):
        terms, peak = table[kind](m, lay, a, qk_clip)
        out.update(terms)
        transient = max(transient, peak)
    out["total"] = sum(v for k, v in out.items())
    out["transient"] = transient
    return out


def activation_estimate(cfg, lay: Layout, remat: bool, gather_bytes: dict, cast_bytes: float = 0.0) -> dict:
    """Estimated peak activation bytes per device (an estimate: XLA's schedule decides the truth).

    Layer layout from `k3.model.plan_layers`: unrolled head layers, a scanned body of R repeats of a
    G-layer group (rematerialised as one unit when ``remat``), unrolled tail layers (each
    rematerialised on its own when ``remat``).
      carries      remat: (R + unrolled layers) x the saved layer input: the stream [N, D] (plain) or
                   the AttnRes bank plus partial sum [(slots + 1), N, D], compute dtype
      kept layers  without remat: the residuals (`layer_residual_bytes`) of every layer and their
                   gathered (compute-dtype) weights; with remat, ``cast_bytes``: the compute-dtype
                   copies of the local parameters that a '*_kernels' policy keeps
      kept inputs  remat under a policy in `k3.model.SAVES_KDA_INPUTS` with the Pallas KDA core: every
                   KDA layer's kernel inputs (`k3.kda.cost.kda_input_bytes`); under a policy in
                   `k3.model.SAVES_EXPERT_PRODUCTS`: every MoE layer's expert products
                   (`k3.moe.cost.expert_product_bytes`); the working set then leaves them out
      working set  remat: the residuals of one body group or one unrolled layer during its backward
                   (recomputed), whichever is larger, plus the stream cotangents (2 carries) and one
                   group's gathered weights and their unreduced gradients (FSDP gather buffers)
      transient    the largest single transient of any layer (all-to-all buffers, attention-score
                   gradients or QK-Clip logits)
      LM head      N V_l b: what the loss holds at its peak, b bytes per logit
                   (`lm_head_bytes_per_logit`); N is one chunk's tokens with
                   ``model.ce_chunk``; plus the gathered LM head weight and its unreduced gradient
    peak = carries + kept layers + max(working set + transient, LM head).
    """
    m = cfg.model
    a = np.dtype(m.dtype).itemsize
    N, D = lay.tokens, m.d_model
    kinds, (head, (start, period, repeats), tail) = _layers(m)
    qk_clip = bool(cfg.optim.qk_clip)
    by_kind = {kind: layer_residual_bytes(m, *kind, lay, a, qk_clip) for kind in set(kinds)}
    res = [by_kind[kind] for kind in kinds]
    body_idx = list(range(start, start + period * repeats))
    unrolled = list(head) + list(tail)
    carry = stream_carry_bytes(m, N, a)
    out = {}
    if remat:
        out["carries"] = (repeats + len(unrolled)) * carry
        kept = []
        # Kept KDA inputs are held for the whole step, so a recomputed layer's working set leaves them out.
        keeps_inputs = m.remat_policy in SAVES_KDA_INPUTS and lay.kda_core == "pallas"
        keeps_products = m.remat_policy in SAVES_EXPERT_PRODUCTS
        inputs = [(kda_input_bytes(m, lay, a) if keeps_inputs and mixer == "kda" else 0.0)
                  + (expert_product_bytes(m, lay, a) if keeps_products and ffn == "moe" else 0.0)
                  for mixer, ffn in kinds]
        held = [r["total"] - x for r, x in zip(res, inputs)]
        group = sum(held[i] for i in body_idx[:period]) if repeats else 0.0
        largest = max([group] + [held[i] for i in unrolled])
        out["working_set"] = (largest + 2 * carry
                              + 2 * max([gather_bytes["body_group"]] + gather_bytes["unrolled"]))
        out["kept_weights"] = float(cast_bytes)
        out["kept_inputs"] = sum(inputs)
    else:
        out["carries"] = 0.0
        kept = unrolled + body_idx
        out["working_set"] = 2 * carry + 2 * max([gather_bytes["body_group"]] + gather_bytes["unrolled"])
        out["kept_weights"] = sum(gather_bytes["unrolled"]) + repeats * gather_bytes["body_group"]
        out["kept_inputs"] = 0.0
    out["kept_layers"] = sum(res[i]["total"] for i in kept)
    out["transient"] = max(r["transient"] for r in res)
    V_l = m.vocab_size // lay.vocab_div
    # With model.ce_chunk the loss forms one chunk's logits at a time (and keeps an fp32 logsumexp per token).
    N_ce = lay.micro * min(m.ce_chunk, lay.t) if m.ce_chunk else N
    out["lm_head"] = (N_ce * V_l * lm_head_bytes_per_logit(m) + 2 * gather_bytes["lm_head"] + 2 * N * D * a
                      + (4 * N if m.ce_chunk else 0))
    out["peak"] = (out["carries"] + out["kept_layers"] + out["kept_weights"] + out["kept_inputs"]
                   + max(out["working_set"] + out["transient"], out["lm_head"]))
    out["remat_effective"] = remat
    out["unrolled_layers"] = unrolled
    out["by_kind"] = {f"{mk}/{fk}": {t: v for t, v in r.items()} for (mk, fk), r in by_kind.items()}
    return out


def lm_head_bytes_per_logit(m) -> float:
    """Bytes per [token, vocabulary] logit that the loss holds at its peak, for ``cfg.model``.

    - whole logits, ``model.ce_impl='custom_vjp'``: the logits in the compute dtype, kept for the
      backward, whose gradient XLA writes in their place: a (compiled for an H200, K3 1024:12 at 32K
      tokens: vocabulary 4,096 -> 163,840 adds 2.2 bytes per logit to the temporaries with bf16);
    - whole logits, 'autodiff': the logits and their fp32 log-softmax, which XLA keeps: a + 4
      (compiled for an H200, K3 1024:12 at 32K tokens: vocabulary 4,096 -> 163,840 added 5.4 bytes
      per logit with bf16 logits);
    - ``model.ce_chunk`` > 0: one chunk's logits in fp32 from the GEMM and their exponentials: a + 4.
    """
    a = np.dtype(m.dtype).itemsize
    if not m.ce_chunk and m.ce_impl == "custom_vjp":
        return float(a)
    return a + 4.0


def saved_residual_bytes(cfg, batch: int, seq: int, platform: str = "gpu") -> float:
    """Bytes JAX keeps from the forward for the backward pass of one [batch, seq] micro-batch on one
    device: the residuals of ``jax.vjp`` of the loss (parameters themselves excluded), traced on
    abstract shapes, so nothing is allocated and it runs on a CPU for any model size.

    It follows what the code does: ``model.remat`` and ``model.remat_policy`` decide what is saved
    (the layer-group inputs only under 'full', plus matmul outputs under 'dots', plus the kernels'
    named residuals under 'dots_kernels' ...), and the kernels are those ``platform`` runs ('auto'
    resolved there: Pallas KDA, conv branches and depth mixes, flash attention and capacity experts
    on 'gpu'). What it cannot see is XLA's working set while a group's forward is recomputed in the
    backward: on the H200 the measured peaks of K3 1024:12 at 32K tokens exceed parameters,
    optimizer, gradients and this count by 10.4 GiB under 'dots_kernels_glu' and 12.7-16.3 GiB under
    'dots' and 'dots_kernels' (`experiments.plan_vs_measured`, rows measured up to the conv kernels)."""
    m = copy.deepcopy(cfg.model)
    with m.unlocked() if hasattr(m, "unlocked") else contextlib.nullcontext():
        for node, key, table in ((m.mla, "attention_impl", ATTENTION), (m.kda, "impl", KDA_CORES),
                                 (m.moe, "expert_impl", EXPERT_BACKENDS), (m.kda, "conv_impl", CONV_BACKENDS),
                                 (m, "attn_res_impl", MIX_BACKENDS)):
            try:
                node[key] = table.resolve(node[key], platform)
            except BackendError:
                node[key] = table.resolve("auto")  # a kernel this process cannot trace: its own default

    def residuals():
        model = Model(m, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        tokens = jnp.zeros((batch, seq), jnp.int32)
        segments = jnp.ones((batch, seq), jnp.int32)

        def loss(p):  # the train step's loss (`Model.loss`: chunked with model.ce_chunk)
            return nnx.merge(graphdef, p, rest).loss(tokens, segments, tokens)[0]

        param_ids = {id(x) for x in jax.tree.leaves(params)}
        vjp = jax.vjp(loss, params)[1]
        return [x for x in jax.tree.leaves(vjp) if id(x) not in param_ids and hasattr(x, "dtype")]

    return float(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.eval_shape(residuals)))


# ---------------------------------------------------------------------------------------------
# Collectives


def param_comm(infos: list[ParamInfo], sharder: Sharder, lay: Layout) -> list[tuple]:
    """Per parameter, its FSDP-style traffic: (gather axes, shard count kept while gathered,
    all-reduce axes). A parameter is gathered over the token axes that shard it, except the expert
    axis of a routed expert's weights (the all-to-all brings the tokens to them instead), and its
    gradient is all-reduced over the token axes that do not shard it."""
    return [r[1:] for r in _resolve(infos, sharder, lay.token_axes)]


def gather_buffer_bytes(infos: list[ParamInfo], comm: list[tuple], a: int, repeats: int) -> dict:
    """Compute-dtype bytes of gathered weights: one body group ('body_group'), each unrolled layer
    ('unrolled', a list) and the LM head ('lm_head'); a weight is gathered over its token axes only."""
    body, unrolled, lm = 0.0, {}, 0.0
    for p, (_, keep, _) in zip(infos, comm):
        nbytes = p.elems / keep * a
        if p.region == "body":
            body += nbytes / max(repeats, 1)
        elif p.region in ("head", "tail"):
            unrolled[(p.region, p.layer)] = unrolled.get((p.region, p.layer), 0.0) + nbytes
        elif p.path == ("lm_head",):
            lm += nbytes
    return {"body_group": body, "unrolled": list(unrolled.values()), "lm_head": lm}


def collective_estimate(cfg, infos: list[ParamInfo], sharder: Sharder, lay: Layout, remat: bool,
                        device: Device, comm: list[tuple] | None = None) -> list[dict]:
    """Bytes sent per device per optimizer step by each kind of collective, and their time.

    Per micro-batch (then x grad_accum), in the compute dtype (a bytes):
      fsdp_gather    each parameter sharded over token axes G (data/fsdp/expert/context; not the
                     expert axis of routed experts, which the all-to-all serves) is all-gathered:
                     S = elems / (other shards) * a, sent S (g-1)/g; again in the backward for the
                     rematerialised layers (the embedding table's row lookup is counted the same way)
      grad_rs        its gradient reduce-scatter over G: S (g-1)/g
      grad_ar        all-reduce over the token axes the parameter is replicated on (e.g. data):
                     2 S_shard (r-1)/r
      expert_a2a     per MoE layer rows of width W each way: dispatch + return forward, their two
                     transposes backward, and the forward again under remat: 4 or 6 x rows W a (P-1)/P
                     (plus the int32 expert ids of each dispatch); rows = the padded buffer P C, or
                     with the ragged all-to-all the N k routes themselves (remote share (P-1)/P under
                     uniform routing); `FFN_ALL_TO_ALL` (`k3.moe.cost.moe_all_to_all_bytes`)
      tensor         per layer (tensor > 1): all-reduce of the mixer output, of the FFN output (dense;
                     MoE: shared expert and latent up-projection) N D a each, the routed experts'
                     partial sums N k W a when their hidden width is split, the all-gather of the latent
                     input N W a (the FFN's terms: `FFN_TENSOR_PARALLEL`); the same again backward and
                     under remat; LM head and embedding one all-reduce of N D a each way
      context        per KDA layer the all-gather of the state pairs b H K (K+V) fp32: (cp-1) x sent;
                     per MLA layer of k and v b t H (d_qk + d_v) a (`CONTEXT_GATHERS`); backward
                     reduce-scatters the same; again under remat
    Returns a list of {'what', 'bytes', 'seconds', 'axes'}.
    """
    m = cfg.model
    a = np.dtype(m.dtype).itemsize
    kinds_l, (head, (start, period, repeats), tail) = _layers(m)
    sizes = sharder.mesh.shape
    rows: dict[tuple[str, tuple], float] = {}
    kinds: dict[str, str] = {}

    def add(what, axes, nbytes, kind="ring"):
        """Accumulates ``nbytes`` sent by collective ``what`` over mesh ``axes``."""
        rows[(what, axes)] = rows.get((what, axes), 0.0) + nbytes
        kinds[what] = kind

    acc = lay.accum
    comm = param_comm(infos, sharder, lay) if comm is None else comm
    grouped: dict[tuple, float] = {}  # (gather, keep, reduce, passes) -> elements
    for p, (gather, keep, reduce) in zip(infos, comm):
        key = (gather, keep, reduce, 2 if (remat and p.region != "top") else 1)
        grouped[key] = grouped.get(key, 0.0) + p.elems
    for (gather, keep, reduce, times), elems in grouped.items():
        g, r = _shards(sharder, gather), _shards(sharder, reduce)
        full = elems / keep * a
        if g > 1:
            add("FSDP all-gather of parameters", gather, acc * times * full * (g - 1) / g)
            add("gradient reduce-scatter", gather, acc * full * (g - 1) / g)
        if r > 1:
            add("gradient all-reduce (replicated axes)", reduce, acc * 2 * full / g * (r - 1) / r)
    N, D = lay.tokens, m.d_model
    tp = sharder.size("tensor")
    mixers, ffns = {mx for mx, _ in kinds_l}, {f for _, f in kinds_l}
    gathered = {kind: CONTEXT_GATHERS[kind](m, lay, a) for kind in mixers}
    ffn_tensor = {kind: FFN_TENSOR_PARALLEL[kind](m, lay, a, tp) for kind in ffns} if tp > 1 else {}
    a2a = tensor = context = 0.0
    for i, (mixer, ffn) in enumerate(kinds_l):
        passes = 3 if remat else 2  # forward, backward (+ recomputed forward)
        if ffn in FFN_ALL_TO_ALL and lay.P > 1:
            a2a += FFN_ALL_TO_ALL[ffn](m, lay, a, passes)
        if tp > 1:
            ar = 2 * (tp - 1) / tp
            vol = N * D * a * ar  # the mixer output
            for nbytes in ffn_tensor[ffn]:
                vol += nbytes
            tensor += passes * vol
        if lay.cp > 1:
            context += passes * gathered[mixer] * (lay.cp - 1)
    if a2a:
        add("expert all-to-all (dispatch + return)", lay.expert_axes, acc * a2a, "a2a")
    if tensor:
        add("tensor-parallel activations", ("tensor",), acc * tensor)
    if context:
        add("context-parallel gathers", lay.context_axes, acc * context)
    if tp > 1:
        add("tensor-parallel activations", ("tensor",), acc * 2 * 2 * N * D * a * 2 * (tp - 1) / tp)
    merged: dict[tuple[str, tuple], float] = {}
    for (what, axes), nbytes in rows.items():
        key = (what, tuple(x for x in MESH_AXES if x in axes))
        merged[key] = merged.get(key, 0.0) + nbytes
    out = []
    for (what, axes), nbytes in merged.items():
        out.append({"what": what, "axes": list(axes), "bytes": nbytes,
                    "seconds": collective_seconds(nbytes, sizes, axes, device, kinds[what])})
    order = ["FSDP", "gradient r", "gradient a", "expert", "tensor", "context"]
    out.sort(key=lambda r: next(i for i, o in enumerate(order) if r["what"].startswith(o)))
    return out


# ---------------------------------------------------------------------------------------------
# The plan


@dataclasses.dataclass
class PlanInputs:
    """What a plan needs from a config once, independent of the mesh (abstract shapes, counts)."""

    cfg: object
    infos: list
    opt_leaves: list
    counts: dict
    _flops: dict = dataclasses.field(default_factory=dict)

    def flops(self, seq: int) -> dict:
        """`k3.params.flops_per_token` at context ``seq`` (cached)."""
        if seq not in self._flops:
            self._flops[seq] = flops_per_token(self.cfg.model, seq, self.counts)
        return self._flops[seq]


def load_model(cfg) -> PlanInputs:
    """Abstract model and optimizer state of ``cfg`` (validated); nothing is allocated."""
    validate(cfg)
    model = abstract_model(cfg.model)
    params = nnx.state(model, nnx.Param)
    infos = param_infos(params, cfg.optim.per_head_muon)
    return PlanInputs(cfg, infos, optimizer_leaves(cfg, params, infos), count_params(cfg.model))


def plan(mdl: PlanInputs, sizes: Mapping[str, int], device: Device | str, *, batch: int | None = None,
         seq: int | None = None, remat: bool | None = None, mfu: float = 0.4, headroom: float = 0.10,
         capacity_factor: float | None = None, rule_overrides: str | None = None) -> dict:
    """The full per-device plan of ``mdl`` on a mesh of ``sizes``: memory, collectives, time, verdict.

    ``batch`` global sequences per step (default: the config's, or one sequence per batch shard and
    micro-batch when the config's does not divide over the mesh), ``seq`` tokens per sequence (default
    data.seq_len), ``remat`` (default model.remat), ``mfu`` model-FLOP utilisation assumed for the
    compute time, ``headroom`` the fraction of device memory kept free for XLA's buffers and
    fragmentation, ``capacity_factor`` overrides model.moe.capacity_factor and ``rule_overrides``
    mesh.rule_overrides. All bytes are per device.
    """
    cfg = mdl.cfg
    m = cfg.model
    dev = DEVICES[device] if isinstance(device, str) else device
    rules = parse_rules(cfg.mesh.rule_overrides if rule_overrides is None else rule_overrides)
    sh = plan_sharder(sizes, rules)
    n_dev = sh.mesh.size
    notes = []
    seq = int(seq or cfg.data.seq_len)
    accum = cfg.optim.grad_accum
    batch_devices = _shards(sh, sh.axes_for("batch"))
    if batch is None:
        batch = cfg.data.batch_size
        if (batch // accum) % batch_devices or batch % accum:
            batch = batch_devices * accum
            notes.append(f"data.batch_size={cfg.data.batch_size} does not split over the {batch_devices} batch "
                         f"shards: planned with --batch={batch} (one sequence per device per micro-batch)")
    lay = make_layout(cfg, sh, int(batch), seq, capacity_factor, platform=dev.platform)
    remat = bool(m.remat) if remat is None else bool(remat)
    a = np.dtype(m.dtype).itemsize
    kinds, (_, (_, _, repeats), _) = _layers(m)

    resolved = _resolve(mdl.infos, sh, lay.token_axes)
    shards = [r[0] for r in resolved]
    comm_info = [r[1:] for r in resolved]
    pb = param_bytes(mdl.infos, sh, shards)
    ob = optimizer_bytes(mdl.opt_leaves, mdl.infos, sh, shards)
    grads = pb["total"] * (1 if accum == 1 else 2)
    # Without remat the backward frees each layer's residuals as it makes that layer's gradients, so
    # the activations' peak (at the turn from forward to backward) does not hold this micro-batch's
    # gradients; it holds the running sum under accumulation. With remat each recomputed group's
    # working set comes on top of the gradients made so far.
    grads_at_peak = grads if remat else grads - pb["total"]
    gbuf = gather_buffer_bytes(mdl.infos, comm_info, a, repeats)
    casts = (sum(pb["per_param"][p.name] * a / np.dtype(p.dtype).itemsize for p in mdl.infos)
             if remat and m.remat_policy in SAVES_WEIGHT_CASTS else 0.0)
    act = activation_estimate(cfg, lay, remat, gbuf, casts)
    rest = router_bias_bytes(m.moe) * sum(1 for _, f in kinds if f == "moe")
    ns = (muon_work(mdl.infos, shards, np.dtype(cfg.optim.mu_dtype).itemsize) if cfg.optim.name == "muon"
          else {"flops": 0.0, "transient": 0.0, "largest": 0.0})
    # The update runs after the backward has freed the activations: the larger of the two peaks counts.
    total = pb["total"] + ob["total"] + rest + max(grads_at_peak + act["peak"], grads + ns["transient"])
    usable = dev.memory_bytes * (1 - headroom)

    comm = collective_estimate(cfg, mdl.infos, sh, lay, remat, dev, comm_info)
    fpt = mdl.flops(seq)
    step_tokens = batch * seq
    device_tokens = lay.micro * accum * lay.t
    tp = sh.size("tensor")
    hw_factor = 4 / 3 if act["remat_effective"] else 1.0
    model_flops = fpt["full"] * device_tokens / tp
    compute_s = model_flops * hw_factor / (dev.bf16_flops * mfu)
    # Once per update, whatever the tokens: at small batches it rivals the model's own FLOPs.
    optimizer_s = ns["flops"] / (dev.bf16_flops * mfu)
    comm_s = sum(r["seconds"] for r in comm)
    step_overlap, step_serial = max(compute_s, comm_s) + optimizer_s, compute_s + comm_s + optimizer_s

    if lay.P > 1 and (m.moe.capacity_factor if capacity_factor is None else capacity_factor) <= 0:
        what = ("pads every all-to-all to" if lay.dispatch == "padded"
                else "sizes every all-to-all's receive buffer for")
        notes.append(f"dropless expert parallelism {what} C = N k = {lay.C:,} rows per source device "
                     f"(x {lay.P}); a capacity factor (model.moe.capacity_factor) shrinks the buffers by "
                     "about P / c")
    score_bytes = mla_scores(m, lay) * MLA_SCORE_BYTES
    if lay.attention == "xla" and any(k == "mla" for k, _ in kinds) and score_bytes > 0.05 * dev.memory_bytes:
        notes.append("MLA attention runs XLA's softmax path (model.mla.attention_impl), which keeps the "
                     "[B, H, T, S] scores for the backward "
                     f"({MLA_SCORE_BYTES:.0f} B per score): {lay.micro} x {m.mla.n_heads // lay.mla_heads_div} "
                     f"x {lay.t} x {lay.seq} per MLA layer")
    if lay.kda_core != "pallas" and any(k == "kda" for k, _ in kinds):
        K, C = m.kda.head_dim, m.kda.chunk_size
        pallas = KDA_LAYER_BYTES["pallas"] + kda_pallas_core_bytes(C, K, 2)  # bf16, Pallas core and conv kernels
        notes.append(f"KDA runs the jnp {lay.kda_core} core (model.kda.impl={m.kda.impl}), which keeps about "
                     f"{kda_chunk_layer_bytes(C, K):.0f} B per element of N H K for the backward; the Pallas "
                     f"kernels keep about {pallas:.0f} in bf16")
    if lay.cp > 1 and not any("context" in g for g, _, _ in comm_info):
        notes.append("no parameter is sharded over context: every context rank holds the full FSDP shard; "
                     f"--config.mesh.rule_overrides={context_fsdp_overrides(cfg.mesh.rule_overrides)} "
                     "would shard them (ZeRO over the context ranks too)")
    if grads + ns["transient"] > grads_at_peak + act["peak"]:
        notes.append(f"the optimizer update's transient ({ns['transient'] / GB:.1f} GB) decides the total, not the "
                     f"activations ({act['peak'] / GB:.1f} GB): it counts every matrix's Newton-Schulz in flight at "
                     "once (the H200 compile of K2 1024:12's update keeps 0.27 of that); the largest single parameter's "
                     f"share is {ns['largest'] / GB:.1f} GB")
    big_rep = [(b, n) for b, n in pb["replicated"] if b >= 2**20]
    return {
        "name": cfg.name, "device": dev.description, "device_key": device if isinstance(device, str) else "",
        "mesh": dict(sh.mesh.shape), "devices": n_dev,
        "nodes": math.ceil(n_dev / dev.devices_per_node),
        "batch": batch, "seq": seq, "micro_batch": lay.micro, "grad_accum": accum, "local_seq": lay.t,
        "tokens_per_step": step_tokens, "tokens_per_device_step": device_tokens,
        "param_dtype": "/".join(sorted({p.dtype for p in mdl.infos})),
        "compute_dtype": m.dtype, "remat": act["remat_effective"], "optimizer": cfg.optim.name,
        "capacity_factor": m.moe.capacity_factor if capacity_factor is None else capacity_factor,
        "expert_shards": lay.P, "a2a_rows_per_destination": lay.C, "ep_dispatch": lay.dispatch,
        "total_params": mdl.counts["total_params"], "active_params": mdl.counts["active_params"],
        "memory": {
            "params": pb["total"], "optimizer": ob["total"], "optimizer_muon": ob["muon"],
            "optimizer_adam": ob["adam"], "optimizer_other": ob["other"], "gradients": grads,
            "activations": act["peak"], "optimizer_transient": ns["transient"], "router_biases": rest,
            "total": total,
            "device": dev.memory_bytes, "headroom": headroom, "usable": usable,
            "activation_terms": {k: act[k] for k in ("carries", "kept_layers", "kept_weights", "kept_inputs",
                                                     "working_set", "transient", "lm_head")},
            "per_layer_kind": act["by_kind"],
        },
        "fits": bool(total <= usable),
        "largest_replicated": [{"param": n, "bytes": b} for b, n in big_rep[:5]],
        "replicated_bytes": sum(b for b, _ in pb["replicated"]),
        "collectives": comm,
        "time": {"flops_per_token": fpt["full"], "model_flops_per_device": model_flops, "mfu": mfu,
                 "remat_recompute_factor": hw_factor, "compute_s": compute_s, "comm_s": comm_s,
                 "newton_schulz_flops_per_device": ns["flops"], "optimizer_s": optimizer_s,
                 "step_s_overlapped": step_overlap, "step_s_serial": step_serial,
                 "tokens_per_s": step_tokens / step_serial if step_serial else 0.0},
        "notes": notes,
    }


def _count(n: float) -> str:
    return f"{n / 1e9:,.1f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M"


def _gb(x: float) -> str:
    return f"{x / GB:9.2f}"


def format_plan(p: dict) -> str:
    """The plan as a readable table (GB = 1e9 bytes)."""
    mem, t = p["memory"], p["time"]
    mesh = " ".join(f"{a}={s}" for a, s in p["mesh"].items())
    lines = [
        f"k3.plan: {p['name']} on {p['devices']} x {p['device']} ({p['nodes']} node(s)); all numbers are "
        f"per device and ESTIMATES",
        f"  mesh        {mesh}",
        f"  batch       {p['batch']} sequences x {p['seq']} tokens = {p['tokens_per_step'] / 1e6:.2f}M tokens/step; "
        f"per device {p['micro_batch']} x {p['local_seq']} tokens per micro-batch, grad_accum {p['grad_accum']}",
        f"  model       {_count(p['total_params'])} parameters ({_count(p['active_params'])} active), "
        f"stored {p['param_dtype']}, compute {p['compute_dtype']}, remat={'full' if p['remat'] else 'none'}, "
        f"optimizer {p['optimizer']}",
    ]
    if p["expert_shards"] > 1:
        cf = p["capacity_factor"]
        lines.append(f"  experts     {p['expert_shards']} expert shards, {p['ep_dispatch']} all-to-all, rows per "
                     f"destination C = {p['a2a_rows_per_destination']:,} "
                     f"({'dropless' if cf <= 0 else f'capacity factor {cf}'})")
    at = mem["activation_terms"]

    def row(label, value, extra=""):
        """One table line: label, GB, optional remark."""
        return f"    {label:<48}{_gb(value)}{extra}"

    lines += [
        "",
        f"    {'memory per device':<48}{'GB':>9}",
        row(f"parameters ({p['param_dtype']}, sharded)", mem["params"]),
        row("optimizer state", mem["optimizer"], f"   (Muon momentum {mem['optimizer_muon'] / GB:.2f}, "
                                                 f"AdamW moments {mem['optimizer_adam'] / GB:.2f})"),
        row("gradients", mem["gradients"], "" if p["remat"] else
            "   (without remat made as the backward frees the activations; only an accumulation's sum adds to them)"),
        row("activations (estimate)", mem["activations"]),
        row("  saved layer inputs (scan carries, unrolled)", at["carries"]),
        row("  unrematerialised layers' residuals", at["kept_layers"]),
        row("  kept compute-dtype weights", at["kept_weights"]),
        row("  kept KDA inputs, expert products", at["kept_inputs"]),
        row("  one layer group's backward working set", at["working_set"]),
        row("  largest transient (a2a buffers, scores)", at["transient"]),
        row("  LM head and loss (alternative peak)", at["lm_head"]),
        *(f"      one {kind} layer: {r['total'] / GB:.2f} GB ("
          + ", ".join(f"{t} {v / GB:.2f}" for t, v in r.items() if t not in ("total", "transient"))
          + ")" for kind, r in mem["per_layer_kind"].items()),
        row("optimizer update's transient (Newton-Schulz)", mem["optimizer_transient"],
            "   (after the backward: the larger of it and the activations counts)"),
        row("router biases", mem["router_biases"]),
        row("total", mem["total"]),
        row(f"device memory {mem['device'] / GB:.1f} GB, usable with {mem['headroom']:.0%} headroom", mem["usable"]),
    ]
    verdict = "FITS" if p["fits"] else "DOES NOT FIT"
    lines.append(f"  verdict: {verdict} ({mem['total'] / GB:.1f} GB of {mem['usable'] / GB:.1f} GB usable, "
                 f"{mem['total'] / mem['usable']:.0%})")
    if p["largest_replicated"]:
        lines.append(f"  fully replicated parameters: {p['replicated_bytes'] / GB:.3f} GB in all; largest:")
        for r in p["largest_replicated"]:
            lines.append(f"    {r['param']:<60} {r['bytes'] / GB:8.3f} GB")
    lines += ["", f"    {'collectives per step per device (estimate)':<48}{'GB sent':>9}   {'axes':<20} {'seconds':>8}"]
    for r in p["collectives"]:
        lines.append(f"    {r['what']:<48}{_gb(r['bytes'])}   {'+'.join(r['axes']):<20} {r['seconds']:8.3f}")
    lines += [
        f"    {'total':<48}{_gb(sum(r['bytes'] for r in p['collectives']))}   {'':<20} {t['comm_s']:8.3f}",
        "",
        f"  compute (estimate): {t['flops_per_token'] / 1e9:.0f} GFLOP/token (6N + attention, k3.params 'full') x "
        f"{p['tokens_per_device_step']:,} tokens / tensor {p['mesh']['tensor']}"
        f"{' x 4/3 recompute' if t['remat_recompute_factor'] > 1 else ''} at {t['mfu']:.0%} MFU: "
        f"{t['compute_s']:.3f} s",
        f"  optimizer (estimate): {t['newton_schulz_flops_per_device'] / 1e12:.2f} TFLOP of Newton-Schulz per update "
        f"at {t['mfu']:.0%} MFU: {t['optimizer_s']:.3f} s",
        f"  step time (estimate): {t['step_s_overlapped']:.3f} s with communication fully overlapped, "
        f"{t['step_s_serial']:.3f} s with none ({t['tokens_per_s'] / 1e6:.2f}M tokens/s)",
    ]
    for n in p["notes"]:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Mesh search


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_meshes(n_devices: int, n_experts: int, tensors=(1, 2, 4, 8), contexts=(1,)) -> list[dict[str, int]]:
    """Meshes of ``n_devices`` over (data, fsdp, expert, context in ``contexts``, tensor in
    ``tensors``) with expert dividing ``n_experts``."""
    out = []
    for cp in contexts:
        for tp in tensors:
            if n_devices % (tp * cp):
                continue
            rest = n_devices // (tp * cp)
            for ep in _divisors(rest):
                if n_experts % ep:
                    continue
                for dp in _divisors(rest // ep):
                    out.append({"data": dp, "fsdp": rest // ep // dp, "expert": ep, "context": cp, "tensor": tp})
    return out


def context_fsdp_overrides(overrides: str = "") -> str:
    """``overrides`` extended so that every parameter axis that FSDP shards is sharded over
    ``context`` as well (ZeRO over the sequence-parallel devices too, which otherwise hold full
    replicas of what FSDP splits); '' when the rules already do so."""
    rules = dict(parse_rules(overrides))
    extra = []
    for name, axes in rules.items():
        if name in ("batch", "seq") or name.startswith("act_"):
            continue
        if "fsdp" in axes and "context" not in axes:
            extra.append(f"{name}={'+'.join(axes + ('context',))}")
    if not extra:
        return ""
    return ",".join(filter(None, [overrides] + extra))


def suggest(mdl: PlanInputs, n_devices: int, device: str, *, batch: int | None = None, seq: int | None = None,
            remat: bool | None = None, mfu: float = 0.4, headroom: float = 0.10,
            capacity_factor: float | None = None, contexts=(1,), rule_overrides: str | None = None) -> dict:
    """Plans every `candidate_meshes` mesh; returns {'fitting': plans ranked by tokens/s (serial
    estimate), 'closest': the least over-full plans, 'skipped': meshes the batch or sequence does
    not divide, 'candidates': how many meshes were tried}."""
    plans, skipped = [], 0
    for sizes in candidate_meshes(n_devices, mdl.cfg.model.moe.n_experts, contexts=contexts):
        try:
            plans.append(plan(mdl, sizes, device, batch=batch, seq=seq, remat=remat, mfu=mfu,
                              headroom=headroom, capacity_factor=capacity_factor, rule_overrides=rule_overrides))
        except PlanError:
            skipped += 1
    fitting = sorted((p for p in plans if p["fits"]), key=lambda p: -p["time"]["tokens_per_s"])
    closest = sorted(plans, key=lambda p: p["memory"]["total"])
    return {"fitting": fitting, "closest": closest, "skipped": skipped, "candidates": len(plans) + skipped}


def format_suggest(res: dict, n_devices: int, device: str, top: int, label: str = "") -> str:
    """A ranked table of the best fitting meshes (or the closest ones when none fits)."""
    dev = DEVICES[device]
    fits = res["fitting"]
    head = (f"launch.plan --suggest: {n_devices} x {dev.description}{label}: {len(fits)} of {res['candidates']} "
            f"meshes fit ({res['skipped']} skipped: batch or sequence not divisible)")
    rows = fits[:top] if fits else res["closest"][:top]
    lines = [head, "  " + ("best by estimated throughput (no overlap):" if fits else
                           "NONE FITS; the least over-full meshes:")]
    lines.append(f"    {'data':>5} {'fsdp':>5} {'expert':>6} {'context':>7} {'tensor':>6}  {'batch':>6}  {'mem GB':>7} "
                 f"{'of usable':>9}  {'step s':>7}  {'comm s':>7}  {'Mtok/s':>7}")
    for p in rows:
        m, mem, t = p["mesh"], p["memory"], p["time"]
        lines.append(f"    {m['data']:>5} {m['fsdp']:>5} {m['expert']:>6} {m['context']:>7} {m['tensor']:>6}  "
                     f"{p['batch']:>6}  {mem['total'] / GB:7.1f} {mem['total'] / mem['usable']:9.0%}  "
                     f"{t['step_s_serial']:7.2f}  {t['comm_s']:7.2f}  {t['tokens_per_s'] / 1e6:7.2f}")
    if fits:
        b = fits[0]
        mesh = ",".join(f"{a}:{s}" for a, s in b["mesh"].items() if s > 1)
        lines.append(f"  suggested: --mesh={mesh} (--batch={b['batch']}); FITS at "
                     f"{b['memory']['total'] / GB:.1f} GB of {b['memory']['usable'] / GB:.1f} GB usable")
    else:
        lines.append(f"  verdict: DOES NOT FIT on {n_devices} x {device} under these settings")
    return "\n".join(lines)
