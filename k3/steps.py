"""The jitted train and eval steps: model state, mesh checks, the optimizer step and evaluation.

The model runs functionally: ``nnx.split`` once into (graphdef, params, rest); the steps merge
inside ``jax.jit``. Router biases (in ``rest``) and QK-Clip are updated after the optimizer step,
outside the gradient. State: {'params', 'rest', 'opt', 'step'} (+ 'lr' for an external schedule).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from k3 import backends, nn, optim, sharding
from k3.moe.balancing import BALANCERS
from k3.model import Model, apply_qk_clip, update_router_biases


class RunError(RuntimeError):
    """The run cannot start or continue (bad workdir, corrupt checkpoint, non-finite loss...)."""


@dataclasses.dataclass
class Run:
    """Everything the loop needs: config, model structure, optimizer and the jitted steps."""

    cfg: Any
    graphdef: Any
    tx: optax.GradientTransformation
    schedule: Any
    train_step: Any
    eval_step: Any
    sharder: sharding.Sharder | None = None
    state_shardings: Any = None  # pytree of NamedSharding like the state (None on one device)
    loss_fn: Any = None  # (params, rest, batch) -> (mean loss, aux), for tests and tools
    # (state, batch) -> (state, metrics) before jit: for transformations of the whole step, e.g. one
    # program that trains several runs of one shape (`experiments.run_ladder`'s populations)
    step_fn: Any = None

    def put_batch(self, batch: dict) -> dict:
        """Host batch -> device arrays laid out on the mesh (each process passes its own rows)."""
        if self.sharder is None:
            return batch
        out = {}
        for key, x in batch.items():
            sh = sharding.batch_sharding(self.sharder, np.ndim(x))
            if jax.process_count() > 1:
                # Every process reads the same global batch (same data order); each places the rows
                # of its own devices.
                x = np.asarray(x)
                out[key] = jax.make_array_from_callback(x.shape, sh, lambda idx, x=x: x[idx])
            else:
                out[key] = jax.device_put(x, sh)
        return out


def make_sharder(cfg) -> sharding.Sharder | None:
    """The run's mesh and rules from ``cfg.mesh``, or None when the mesh is one device.

    Without a -1 the mesh takes the first prod(sizes) devices; with one it takes them all.
    """
    sizes = {a: cfg.mesh[a] for a in sharding.MESH_AXES}
    devices = jax.devices()
    if -1 not in sizes.values():
        n = math.prod(sizes.values())
        if n > len(devices):
            raise RunError(f"the mesh {sizes} needs {n} devices but only {len(devices)} are available")
        devices = devices[:n]
    try:
        rules = sharding.parse_rules(cfg.mesh.rule_overrides)
        mesh = sharding.make_mesh(cfg.mesh, devices)
    except ValueError as e:
        raise RunError(f"bad mesh: {e}") from e
    if mesh.size == 1:
        return None
    sh = sharding.Sharder(mesh, rules)
    batch_devices = math.prod(sh.size(a) for a in sh.axes_for("batch"))
    micro = cfg.data.batch_size // cfg.optim.grad_accum
    if micro % batch_devices:
        raise RunError(f"the micro-batch of {micro} rows (data.batch_size / optim.grad_accum) must be a "
                       f"multiple of the {batch_devices} devices that split the batch "
                       f"({', '.join(f'mesh.{a}' for a in sh.axes_for('batch'))})")
    if cfg.data.seq_len % sh.size("context"):
        raise RunError(f"data.seq_len={cfg.data.seq_len} must be a multiple of mesh.context={sh.size('context')}")
    return sh


# XLA options for compiling the initialiser, per platform. On a GPU, sibling multi-output fusion
# merges the random draws of every parameter of one shape into a single kernel (K3 1024:12: 72
# kernels, the largest about 7,000 ops). A K3 1024:12 state build took 128 s on the H200, nearly all
# of it compiling the initialiser; drawn in separate kernels it compiles in about half the time
# (46.6 -> 24-28 s for an H200, on a 2-core CPU; not yet timed on a GPU).
INIT_COMPILER_OPTIONS = {"gpu": {"xla_disable_hlo_passes": "multi_output_fusion"}}


def _tracing() -> bool:
    """Whether a JAX transformation is tracing here (e.g. `jax.eval_shape` of `make_run`)."""
    return isinstance(jnp.zeros(()), jax.core.Tracer)


def init_program(cfg, sharder: sharding.Sharder | None = None):
    """(graphdef, jitted initialiser) of `init_model`, nothing run: calling the initialiser returns
    (params, rest); ``.lower().compile()`` compiles it ahead (`experiments.run_ladder`). Inside a
    trace it is a plain nested jit: JAX takes compiler options on top-level jits only."""
    def build():
        return Model(cfg.model, rngs=nnx.Rngs(cfg.seed), track_max_logit=cfg.optim.qk_clip, sharder=sharder)

    graphdef, abs_params, abs_rest = nnx.split(nnx.eval_shape(build), nnx.Param, ...)
    out_shardings = None
    if sharder is not None:
        out_shardings = (sharding.state_shardings(abs_params, sharder), sharding.state_shardings(abs_rest, sharder))
    fn = jax.jit(lambda: tuple(nnx.split(build(), nnx.Param, ...)[1:]), out_shardings=out_shardings,
                 compiler_options=None if _tracing() else INIT_COMPILER_OPTIONS.get(backends.platform()))
    return graphdef, fn


def init_model(cfg, sharder: sharding.Sharder | None = None):
    """(graphdef, params, rest) of a freshly initialised model, built inside one ``jax.jit``.

    Eager construction would compile one small XLA program per parameter shape. With a sharder the
    parameters are created directly in their sharded layout (never whole on one device).
    """
    graphdef, fn = init_program(cfg, sharder)
    params, rest = fn()
    return graphdef, params, rest


# Primitives whose operands enter a sub-jaxpr one to one (and the parameter holding it): a weight
# passed into a call, a scan (as a constant or a stacked input) or a custom-derivative function is
# cast there, and a convert commutes with the slicing a scan does.
_SUB_JAXPRS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr", "scan": "jaxpr",
               "checkpoint": "jaxpr", "remat": "jaxpr", "custom_jvp_call": "call_jaxpr",
               "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr"}


def cast_only_inputs(jaxpr, dtype, _memo: dict | None = None) -> list[bool]:
    """Per input of ``jaxpr`` (a `jax.extend.core.Jaxpr`): whether its only uses convert it to
    ``dtype``, directly or inside the calls, scans and custom-derivative functions it is passed to.

    Such an input can be given already converted: the function computes the same, and its gradient
    is the cotangent of the convert, which the fp32 input's gradient only converts back. An input
    that is also used at its own dtype, returned, or passed to another primitive is not cast-only.
    """
    from jax.extend.core import Literal

    memo = {} if _memo is None else _memo
    if id(jaxpr) in memo:
        return memo[id(jaxpr)]
    uses = {v: [] for v in jaxpr.invars}
    for e in jaxpr.eqns:
        for i, v in enumerate(e.invars):
            if not isinstance(v, Literal) and v in uses:
                uses[v].append((e, i))
    returned = {v for v in jaxpr.outvars if not isinstance(v, Literal)}

    def only_cast(e, i):
        if e.primitive.name == "convert_element_type":
            return jnp.dtype(e.params["new_dtype"]) == jnp.dtype(dtype)
        key = _SUB_JAXPRS.get(e.primitive.name)
        sub = e.params.get(key) if key else None
        sub = getattr(sub, "jaxpr", sub)
        if sub is None or len(sub.invars) != len(e.invars):
            return False
        return cast_only_inputs(sub, dtype, memo)[i]

    out = [bool(us) and v not in returned and all(only_cast(e, i) for e, i in us) for v, us in uses.items()]
    memo[id(jaxpr)] = out
    return out


def compute_copies(loss_fn, params, *args, dtype) -> Any:
    """``params`` with every leaf that ``loss_fn(params, *args)`` only converts to ``dtype``
    (`cast_only_inputs`) given in ``dtype`` already, the others unchanged.

    For gradient accumulation: XLA does not hoist the weights' casts out of the loop over
    micro-batches, so each micro-batch would read every fp32 weight and write its bf16 copy again
    (7.3 GB per micro-batch for K3 1024:12). Cast once per update here instead; the gradients with
    respect to the copies are those of the fp32 weights before their final convert."""
    leaves, treedef = jax.tree.flatten(params)
    if all(jnp.dtype(x.dtype) == jnp.dtype(dtype) for x in leaves):
        return params  # nothing to cast (an fp32 model): skip the extra trace
    closed = jax.make_jaxpr(lambda *ls: loss_fn(jax.tree.unflatten(treedef, ls), *args))(*leaves)
    flags = cast_only_inputs(closed.jaxpr, dtype)
    return jax.tree.unflatten(treedef, [x.astype(dtype) if f else x for x, f in zip(leaves, flags)])


def _combine_stats(stats_A: Any, balancing: str) -> Any:
    """Combines micro-batch statistics: sums loads and summable balance statistics (histograms),
    averages the others (exact-QB biases), takes the max of attention logits."""
    summable = BALANCERS.get(balancing).summable

    def combine(path, x):
        name = path[-1].key if hasattr(path[-1], "key") else None
        if name == "max_logit":
            return jnp.max(x, axis=0)
        if name == "balance" and not summable:
            return jnp.mean(x, axis=0)
        return jnp.sum(x, axis=0)
    return jax.tree_util.tree_map_with_path(combine, stats_A)


def make_run(cfg) -> tuple[Run, dict]:
    """Builds the model, optimizer and jitted steps; returns (run, fresh state).

    state = {'params', 'rest' (router biases), 'opt', 'step'}, plus 'lr' (float32 scalar, the rate
    of the next step) when ``optim.schedule='external'``. On a multi-device mesh (``cfg.mesh``)
    the parameters, router biases and optimizer state are sharded by the logical-axis rules and the
    steps are compiled with those shardings in and out (the state is donated).
    """
    sharder = make_sharder(cfg)
    graphdef, params, rest = init_model(cfg, sharder)
    tx, schedule = optim.build_optimizer(cfg, params)
    state_sh = batch_sh = None
    if sharder is not None:
        p_sh = sharding.state_shardings(params, sharder)
        sharding.check_sharded(params, p_sh)
        opt_abs = jax.eval_shape(tx.init, params)
        opt_sh = sharding.tree_shardings_like(opt_abs, nnx.to_pure_dict(params), nnx.to_pure_dict(p_sh), sharder)
        state_sh = {"params": p_sh, "rest": sharding.state_shardings(rest, sharder), "opt": opt_sh,
                    "step": sharder.replicated()}
        batch_sh = {k: sharding.batch_sharding(sharder) for k in ("inputs", "targets", "segment_ids", "loss_mask")}
        opt = jax.jit(tx.init, out_shardings=opt_sh)(params)
    else:
        opt = jax.jit(tx.init)(params)
    state = {"params": params, "rest": rest, "opt": opt, "step": jnp.zeros((), jnp.int32)}
    external_lr = cfg.optim.schedule == "external"
    if external_lr:  # the rate the caller sets before each step (optim.schedule='external')
        state["lr"] = jnp.asarray(cfg.optim.lr, jnp.float32)
        if sharder is not None:
            state_sh["lr"] = sharder.replicated()
    if sharder is not None:
        state["step"] = jax.device_put(state["step"], sharder.replicated())
        if external_lr:
            state["lr"] = jax.device_put(state["lr"], sharder.replicated())
    accum = cfg.optim.grad_accum

    def loss_fn(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        return model.loss(batch["inputs"], batch["segment_ids"], batch["targets"], batch["loss_mask"])

    def train_step(state, batch):
        params, rest = state["params"], state["rest"]
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if accum == 1:
            # No loop: a one-trip scan stays a while loop in the compiled step (its kernels' scopes
            # show it), with a zero-filled gradient carry and an add over every parameter.
            (loss, aux), grads = grad_fn(params, rest, batch)
            losses, aux_A = loss[None], jax.tree.map(lambda x: x[None], aux)
        else:
            # Micro-batch i takes rows i, i + accum, ...: each device's rows stay on it.
            micro = jax.tree.map(
                lambda x: jnp.swapaxes(x.reshape((x.shape[0] // accum, accum) + x.shape[1:]), 0, 1), batch)

            first = jax.tree.map(lambda x: x[0], micro)
            low = compute_copies(lambda p, r, b: loss_fn(p, r, b)[0], params, rest, first,
                                 dtype=jnp.dtype(cfg.model.dtype))

            def one(grad_sum, mb):
                with nn.fp32_weight_grads():  # the GEMMs add their weight gradients into the sum
                    (loss, aux), grads = grad_fn(low, rest, mb)
                # Summed in the carry, in the parameters' dtype: one gradient buffer whatever the
                # number of micro-batches.
                return jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads), (loss, aux)

            zeros = jax.tree.map(jnp.zeros_like, params)
            grad_sum, (losses, aux_A) = jax.lax.scan(one, zeros, micro)
            grads = jax.tree.map(lambda g: g / accum, grad_sum)
        stats = _combine_stats(aux_A["layer_stats"], cfg.model.moe.balancing)
        loads = jnp.sum(aux_A["expert_load"], axis=0)
        grad_norm = optim.global_norm(grads)  # the clip's own norm: XLA computes it once
        with jax.named_scope("optimizer"):
            updates, opt = tx.update(grads, state["opt"], params)
            if external_lr:
                updates = jax.tree.map(lambda u: (u * state["lr"]).astype(u.dtype), updates)
            params = optax.apply_updates(params, updates)
        model = nnx.merge(graphdef, params, rest)
        n_tokens = batch["inputs"].size
        update_router_biases(model, stats, cfg.model.moe, n_tokens)
        if cfg.optim.qk_clip:
            apply_qk_clip(model, stats, cfg.optim.qk_clip_tau)
        _, params, rest = nnx.split(model, nnx.Param, ...)
        imbalance = (jnp.max(loads, axis=-1) / jnp.maximum(jnp.mean(loads, axis=-1), 1e-9)
                     if loads.size else jnp.zeros((0,)))
        lr = state["lr"] if external_lr else schedule(state["step"])
        metrics = {"loss": jnp.mean(losses), "grad_norm": grad_norm, "lr": lr,
                   "expert_imbalance": imbalance, "dropped_routes": _dropped(stats)}
        new_state = {"params": params, "rest": rest, "opt": opt, "step": state["step"] + 1}
        if external_lr:
            new_state["lr"] = state["lr"]
        return new_state, metrics

    def eval_step(state, batch):
        model = nnx.merge(graphdef, state["params"], state["rest"])
        if cfg.model.ce_chunk:  # summed from the mean: the chunked loss never forms the logits
            count = jnp.sum(batch["loss_mask"].astype(jnp.float32))
            loss, _ = model.loss(batch["inputs"], batch["segment_ids"], batch["targets"], batch["loss_mask"])
            return loss * jnp.maximum(count, 1.0), count
        logits, _ = model(batch["inputs"], batch["segment_ids"])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
        mask = batch["loss_mask"].astype(jnp.float32)
        return jnp.sum(nll * mask), jnp.sum(mask)

    if sharder is None:
        train_jit = jax.jit(train_step, donate_argnums=0)
        eval_jit = jax.jit(eval_step)
    else:
        rep = sharder.replicated()
        train_jit = jax.jit(train_step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, rep),
                            donate_argnums=0)
        eval_jit = jax.jit(eval_step, in_shardings=(state_sh, batch_sh), out_shardings=(rep, rep))
    run = Run(cfg=cfg, graphdef=graphdef, tx=tx, schedule=schedule, train_step=train_jit, eval_step=eval_jit,
              sharder=sharder, state_shardings=state_sh, loss_fn=loss_fn, step_fn=train_step)
    return run, state


def _dropped(stats: dict) -> jax.Array:
    """Routes dropped by the expert-parallel capacity, summed over layers (0 when dropless)."""
    total = jnp.zeros((), jnp.float32)
    for st in stats["head"] + stats["body"] + stats["tail"]:
        if "dropped" in st:
            total = total + jnp.sum(st["dropped"])
    return total


def to_host(x) -> np.ndarray:
    """A (replicated) result as a numpy array, also when its devices span several processes."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return np.asarray(x)


def evaluate(run: Run, state: dict, val_source, n_batches: int) -> dict:
    """Held-out loss: nats/token and bits/byte (None when the byte count is unknown)."""
    total, count = 0.0, 0.0
    for batch in val_source.val_batches(n_batches):
        s, c = run.eval_step(state, run.put_batch(batch))
        total, count = total + float(to_host(s)), count + float(to_host(c))
    nats = total / max(count, 1.0)
    return {"val_loss": nats, "val_bits_per_byte": val_source.bits_per_byte(nats), "val_tokens": int(count)}


# ------------------------------------------------------------------------------------------------
# Workdir, run identity, checkpoints
