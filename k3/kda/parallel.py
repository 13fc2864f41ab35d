"""Context (sequence) parallelism for KDA: the delta-rule core over a sequence split across devices.

Shard i of one mesh axis (``context`` by default) holds tokens [i * T_l, (i + 1) * T_l) of every
[B, T, ...] input, T = P * T_l. `kda_context_parallel` runs inside a `jax.shard_map` body and sees
only its own segment; `kda_core_sharded` applies the shard_map for a given mesh. This module lives
beside `k3.kda.ops` rather than in it because it needs a mesh axis, while the cores run on one device.

The delta rule is affine in the state. With S the [K, V] state of one (row, head),

    S_t = M_t S_{t-1} + beta_t k_t v_t^T,     M_t = (I - beta_t k_t k_t^T) Diag(exp(g_t))   [K, K]

so a segment maps its incoming state to S_end = A S_0 + Bst, with A = M_T ... M_1 [K, K] and Bst the
end state from a zero start [K, V]. The columns of S evolve independently, so one run of the existing
core on [0_K | v] (values widened to K + V) from the initial state [I_K | 0] yields [A | Bst] as its
final state, for any implementation of the core. A document boundary inside the segment resets the
state to zero, which zeroes A: the incoming state then reaches nothing past that boundary. The pairs
of all shards are gathered once ([P, B, H, K, K + V] on every shard, independent of T), each shard folds
them over the shards before it (P is small and static) to get its true incoming state, and runs the
core a second time on its own segment from that state. A document that starts exactly at a shard's
first token must not inherit the previous shard's state; the gathered first and last segment ids of
every shard say where that happens. Communication is one all-gather of the pairs (and one of the [B, 2] edge
ids); everything is differentiable (the all-gather transposes to a reduce-scatter).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from k3.kda.ops import kda_core
from k3.nn import compute_dtype
from k3.sharding import context_parallel_specs

__all__ = ["kda_context_parallel", "kda_core_sharded"]

# The fold over shards multiplies small fp32 matrices; on GPU/TPU the default precision would round
# the carried state to TF32/bf16 once per shard.
_PRECISION = lax.Precision.HIGHEST


def _segment_pair(q, k, v, g, beta, segment_ids, core_kwargs):
    """The shard's affine map of the state, [A | Bst]: [B, H, K, K + V] in the state dtype."""
    B, T, H, K = jnp.shape(q)
    V = jnp.shape(v)[-1]
    v = jnp.asarray(v)
    v_aug_BTHW = jnp.concatenate([jnp.zeros((B, T, H, K), v.dtype), v], axis=-1)
    # The core keeps its state in fp32 (fp64 for fp64 inputs) whatever the input dtype; an fp32
    # identity is exact in either.
    dtype = compute_dtype(q, k, v, g, beta)
    eye_KW = jnp.concatenate([jnp.eye(K, dtype=dtype), jnp.zeros((K, V), dtype)], axis=-1)
    init_BHKW = jnp.broadcast_to(eye_KW, (B, H, K, K + V))
    _, end_BHKW = kda_core(
        q, k, v_aug_BTHW, g, beta,
        initial_state=init_BHKW, output_final_state=True, segment_ids=segment_ids, **core_kwargs,
    )
    return end_BHKW


