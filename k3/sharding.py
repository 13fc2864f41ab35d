"""Device mesh and logical-axis sharding rules.

Model code names only logical axes: every parameter carries them in its ``out_sharding`` metadata
(``embed``, ``heads``, ``experts`` ...; see `k3.nn.param`) and activations are constrained with
`constrain` under names such as ``batch`` and ``seq``. This module maps those names onto a device
mesh with one rules table, kept as data (`DEFAULT_RULES`): each logical name lists the mesh axes
that may shard it, in order of preference.

Resolution of one array (`spec`): for each dimension, take its logical name's mesh axes in order,
skipping an axis that is size 1, already used by an earlier dimension of the same array, or whose
size (times the axes already taken for that dimension) does not divide the dimension. So a rule is
a preference, not a promise: a 97-token vocabulary stays replicated on a 2-way tensor axis, and
`check_sharded` says when that leaves a large parameter replicated by mistake.

Mesh axes (the config's ``mesh`` section; sizes, -1 fills the rest):
  data     pure data parallelism: batch split, parameters replicated
  fsdp     batch split and parameters/optimizer state sharded (ZeRO-3: gathered at use); the
           context and expert axes shard the dense parameters the same way
  tensor   attention heads, MLP and expert hidden width, vocabulary
  expert   routed experts (tokens travel to them by all-to-all, `k3.moe.expert_parallel`); the batch is
           split over it too, so dense layers see it as data parallelism
  context  the sequence (`k3.kda.parallel`: KDA state pairs; `k3.mla.parallel`: MLA gathered keys/values)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")

# logical name -> mesh axes that may shard it, in order of preference. Parameters and activations
# share the table; activation-only names start with 'act_' where a parameter name would shard differently.
DEFAULT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # activations
    ("batch", ("data", "fsdp", "expert")),
    ("seq", ("context",)),
    ("act_embed", ()),
    ("act_heads", ("tensor",)),
    ("act_vocab", ("tensor",)),
    # parameters
    ("layers", ()),
    ("vocab", ("tensor",)),
    # Dense parameters are sharded over every axis that splits the tokens but not the parameter
    # (ZeRO-3 over fsdp, then context and expert ranks), gathered at use.
    ("embed", ("fsdp", "context", "expert")),
    ("heads", ("tensor",)),
    ("head_dim", ()),
    ("mlp", ("tensor",)),
    ("q_lora", ("fsdp", "context", "expert")),
    ("kv_lora", ("fsdp", "context", "expert")),
    ("decay_rank", ("fsdp", "context", "expert")),
    ("conv", ()),
    ("norm", ()),
    ("latent", ("tensor",)),
    ("experts", ("expert",)),
    ("expert_embed", ("fsdp", "context")),
    ("expert_mlp", ("tensor",)),
)


def parse_rules(overrides: str = "", base=DEFAULT_RULES) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The rules table with overrides applied: 'name=axis+axis,name=' ('' maps a name to nothing)."""
    rules = dict(base)
    for item in filter(None, (s.strip() for s in overrides.split(","))):
        if "=" not in item:
            raise ValueError(f"mesh.rule_overrides entry {item!r} is not 'logical=axis+axis'")
        name, axes = (s.strip() for s in item.split("=", 1))
        axes_t = tuple(a for a in axes.split("+") if a)
        bad = [a for a in axes_t if a not in MESH_AXES]
        if bad:
            raise ValueError(f"mesh.rule_overrides: unknown mesh axis {bad[0]!r} for {name!r}; "
                             f"mesh axes are {MESH_AXES}")
        rules[name] = axes_t
    return tuple(rules.items())


