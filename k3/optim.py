"""Optimizers: Muon for weight matrices + AdamW for the rest (K2/K3), or AdamW everywhere.

Learning rate: linear warmup, then cosine decay or WSD (stable, then a 1 - sqrt cooldown); see
:func:`learning_rate_schedule`.

Muon vs AdamW is decided from each parameter's logical axes (``out_sharding`` metadata, see
`k3.nn.param`), see :func:`param_dimension_numbers`. Leading ``layers`` (scanned stacks) and
``experts`` (routed experts) axes are batch axes: Newton–Schulz runs on every layer's and every
expert's matrix separately. With ``optim.per_head_muon`` the attention Q/K/V projections also batch
over ``heads`` (K3's Per-Head Muon: each head's block is orthogonalised on its own).

Pytree form. ``optax.contrib.muon`` matches its dimension-numbers tree against the parameter
tree leaf by leaf, and ``nnx.Param`` nodes (which carry their metadata in the tree structure) do
not line up with a tree of ``MuonDimensionNumbers``. So the optax chain runs on the *pure-dict*
form of the parameters (``nnx.to_pure_dict``: nested dicts of plain arrays), and the ``tx``
returned by :func:`build_optimizer` is wrapped to convert at its boundary. A train step passes
exactly what ``nnx.split(model, nnx.Param, ...)`` returns::

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx, schedule = build_optimizer(cfg, params)
    opt_state = tx.init(params)
    ...
    grads = jax.grad(loss_fn)(params)                       # an nnx.State of nnx.Param, like params
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)           # updates: same State-of-Param structure

Pure dicts are accepted as well (then the updates come back as a pure dict). The optimizer state
itself holds pure dicts (plain arrays), which checkpoint without any NNX types.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx import traversals

from k3 import muon as muon_lib

MuonDimensionNumbers = optax.contrib.MuonDimensionNumbers

# Axes that index independent matrices when they lead the shape: scanned layer stacks and routed
# experts. Only a *leading* run counts: the router's [embed, experts] has experts as its output
# dimension, a real matrix axis.
BATCH_AXES = ("layers", "experts")
# Axes that mark the model-width side of an output projection ([H, K, D], [F, D], experts' [F, W]).
EMBED_AXES = ("embed", "expert_embed")
# Q/K/V projections that Per-Head Muon orthogonalises one head block at a time (KDA; MLA).
PER_HEAD_PARAMS = ("w_q", "w_k", "w_v", "q_b", "kv_b")


# ---------------------------------------------------------------------------------------------
# Gradient clipping


def global_norm(tree) -> jax.Array:
    """The L2 norm of all of ``tree``'s leaves together (fp32 scalar), as ``optax.tree.norm``.

    Leaves of one shape and dtype, each of at most `muon_lib.GROUP_MAX_ELEMS` elements (the bound
    `muon_lib.newton_schulz_grouped` groups by), are stacked and reduced together: a model's layers
    repeat their shapes, and a reduction per leaf is an XLA kernel per leaf (238 of them in the
    ladder's K3 256x10 step, compiled for the GPU). Larger leaves keep a reduction of their own. Same
    value up to the order of the fp32 sums."""
    groups: dict = {}
    for x in jax.tree.leaves(tree):
        key = (x.shape, jnp.dtype(x.dtype)) if x.size <= muon_lib.GROUP_MAX_ELEMS else id(x)
        groups.setdefault(key, []).append(x)
    total = jnp.zeros((), jnp.float32)
    for xs in groups.values():
        stacked = jnp.stack(xs) if len(xs) > 1 else xs[0]
        total = total + jnp.sum(jnp.square(stacked.astype(jnp.float32)))
    return jnp.sqrt(total)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Scales the updates by min(1, max_norm / `global_norm`): ``optax.clip_by_global_norm`` with the
    grouped norm, and its (empty) state, so checkpoints of either restore into the other."""
    def update_fn(updates, state, params=None):
        del params
        scale = jnp.minimum(1.0, max_norm / global_norm(updates))
        return jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


# ---------------------------------------------------------------------------------------------
# Learning-rate schedule


def warmup_steps(optim_cfg, total_steps: int) -> int:
    """Warmup length: ``warmup_steps`` if >= 0, else round(warmup_frac * total_steps), >= 1 if frac > 0."""
    if optim_cfg.warmup_steps >= 0:
        return int(optim_cfg.warmup_steps)
    if optim_cfg.warmup_frac <= 0:
        return 0
    return max(1, int(round(optim_cfg.warmup_frac * total_steps)))


def wsd_lr(t, peak: float, warmup: int, cool_start: int, end: int, min_ratio: float):
    """Warmup-stable-decay learning rate of step t (0-based; an int or a traced integer array).

    lr(t) = peak (t + 1) / (warmup + 1) for t < warmup, so the first step already moves; then peak
    until cool_start; then lo + (peak - lo)(1 - sqrt((t - cool_start + 1) / (end - cool_start))) with
    lo = min_ratio peak, which reaches lo on the last step t = end - 1 and holds it after. The one
    implementation of WSD: `learning_rate_schedule` and the scaling-law ladder (whose cooldown
    branches start at several cool_start of one stable trajectory) both call it.
    """
    t = jnp.asarray(t, jnp.float32)
    lo = peak * min_ratio
    frac = jnp.clip((t - cool_start + 1) / jnp.maximum(end - cool_start, 1), 0.0, 1.0)
    cool = lo + (peak - lo) * (1.0 - jnp.sqrt(frac))
    return jnp.where(t < warmup, peak * (t + 1) / (warmup + 1), jnp.where(t < cool_start, peak, cool))


def learning_rate_schedule(optim_cfg, total_steps: int, peak_lr: float | None = None) -> optax.Schedule:
    """Step -> learning rate, peaking at ``peak_lr`` (default ``optim_cfg.lr``).

    Warmup over W steps: lr(t) = peak * (t + 1) / (W + 1) for t < W, so the first step already
    moves (a ramp from exactly 0 would waste it) and the ramp meets the peak at t = W. After it:
      'cosine': cosine decay from peak at t = W to peak * min_lr_ratio at t = total_steps;
      'wsd':    constant peak until t_c = total_steps - round(decay_frac * total_steps), then
                lr(t) = lr_min + (peak - lr_min) * (1 - sqrt((t - t_c + 1) / (total_steps - t_c))),
                reaching lr_min on the last step (`wsd_lr`).
    'external': the constant ``peak`` (no warmup): the caller scales the updates by its own rate at
                run time (see `build_optimizer`).
    After total_steps the rate holds its final value (peak * min_lr_ratio, unless WSD has
    decay_frac = 0 and so no cooldown). The same shape serves the Muon and the Adam parameters:
    pass ``peak_lr=optim_cfg.adam_lr`` for the latter (the Muon schedule scaled by adam_lr / lr).
    """
    peak = float(optim_cfg.lr if peak_lr is None else peak_lr)
    T = int(total_steps)
    if T <= 0:
        raise ValueError(f"total_steps must be > 0, got {total_steps}")
    if optim_cfg.schedule == "external":
        return optax.constant_schedule(peak)
    W = min(warmup_steps(optim_cfg, T), T)
    if optim_cfg.schedule == "wsd":
        t_c = max(T - int(round(optim_cfg.decay_frac * T)), W)
        min_ratio = float(optim_cfg.min_lr_ratio)
        return lambda count: wsd_lr(count, peak, W, t_c, T, min_ratio)
    if optim_cfg.schedule != "cosine":
        raise ValueError(f"unknown schedule {optim_cfg.schedule!r}; expected 'cosine' or 'wsd'")
    # (first step, schedule) per phase; optax.join_schedules feeds each phase the steps since its start.
    phases = []
    if W > 0:
        phases.append((0, optax.linear_schedule(peak / (W + 1), peak, transition_steps=W)))
    phases.append((W, optax.cosine_decay_schedule(peak, decay_steps=max(T - W, 1), alpha=optim_cfg.min_lr_ratio)))
    if len(phases) == 1:
        return phases[0][1]
    return optax.join_schedules([fn for _, fn in phases], [start for start, _ in phases[1:]])


# ---------------------------------------------------------------------------------------------
# Which parameters Muon handles, and along which axes


def _axes_of(var: nnx.Variable) -> tuple:
    axes = var.get_metadata().get("out_sharding")
    if axes is None or len(axes) != len(var.shape):
        raise ValueError(f"parameter of shape {var.shape} has no logical axes (out_sharding={axes!r})")
    return tuple(axes)


def param_dimension_numbers(name: str, axes: Sequence[str | None],
                            per_head: bool = False) -> MuonDimensionNumbers | None:
    """Muon reduction/output axes for one parameter from its name and logical axes; None = AdamW.

    AdamW: anything with a 'vocab' axis (embedding, LM head: their rows are looked up or scored
    one token at a time, not a linear map Muon should whiten), the depthwise 'conv' filters, biases
    (name ending in 'bias') and anything with fewer than two matrix axes after removing the leading
    'layers'/'experts' batch axes (norm gains, A_log, AttnRes pseudo-queries). A ('heads',
    'head_dim') pair counts as one axis there: it is H*K channels of one feature, so dt_bias
    [H, K] is a vector, while w_q [D, H, K] is a D x HK matrix.

    Matrices: if the last axis is the model width ('embed'; 'expert_embed' inside experts), the
    parameter is an output projection ([H, K, D], [F, D]): reduce over all other matrix axes,
    output the last. Otherwise reduce over the first matrix axis (the input) and output the rest.
    ``per_head`` makes 'heads' a batch axis of the Q/K/V projections (`PER_HEAD_PARAMS`).
    """
    axes = tuple(axes)
    if "vocab" in axes or "conv" in axes or name.endswith("bias"):
        return None
    batch = set()
    for i, ax in enumerate(axes):
        if ax not in BATCH_AXES:
            break
        batch.add(i)
    if per_head and name in PER_HEAD_PARAMS and "heads" in axes:
        batch.add(axes.index("heads"))
    matrix = [i for i in range(len(axes)) if i not in batch]
    n_features = sum(1 for j, i in enumerate(matrix)
                     if not (axes[i] == "head_dim" and j > 0 and axes[matrix[j - 1]] == "heads"))
    if n_features < 2:
        return None
    if axes[matrix[-1]] in EMBED_AXES:
        return MuonDimensionNumbers(reduction_axis=tuple(matrix[:-1]), output_axis=(matrix[-1],))
    return MuonDimensionNumbers(reduction_axis=(matrix[0],), output_axis=tuple(matrix[1:]))


def _pure_tree(params_state: nnx.State, fn) -> dict:
    """A pure-dict tree shaped like ``nnx.to_pure_dict(params_state)`` with leaves fn(path, var)."""
    flat = {path: fn(path, var) for path, var in nnx.to_flat_state(params_state)}
    # The same unflatten that nnx.to_pure_dict uses, so the two trees line up key for key.
    return traversals.unflatten_mapping(flat)


def muon_dimension_numbers(params_state: nnx.State, per_head: bool = False) -> dict:
    """Per-parameter `MuonDimensionNumbers` (Muon) or None (AdamW), see `param_dimension_numbers`.

    ``params_state``: an ``nnx.State`` of ``nnx.Param`` (concrete or from ``nnx.eval_shape``). The
    result is a pure dict shaped like ``nnx.to_pure_dict(params_state)``, the form that
    ``optax.contrib.muon(..., muon_weight_dimension_numbers=...)`` takes for pure-dict params.
    """
    return _pure_tree(params_state,
                      lambda path, var: param_dimension_numbers(str(path[-1]), _axes_of(var), per_head))


def weight_decay_mask(params_state: nnx.State) -> dict:
    """Pure-dict tree of bools: decay the Muon matrices and the 'vocab' tables (embedding, LM head).

    Norm gains, biases, A_log, AttnRes pseudo-queries and the short-conv filters are not decayed:
    they set scales and offsets rather than carry features, and decay would pull them towards 0
    instead of their (mostly non-zero) neutral values.
    """
    def decays(path, var):
        axes = _axes_of(var)
        return "vocab" in axes or param_dimension_numbers(str(path[-1]), axes) is not None
    return _pure_tree(params_state, decays)


# ---------------------------------------------------------------------------------------------
# Optimizer


class _DecayState(NamedTuple):
    count: jax.Array


def _scheduled_weight_decay(schedule: optax.Schedule, weight_decay: float,
                            mask: Any) -> optax.GradientTransformation:
    """Decoupled weight decay on the masked leaves: update -= schedule(step) * weight_decay * param.

    ``optax.contrib.muon`` takes a single unmasked ``adam_weight_decay`` for all of its Adam leaves;
    this supplies the per-leaf one. It is applied after the learning-rate scaling of the wrapped
    optimizer, so it multiplies by the schedule itself (as ``optax.adamw`` does).
    """
    def init_fn(params):
        del params
        return _DecayState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("weight decay needs the params: call tx.update(grads, state, params)")
        rate = schedule(state.count) * weight_decay

        def decay(u, p, m):
            return (u - rate * p).astype(u.dtype) if m else u

        updates = jax.tree.map(decay, updates, params, mask)
        return updates, _DecayState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def _to_pure(tree):
    return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def _from_pure(template: nnx.State, pure: dict) -> nnx.State:
    """``template`` (a State of Variables) with each Variable's value replaced from ``pure``."""
    flat = traversals.flatten_mapping(pure)
    return nnx.from_flat_state([(path, var.replace(flat[path])) for path, var in nnx.to_flat_state(template)])


def on_nnx_state(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """Wraps a pure-dict optax transformation to take and return ``nnx.State`` of ``nnx.Param``.

    init/update convert State arguments with ``nnx.to_pure_dict``; the updates come back as a
    State of the same structure (and metadata) as ``grads``, ready for ``optax.apply_updates``.
    Pure-dict arguments pass through unchanged.
    """
    def init_fn(params):
        return tx.init(_to_pure(params))

    def update_fn(updates, state, params=None):
        new, state = tx.update(_to_pure(updates), state, None if params is None else _to_pure(params))
        if isinstance(updates, nnx.State):
            new = _from_pure(updates, new)
        return new, state

    return optax.GradientTransformation(init_fn, update_fn)


def _cast_muon_grads(dims: dict, dtype) -> optax.GradientTransformation:
    """Casts the gradients of the Muon leaves (``dims`` not None) to ``dtype``."""
    def update_fn(updates, state, params=None):
        del params
        cast = jax.tree.map(lambda g, d: g if d is None else g.astype(dtype), updates, dims,
                            is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))
        return cast, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _adam_decay_mask(mask: dict, dims: dict) -> dict:
    """The decay mask restricted to the Adam leaves of 'muon' (Muon leaves decay inside optax)."""
    return jax.tree.map(lambda m, d: bool(m) and d is None, mask, dims,
                        is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))