def kda_context_parallel(
    q,
    k,
    v,
    g,
    beta,
    segment_ids=None,
    *,
    axis_name="context",
    impl="chunk",
    chunk_size=16,
    gate_lower_bound=-5.0,
    scale=None,
    initial_state=None,
    output_final_state=False,
    matmul_dtype=None,
):
    """KDA over a sequence split along T into contiguous segments over mesh axis `axis_name`.

    Call inside a `jax.shard_map` body in which shard i of `axis_name` holds tokens
    [i * T_l, (i + 1) * T_l) of every [B, T, ...] input (other mesh axes may split B or H). The result
    equals `k3.kda.ops.kda_core` on the unsplit sequence with the same `impl`, including gradients.

    Args:
      q, k: [B, T_l, H, K] local queries and keys.
      v: [B, T_l, H, V] local values.
      g: [B, T_l, H, K] local per-channel log decay (<= 0).
      beta: [B, T_l, H] local delta-rule learning rate.
      segment_ids: optional [B, T_l] local ids of the packed documents; None is one document per row.
        A change of id between neighbouring tokens (across a shard edge too) starts a new document.
      axis_name: the mesh axis that splits T.
      impl, chunk_size, gate_lower_bound, scale, matmul_dtype: passed to `kda_core`.
      initial_state: optional [B, H, K, V] state before the global first token (the same on every
        shard of `axis_name`); applies to each row's first document.
      output_final_state: whether to also return the state after the global last token.

    Returns:
      (o [B, T_l, H, V] in v.dtype, final_state [B, H, K, V] float32 (float64 for float64 inputs),
      identical on every shard of `axis_name`, or None).
    """
    core_kwargs = dict(impl=impl, chunk_size=chunk_size, gate_lower_bound=gate_lower_bound, scale=scale,
                       matmul_dtype=matmul_dtype)
    B, T_l, H, K = jnp.shape(q)
    V = jnp.shape(v)[-1]
    if segment_ids is not None and jnp.shape(segment_ids) != (B, T_l):
        raise ValueError(f"segment_ids must be [B, T_l] = {(B, T_l)}; got shape {jnp.shape(segment_ids)}")

    pair_PBHKW = lax.all_gather(_segment_pair(q, k, v, g, beta, segment_ids, core_kwargs), axis_name)
    A_PBHKK, Bst_PBHKV = pair_PBHKW[..., :K], pair_PBHKW[..., K:]
    n_shards = pair_PBHKW.shape[0]
    dtype = pair_PBHKW.dtype

    if segment_ids is None:
        carries_P = [None] * n_shards
    else:
        seg_BT = jnp.asarray(segment_ids)
        ends_PB2 = lax.all_gather(jnp.stack([seg_BT[:, 0], seg_BT[:, -1]], axis=-1), axis_name)
        # carries[s][b]: row b's document continues from shard s - 1 into shard s.
        carries_P = [None] + [ends_PB2[s, :, 0] == ends_PB2[s - 1, :, 1] for s in range(1, n_shards)]

    S_BHKV = jnp.zeros((B, H, K, V), dtype) if initial_state is None else jnp.asarray(initial_state).astype(dtype)
    incoming = []
    for s in range(n_shards):
        if carries_P[s] is not None:
            S_BHKV = jnp.where(carries_P[s][:, None, None, None], S_BHKV, 0.0)
        incoming.append(S_BHKV)
        S_BHKV = jnp.einsum("bhij,bhjv->bhiv", A_PBHKK[s], S_BHKV, precision=_PRECISION) + Bst_PBHKV[s]
    final_BHKV = S_BHKV

    S_in_BHKV = jnp.stack(incoming)[lax.axis_index(axis_name)]
    o_BTHV, _ = kda_core(
        q, k, v, g, beta,
        initial_state=S_in_BHKV, output_final_state=False, segment_ids=segment_ids, **core_kwargs,
    )
    return o_BTHV, (final_BHKV if output_final_state else None)

def kda_core_sharded(
    mesh,
    q,
    k,
    v,
    g,
    beta,
    segment_ids=None,
    *,
    batch_axes: Sequence[str] = (),
    head_axis: str | None = None,
    context_axis: str = "context",
    **kda_kwargs,
):
    """`kda_context_parallel` under `jax.shard_map` on `mesh`: B over batch_axes, T over context_axis,
    H over head_axis.

    Args:
      mesh: a `jax.sharding.Mesh` with `context_axis` (and the batch and head axes, if given).
      q, k: [B, T, H, K] queries and keys.
      v: [B, T, H, V] values.
      g: [B, T, H, K] per-channel log decay (<= 0).
      beta: [B, T, H] delta-rule learning rate.
      segment_ids: optional [B, T] ints marking packed documents.
      batch_axes: mesh axes that split B (empty: B replicated).
      head_axis: mesh axis that splits H, or None.
      context_axis: mesh axis that splits T; T must be divisible by its size.
      **kda_kwargs: impl, chunk_size, gate_lower_bound, scale, initial_state ([B, H, K, V]),
        output_final_state, as for `kda_context_parallel`.

    Returns:
      (o [B, T, H, V] in v.dtype, final_state [B, H, K, V] or None), as `k3.kda.ops.kda_core`.

    Raises:
      ValueError: when T, B or H does not divide over its mesh axes.
    """
    B, T, H, _ = jnp.shape(q)
    b, h = context_parallel_specs(mesh, B, T, H, batch_axes, head_axis, context_axis)
    initial_state = kda_kwargs.pop("initial_state", None)
    output_final_state = kda_kwargs.pop("output_final_state", False)
    spec_BTHD = PartitionSpec(b, context_axis, h, None)
    spec_BTH = PartitionSpec(b, context_axis, h)
    spec_BT = PartitionSpec(b, context_axis)
    spec_BHKV = PartitionSpec(b, h, None, None)

    args = [q, k, v, g, beta]
    in_specs = [spec_BTHD, spec_BTHD, spec_BTHD, spec_BTHD, spec_BTH]
    for extra, spec in ((segment_ids, spec_BT), (initial_state, spec_BHKV)):
        if extra is not None:
            args.append(extra)
            in_specs.append(spec)

    def body(q, k, v, g, beta, *extras):
        extras = list(extras)
        seg = extras.pop(0) if segment_ids is not None else None
        init = extras.pop(0) if initial_state is not None else None
        if mesh.shape[context_axis] == 1:  # nothing to compose: the core on this device's block
            o, final = kda_core(q, k, v, g, beta, initial_state=init, output_final_state=output_final_state,
                                segment_ids=seg, **kda_kwargs)
        else:
            o, final = kda_context_parallel(
                q, k, v, g, beta, seg, axis_name=context_axis, initial_state=init,
                output_final_state=output_final_state, **kda_kwargs,
            )
        return (o, final) if output_final_state else o

    out_specs = (spec_BTHD, spec_BHKV) if output_final_state else spec_BTHD
    out = jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs, check_vma=False)(*args)
    return out if output_final_state else (out, None)