def mesh_shape(mesh_cfg, n_devices: int) -> dict[str, int]:
    """Axis sizes from the config's ``mesh`` section for ``n_devices`` devices (-1 fills the rest)."""
    sizes = {a: int(mesh_cfg[a]) for a in MESH_AXES}
    fill = [a for a, s in sizes.items() if s == -1]
    bad = [a for a, s in sizes.items() if s == 0 or s < -1]
    if bad:
        raise ValueError(f"mesh.{bad[0]} must be a positive size or -1, got {sizes[bad[0]]}")
    if len(fill) > 1:
        raise ValueError(f"only one mesh axis may be -1, got {', '.join('mesh.' + a for a in fill)}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if fill:
        if n_devices % known:
            raise ValueError(f"mesh.{fill[0]}=-1: {n_devices} devices are not a multiple of the other "
                             f"axes' product {known}")
        sizes[fill[0]] = n_devices // known
    if math.prod(sizes.values()) != n_devices:
        raise ValueError(f"mesh {sizes} has {math.prod(sizes.values())} devices but {n_devices} are "
                         f"available; set one axis to -1 or make the sizes multiply to {n_devices}")
    return sizes


def make_mesh(mesh_cfg, devices: Sequence | None = None) -> Mesh:
    """The one device mesh of a run, axes in `MESH_AXES` order (innermost = tensor, the fastest link).

    Axis types are Auto: XLA propagates shardings from the parameters, the inputs and `constrain`.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_shape(mesh_cfg, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


@dataclasses.dataclass(frozen=True)
class Sharder:
    """A mesh plus the rules table: resolves logical axes to shardings. Hashable, so a model can
    hold it as a static attribute (a different mesh is then a different compiled program)."""

    mesh: Mesh
    rules: tuple[tuple[str, tuple[str, ...]], ...] = DEFAULT_RULES

    def size(self, axis: str) -> int:
        """Size of one mesh axis (1 for an axis the mesh lacks)."""
        return int(self.mesh.shape.get(axis, 1))

    def axes_for(self, name: str | None) -> tuple[str, ...]:
        """The mesh axes that shard logical ``name`` (size-1 axes dropped), ignoring divisibility."""
        if name is None:
            return ()
        table = dict(self.rules)
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no sharding rule; add it to k3.sharding.DEFAULT_RULES")
        return tuple(a for a in table[name] if self.size(a) > 1)

    def spec(self, axes: Sequence[str | None], shape: Sequence[int] | None = None) -> P:
        """PartitionSpec for an array with logical ``axes`` (and ``shape``, to check divisibility)."""
        used: set[str] = set()
        out = []
        for i, name in enumerate(axes):
            taken, prod = [], 1
            for a in self.axes_for(name):
                if a in used or (shape is not None and shape[i] % (prod * self.size(a))):
                    continue
                taken.append(a)
                prod *= self.size(a)
            used.update(taken)
            out.append(None if not taken else taken[0] if len(taken) == 1 else tuple(taken))
        return P(*out)

    def sharding(self, axes: Sequence[str | None], shape: Sequence[int] | None = None) -> NamedSharding:
        """NamedSharding for an array with logical ``axes``."""
        return NamedSharding(self.mesh, self.spec(axes, shape))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())


def spec_axes(entry) -> tuple[str, ...]:
    """One PartitionSpec entry (None, an axis name or a tuple of them) as a tuple of axis names."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _axes_size(mesh, axes):
    return math.prod(mesh.shape[a] for a in axes)


def _check_divisible(what, size, mesh, axes):
    n = _axes_size(mesh, axes)
    if size % n:
        raise ValueError(f"{what} = {size} is not divisible by the size {n} of mesh axes {tuple(axes)}")


def context_parallel_specs(mesh, B, T, H, batch_axes, head_axis, context_axis):
    """(batch spec entry, head spec entry) after checking that B, T and H divide over their axes.

    Shared by the context-parallel shard_map wrappers of KDA and MLA (`k3.kda.parallel`,
    `k3.mla.parallel`), which split [B, T, H, ...] activations over (batch_axes, context_axis, head_axis).
    """
    batch_axes = tuple(batch_axes)
    if context_axis not in mesh.shape:
        raise ValueError(f"context axis {context_axis!r} is not a mesh axis {tuple(mesh.axis_names)}")
    _check_divisible("sequence length T", T, mesh, (context_axis,))
    _check_divisible("batch size B", B, mesh, batch_axes)
    head_axes = () if head_axis is None else (head_axis,)
    _check_divisible("number of heads H", H, mesh, head_axes)
    return (batch_axes or None), head_axis


def constrain(x: jax.Array, axes: Sequence[str | None], sharder: Sharder | None) -> jax.Array:
    """``with_sharding_constraint`` by logical axes; the identity without a sharder (one device)."""
    if sharder is None:
        return x
    return jax.lax.with_sharding_constraint(x, sharder.sharding(axes, x.shape))


def variable_axes(var) -> tuple | None:
    """Logical axes of an ``nnx.Variable`` (its ``out_sharding`` metadata) or None."""
    axes = var.get_metadata().get("out_sharding")
    if axes is None or len(axes) != len(var.shape):
        return None
    return tuple(axes)


def state_shardings(state, sharder: Sharder):
    """A pytree of NamedShardings matching an ``nnx.State`` (abstract or concrete), by logical axes.

    Variables without logical axes (and scalars) are replicated.
    """
    from flax import nnx

    def one(var):
        axes = variable_axes(var)
        sh = sharder.sharding(axes, var.shape) if axes is not None else sharder.replicated()
        return var.replace(sh) if isinstance(var, nnx.Variable) else sh

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def tree_shardings_like(tree, params_pure: dict, params_shardings_pure: dict, sharder: Sharder):
    """Shardings for a tree (an optimizer state) whose leaves mirror the parameters: a leaf whose
    key path ends with a parameter's path and has its shape takes that parameter's sharding;
    anything else (step counts, scalars) is replicated."""
    from flax.nnx import traversals

    flat_params = traversals.flatten_mapping(params_pure)
    flat_sh = traversals.flatten_mapping(params_shardings_pure)
    by_suffix = {}
    for path, leaf in flat_params.items():
        by_suffix[tuple(str(p) for p in path)] = (tuple(np.shape(leaf)), flat_sh[path])

    def key_str(k):
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)

    def one(path, leaf):
        names = tuple(key_str(k) for k in path)
        shape = tuple(np.shape(leaf))
        for start in range(len(names)):
            hit = by_suffix.get(names[start:])
            if hit is not None and hit[0] == shape:
                return hit[1]
        return sharder.replicated()

    return jax.tree_util.tree_map_with_path(one, tree)