def _optax_muon(learning_rate, dims: dict, **kw) -> optax.GradientTransformation:
    """``optax.contrib.muon`` with the arguments of `k3.muon.muon` (its reference implementation)."""
    return optax.contrib.muon(learning_rate=learning_rate, muon_weight_dimension_numbers=dims,
                              adam_weight_decay=0.0,  # unmasked in optax; done per leaf by the caller
                              **kw)


# optim.newton_schulz -> the Muon+AdamW transformation. All have the same state tree. 'grouped' is
# 'folded' with the small same-shape matrices of different leaves orthogonalised together (fewer
# kernel launches: a small model's update is hundreds of tiny GEMMs, one chain per leaf). It
# concatenates leaves, which under a multi-device mesh can move sharded ones: it is meant for one
# device until measured on a mesh.
NEWTON_SCHULZ = {"folded": muon_lib.muon, "optax": _optax_muon,
                 "grouped": functools.partial(muon_lib.muon, group_max_elems=muon_lib.GROUP_MAX_ELEMS)}


def build_optimizer(cfg, params_state: nnx.State) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer for ``cfg.optim`` over ``cfg.steps`` steps, and its learning-rate schedule.

    'muon': Muon (``optim.newton_schulz``: `k3.muon.muon`, or ``optax.contrib.muon`` itself) on
    the matrices chosen by `muon_dimension_numbers` (Nesterov momentum ``optim.momentum``, 5
    Newton–Schulz steps, ``consistent_rms=0.2``: each update is
    rescaled to RMS 0.2 like AdamW's (Moonlight), so Muon can share AdamW's learning rate),
    decoupled weight decay on every Muon matrix; the rest by (Nesterov) AdamW with
    ``optim.b1/b2/eps`` at a schedule peaking at ``optim.adam_lr``, decayed per
    `weight_decay_mask` (embedding, LM head; not norms, biases, gates' A_log, queries, conv).
    'adamw': ``optax.adamw`` at ``optim.lr`` for every parameter, same decay mask.
    Gradients are first clipped to global norm ``optim.clip_norm`` when it is > 0.
    ``optim.mu_dtype='bfloat16'`` stores the first moments in bf16 (half the memory and traffic of the
    largest optimizer state) and runs Muon's Newton-Schulz iterations in bf16, at twice the TF32 rate.

    ``optim.schedule='external'``: the optimizer runs at a unit rate (Muon 1, Adam adam_lr / lr) and
    the train step multiplies its updates by the state's ``lr`` scalar, which the caller sets at
    every step. Every update term (Muon, Adam and both weight decays) is linear in the rate, so this
    equals a schedule with that value, while one compiled step serves any schedule and peak (the
    scaling-ladder runner's cooldown branches and learning-rate sweeps).

    ``params_state`` is the ``nnx.State`` of ``nnx.Param`` the optimizer will update (its
    structure and logical axes decide the per-parameter treatment). The returned ``tx`` takes
    that State form (see the module docstring); ``schedule(step)`` is the learning rate of the
    matrices at optimizer step ``step`` (0-based), for logging; the Adam parameters of 'muon' run
    at ``schedule(step) * adam_lr / lr``.
    """
    o = cfg.optim
    external = o.schedule == "external"
    schedule = learning_rate_schedule(o, cfg.steps, peak_lr=1.0 if external else None)
    mask = weight_decay_mask(params_state)
    if o.name == "muon":
        adam_schedule = learning_rate_schedule(o, cfg.steps, peak_lr=o.adam_lr / o.lr if external else o.adam_lr)
        dims = muon_dimension_numbers(params_state, o.per_head_muon)
        mu_dtype = jnp.dtype(o.mu_dtype)
        # A bf16 first moment needs bf16 gradients on the Muon leaves: optax keeps the moment's dtype
        # only when both are bf16, and then Newton-Schulz runs in bf16 too. (No extra link in the
        # fp32 chain: its state keeps the structure existing checkpoints were saved with.)
        cast = [_cast_muon_grads(dims, mu_dtype)] if mu_dtype != jnp.float32 else []
        core = optax.chain(
            *cast,
            NEWTON_SCHULZ[o.newton_schulz](
                learning_rate=schedule,
                beta=o.momentum,
                nesterov=True,  # the same flag goes to the AdamW part (NAdamW)
                eps=o.eps,
                weight_decay=o.weight_decay,  # applies to Muon leaves only, all of them decay
                consistent_rms=0.2,
                adam_b1=o.b1,
                adam_b2=o.b2,
                adam_learning_rate=adam_schedule,
                mu_dtype=mu_dtype,
                dims=dims,
            ),
            _scheduled_weight_decay(adam_schedule, o.weight_decay, _adam_decay_mask(mask, dims)),
        )
    elif o.name == "adamw":
        core = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=mask,
                           mu_dtype=jnp.dtype(o.mu_dtype))
    else:
        raise ValueError(f"unknown optimizer {o.name!r}; expected 'muon' or 'adamw'")
    if o.clip_norm > 0:
        core = optax.chain(clip_by_global_norm(o.clip_norm), core)
    return on_nnx_state(core), schedule

