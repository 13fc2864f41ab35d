"""Routed experts on a device mesh: tokens travel to their experts' devices and back.

One ``jax.shard_map`` over the whole mesh. Each device holds its tokens (batch split over the batch
axes, sequence over ``context``) and E / P experts (``experts`` over the expert axis, P devices);
the experts' hidden width may be split over ``tensor``, in which case the down projection's
partial sums are added with a psum. Inside, per device:

  1. sort its N k routes by global expert id, so they are grouped by destination device;
  2. all-to-all over the expert axis: a padded buffer [P, C, W] per device, C rows per destination
     (dropless: C = N k, the worst case; with ``capacity_factor`` c > 0: C = ceil(c N k / P), and
     routes past a destination's C rows are dropped and counted);
  3. the received rows are regrouped by local expert and run through ``jax.lax.ragged_dot``;
  4. the reverse all-to-all brings each route's output home, where the combine weights mix them.

Two dispatches move the rows. ``padded``: ``jax.lax.all_to_all`` of the fixed [P, C, W] buffers
(runs everywhere). ``ragged``: ``jax.lax.ragged_all_to_all`` sends each destination exactly its
rows, packed, into a receive buffer of P C rows (GPU and TPU; the CPU has no implementation, so the
tests run the same offsets through `ragged_all_to_all_emulated`). Under a capacity, a destination
takes its sources' rows in device order until its buffer is full. Router statistics (expert loads, Quantile-Balancing histograms) are summed over the devices
that hold different tokens with one psum, so the bias update sees the global batch.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from k3.ffn import EXPERT_PRODUCTS, glu_activation
from k3.sharding import Sharder, spec_axes


def _local_experts(x_MW, e_M, w_gate_EWF, w_up_EWF, w_down_EFW, activation, betas):
    """Rows x [M, W] through local expert e [M] (e == E marks an empty row, output 0) -> [M, W]."""
    E = w_gate_EWF.shape[0]
    order = jnp.argsort(e_M, stable=True)
    e_sorted = e_M[order]
    group_sizes = jnp.bincount(e_M, length=E + 1)[:E].astype(jnp.int32)
    xs = x_MW[order]
    gate = checkpoint_name(jax.lax.ragged_dot(xs, w_gate_EWF, group_sizes), EXPERT_PRODUCTS)
    up = checkpoint_name(jax.lax.ragged_dot(xs, w_up_EWF, group_sizes), EXPERT_PRODUCTS)
    out = jax.lax.ragged_dot(glu_activation(gate, up, activation, *betas), w_down_EFW, group_sizes)
    # Rows past the groups (empty buffer slots) are not defined by every backend's ragged_dot.
    out = jnp.where((e_sorted < E)[:, None], out, 0)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return out[inverse]


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """``jax.lax.ragged_all_to_all``'s semantics from a padded ``all_to_all`` (for the CPU and tests).

    operand [R, ...]: rows [input_offsets[j], + send_sizes[j]) go to peer j and land in its
    ``output`` at row output_offsets[j] (offsets in the receiver's buffer, given by the sender);
    recv_sizes[i] rows arrive from peer i. Rows of ``output`` nobody writes keep their value.
    """
    R = operand.shape[0]
    n = input_offsets.shape[0]
    rows = jnp.arange(R)
    idx = input_offsets[:, None] + rows[None, :]  # [n, R]
    valid = rows[None, :] < send_sizes[:, None]
    chunks = jnp.where(valid.reshape(valid.shape + (1,) * (operand.ndim - 1)),
                       operand[jnp.clip(idx, 0, R - 1)], 0)
    got = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # [n, R, ...]: chunk from peer i
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where peer i's rows go
    target = jnp.where(rows[None, :] < recv_sizes[:, None], at[:, None] + rows[None, :], output.shape[0])
    return output.at[target.reshape(-1)].set(got.reshape((n * R,) + operand.shape[1:]), mode="drop")


def _exclusive_cumsum(x, axis):
    return jnp.cumsum(x, axis=axis) - x


def _ragged_exchange(x_NW, idx_Nk, w_gate, w_up, w_down, *, activation, betas, expert_axes, n_expert_shards,
                     capacity_factor, a2a):
    """Per-device body with ragged all-to-alls: (routed outputs [N, k, W], dropped routes)."""
    N, k = idx_Nk.shape
    W = x_NW.shape[-1]
    E_local = w_gate.shape[0]
    Pn = n_expert_shards
    R = N * k
    flat_e = idx_Nk.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    e_sorted = flat_e[order]
    dest = e_sorted // E_local
    counts = jnp.bincount(flat_e // E_local, length=Pn).astype(jnp.int32)
    all_counts = jax.lax.all_gather(counts, expert_axes, tiled=False).reshape(Pn, Pn)  # [source, dest]
    cap = Pn * R if capacity_factor <= 0 else Pn * max(1, math.ceil(capacity_factor * R / Pn))
    # Each destination takes its sources' rows in device order until its buffer holds ``cap`` rows.
    before = _exclusive_cumsum(all_counts, 0)
    allowed = jnp.clip(cap - before, 0, all_counts)  # [source, dest]
    me = jax.lax.axis_index(expert_axes)
    in_off = _exclusive_cumsum(counts, 0)
    pos = jnp.arange(R, dtype=jnp.int32) - in_off[dest]
    keep = pos < allowed[me, dest]
    send_sizes = allowed[me]
    out_off = _exclusive_cumsum(allowed, 0)[me]  # my rows' place in each destination's buffer
    recv_sizes = allowed[:, me]
    xs = x_NW[order // k]
    recv_x = a2a(xs, jnp.zeros((cap, W), xs.dtype), in_off, send_sizes, out_off, recv_sizes, axis_name=expert_axes)
    recv_e = a2a(e_sorted % E_local, jnp.full((cap,), E_local, jnp.int32), in_off, send_sizes, out_off,
                 recv_sizes, axis_name=expert_axes)
    y = _local_experts(recv_x, recv_e, w_gate, w_up, w_down, activation, betas)
    # Back: each source's block of my buffer returns to where it came from in its sorted rows.
    back_off = _exclusive_cumsum(all_counts, 1)[:, me]
    y_sorted = a2a(y, jnp.zeros((R, W), y.dtype), _exclusive_cumsum(recv_sizes, 0), recv_sizes, back_off,
                   send_sizes, axis_name=expert_axes)
    y_sorted = jnp.where(keep[:, None], y_sorted, 0)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(R, dtype=order.dtype))
    return y_sorted[inverse].reshape(N, k, W), jnp.sum(~keep).astype(jnp.int32)


def _dispatch_compute_combine(x_NW, idx_Nk, w_gate, w_up, w_down, *, activation, betas, expert_axes,
                              n_expert_shards, capacity_factor):
    """Per-device body: returns (routed outputs [N, k, W], number of dropped routes)."""
    N, k = idx_Nk.shape
    W = x_NW.shape[-1]
    E_local = w_gate.shape[0]
    Pn = n_expert_shards
    flat_e = idx_Nk.reshape(-1)
    if Pn == 1:
        out = _local_experts(jnp.repeat(x_NW, k, axis=0), flat_e, w_gate, w_up, w_down, activation, betas)
        return out.reshape(N, k, W), jnp.zeros((), jnp.int32)
    R = N * k
    order = jnp.argsort(flat_e, stable=True)
    e_sorted = flat_e[order]
    dest = e_sorted // E_local
    counts = jnp.bincount(flat_e // E_local, length=Pn)
    starts = jnp.cumsum(counts) - counts
    pos = jnp.arange(R, dtype=jnp.int32) - starts[dest].astype(jnp.int32)
    C = R if capacity_factor <= 0 else max(1, math.ceil(capacity_factor * R / Pn))
    keep = pos < C
    slot = jnp.where(keep, dest * C + pos, Pn * C)  # out of range: dropped by mode='drop'
    send_x = jnp.zeros((Pn * C, W), x_NW.dtype).at[slot].set(x_NW[order // k], mode="drop")
    send_e = jnp.full((Pn * C,), E_local, jnp.int32).at[slot].set(e_sorted % E_local, mode="drop")
    recv_x = jax.lax.all_to_all(send_x, expert_axes, 0, 0, tiled=True)
    recv_e = jax.lax.all_to_all(send_e, expert_axes, 0, 0, tiled=True)
    y = _local_experts(recv_x, recv_e, w_gate, w_up, w_down, activation, betas)
    y_back = jax.lax.all_to_all(y, expert_axes, 0, 0, tiled=True)
    y_sorted = jnp.where(keep[:, None], y_back[jnp.minimum(slot, Pn * C - 1)], 0)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(R, dtype=order.dtype))
    dropped = jnp.sum(~keep).astype(jnp.int32)
    return y_sorted[inverse].reshape(N, k, W), dropped


def combine_routes(out_NkW: jax.Array, weights_Nk: jax.Array) -> jax.Array:
    """Each token's routed outputs mixed by its combine weights, in fp32: out [N, k, W] (compute dtype),
    weights [N, k] fp32 -> [N, W] fp32."""
    return jnp.einsum("nkw,nk->nw", out_NkW.astype(jnp.float32), weights_Nk)


def routed_experts_sharded(sharder: Sharder, h_BTW, idx_BTk, weights_BTk, w_gate_EWF, w_up_EWF, w_down_EFW,
                           *, activation: str, betas, capacity_factor: float = 0.0, stats_fn=None,
                           stats_inputs: tuple = (), dispatch: str = "padded"):
    """Expert-parallel routed MoE on ``sharder``'s mesh.

    Args:
      h_BTW: [B, T, W] expert inputs (latent width W for LatentMoE, else the model width).
      idx_BTk: [B, T, k] int32 global expert ids; weights_BTk: [B, T, k] fp32 combine weights.
      w_gate_EWF, w_up_EWF: [E, W, F]; w_down_EFW: [E, F, W] (global shapes, any sharding).
      capacity_factor: 0 = dropless; c > 0 caps each destination device at ceil(c N k / P) routes.
      stats_fn: optional ``(idx_Nk, *stats_inputs as [N, ...]) -> dict`` of per-device summable
        statistics (int or float arrays), summed over the token-sharding axes with one psum.
      stats_inputs: per-token arrays [B, T, ...] for ``stats_fn`` (router scores, thresholds).
      dispatch: 'padded' (all_to_all), 'ragged' (ragged_all_to_all; GPU/TPU) or 'ragged_emulated'
        (the ragged offsets through `ragged_all_to_all_emulated`).

    Returns:
      (y [B, T, W] fp32 = sum_k weight * expert output, dropped routes (int32 scalar, global),
       summed statistics or {}).
    """
    if dispatch not in ("padded", "ragged", "ragged_emulated"):
        raise ValueError(f"unknown expert dispatch {dispatch!r}; expected 'padded', 'ragged' or 'ragged_emulated'")
    mesh = sharder.mesh
    B, T, W = h_BTW.shape
    E = w_gate_EWF.shape[0]
    tok_spec = sharder.spec(("batch", "seq"), (B, T))
    token_axes = spec_axes(tok_spec[0]) + spec_axes(tok_spec[1])
    expert_axes = spec_axes(sharder.spec(("experts",), (E,))[0])
    n_expert_shards = math.prod(sharder.size(a) for a in expert_axes)
    F = w_gate_EWF.shape[-1]
    # The hidden width may only be split over axes that do not split the tokens: every device of a
    # tensor group must hold the same tokens for the psum of partial down projections to be right.
    f_axes = tuple(a for a in spec_axes(sharder.spec(("experts", "expert_mlp"), (E, F))[1])
                   if a not in token_axes)
    e_entry = expert_axes if expert_axes else None
    f_entry = f_axes if f_axes else None
    x_spec = P(tok_spec[0], tok_spec[1], None)
    in_specs = (x_spec, x_spec, x_spec, P(e_entry, None, f_entry), P(e_entry, None, f_entry),
                P(e_entry, f_entry, None), tuple(P(tok_spec[0], tok_spec[1]) for _ in stats_inputs))

    def body(h, idx, wts, wg, wu, wd, extra):
        b, t, _ = h.shape
        k = idx.shape[-1]
        idx_Nk = idx.reshape(b * t, k)
        kwargs = dict(activation=activation, betas=betas, expert_axes=expert_axes,
                      n_expert_shards=n_expert_shards, capacity_factor=capacity_factor)
        if dispatch == "padded" or n_expert_shards == 1:
            out, dropped = _dispatch_compute_combine(h.reshape(b * t, -1), idx_Nk, wg, wu, wd, **kwargs)
        else:
            a2a = jax.lax.ragged_all_to_all if dispatch == "ragged" else ragged_all_to_all_emulated
            out, dropped = _ragged_exchange(h.reshape(b * t, -1), idx_Nk, wg, wu, wd, a2a=a2a, **kwargs)
        if f_axes:
            out = jax.lax.psum(out, f_axes)
        out = checkpoint_name(out, EXPERT_PRODUCTS)
        y = combine_routes(out, wts.reshape(b * t, k))
        extra_N = tuple(a.reshape((b * t,) + a.shape[2:]) for a in extra)
        stats = stats_fn(idx_Nk, *extra_N) if stats_fn is not None else {}
        summed = (dropped, stats)
        if token_axes:
            summed = jax.lax.psum(summed, token_axes)
        return y.reshape(b, t, -1), summed[0], summed[1]

    stats_shape = {}
    if stats_fn is not None:
        stats_shape = jax.eval_shape(
            stats_fn, jax.ShapeDtypeStruct((B * T, idx_BTk.shape[-1]), idx_BTk.dtype),
            *(jax.ShapeDtypeStruct((B * T,) + a.shape[2:], a.dtype) for a in stats_inputs))
    stats_spec = jax.tree.map(lambda _: P(), stats_shape)
    fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(x_spec, P(), stats_spec),
                       check_vma=False)
    return fn(h_BTW, idx_BTk, weights_BTk, w_gate_EWF, w_up_EWF, w_down_EFW, tuple(stats_inputs))