def check_sharded(state, shardings, *, min_size: int = 2**16, tolerance: float = 0.02) -> None:
    """Fails fast when parameters are left replicated by mistake on a multi-device mesh.

    Raises ValueError when the replicated parameters of at least ``min_size`` elements hold more
    than ``tolerance`` of all parameter elements (the fraction MaxText checks), naming the largest.
    Norm gains, biases and other small vectors are expected to be replicated and do not count.
    """
    leaves = jax.tree.leaves(state)
    shard_leaves = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    if len(leaves) != len(shard_leaves):
        raise ValueError("state and shardings do not match")
    mesh_devices = shard_leaves[0].mesh.size if shard_leaves else 1
    if mesh_devices == 1:
        return
    total = 0
    replicated = []
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
    for path, leaf, sh in zip(paths, leaves, shard_leaves):
        size = int(np.prod(np.shape(leaf)))
        total += size
        if size >= min_size and sh.is_fully_replicated:
            replicated.append((size, path))
    rep = sum(s for s, _ in replicated)
    if total and rep / total > tolerance:
        replicated.sort(reverse=True)
        names = ", ".join(f"{p} ({s:,})" for s, p in replicated[:5])
        raise ValueError(f"{rep / total:.1%} of the parameters are fully replicated on a "
                         f"{mesh_devices}-device mesh (tolerance {tolerance:.0%}); largest: {names}. "
                         f"Check mesh sizes against the model's dimensions or mesh.rule_overrides")


def batch_sharding(sharder: Sharder, ndim: int = 2) -> NamedSharding:
    """Sharding of an input batch [B, T, ...]: batch over the batch axes, sequence over context."""
    return NamedSharding(sharder.mesh, sharder.spec(("batch", "seq") + (None,) * (ndim - 2)))


def describe(sharder: Sharder) -> str:
    """One line: the mesh's non-trivial axes."""
    parts = [f"{a}={sharder.size(a)}" for a in MESH_AXES if sharder.size(a) > 1]
    return "mesh " + (" x ".join(parts) if parts else "1 device")
