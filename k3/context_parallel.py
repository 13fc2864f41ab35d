"""Context (sequence) parallelism for the two token mixers: KDA and MLA attention.

The sequence axis T of every [B, T, ...] activation is split into P contiguous segments over one mesh
axis (``context`` by default): shard i holds tokens [i * T_l, (i + 1) * T_l), T = P * T_l. The
``*_context_parallel`` functions run inside a `jax.shard_map` body and see only their own segment;
the ``*_sharded`` wrappers apply the shard_map for a given mesh.

KDA. The delta rule is affine in the state. With S the [K, V] state of one (row, head),

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

MLA. The keys, values and segment ids are all-gathered along T and the local queries attend to the
whole sequence with a causal mask on global positions (`mla_attention_context_parallel`), or the key
and value blocks travel around the ring of shards with an online-softmax accumulator and blocks
entirely in a query shard's future are skipped (`mla_attention_ring`, which never holds more than
one remote block). Both equal `k3.mla.attention` on the unsplit sequence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from k3.kda.ops import kda_core

__all__ = [
    "kda_context_parallel",
    "kda_core_sharded",
    "mla_attention_context_parallel",
    "mla_attention_ring",
    "mla_attention_sharded",
]

# The fold over shards multiplies small fp32 matrices; on GPU/TPU the default precision would round
# the carried state to TF32/bf16 once per shard.
_PRECISION = lax.Precision.HIGHEST


# ----------------------------------------------------------------------------------------------------
# KDA
# ----------------------------------------------------------------------------------------------------


def _segment_pair(q, k, v, g, beta, segment_ids, core_kwargs):
    """The shard's affine map of the state, [A | Bst]: [B, H, K, K + V] in the state dtype."""
    B, T, H, K = jnp.shape(q)
    V = jnp.shape(v)[-1]
    v = jnp.asarray(v)
    v_aug_BTHW = jnp.concatenate([jnp.zeros((B, T, H, K), v.dtype), v], axis=-1)
    # The core keeps its state in fp32 (fp64 for fp64 inputs) whatever the input dtype; an fp32
    # identity is exact in either.
    dtype = jnp.float64 if jnp.result_type(q, k, v, g, beta) == jnp.float64 else jnp.float32
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


# ----------------------------------------------------------------------------------------------------
# MLA attention
# ----------------------------------------------------------------------------------------------------


def _masked_scores(q_BTHD, k_BSHD, scale, allowed_BTS):
    """fp32 logits [B, H, T, S] with disallowed pairs at -inf."""
    s_BHTS = jnp.einsum("bthd,bshd->bhts", q_BTHD, k_BSHD, preferred_element_type=jnp.float32) * scale
    return jnp.where(allowed_BTS[:, None], s_BHTS, -jnp.inf)


def _allowed(q_pos_T, k_pos_S, seg_q_BT, seg_k_BS, B):
    """[B, T, S] bool: causal on global positions, and the same document when ids are given."""
    allowed_BTS = jnp.broadcast_to((k_pos_S[None, :] <= q_pos_T[:, None])[None], (B, q_pos_T.size, k_pos_S.size))
    if seg_q_BT is not None:
        allowed_BTS = allowed_BTS & (seg_q_BT[:, :, None] == seg_k_BS[:, None, :])
    return allowed_BTS


def mla_attention_context_parallel(q_BTHD, k_BTHD, v_BTHE, segment_ids_BT, scale, *, axis_name="context"):
    """Causal attention within documents over a sequence split along T, by all-gathering k and v.

    Call inside a `jax.shard_map` body in which shard i of `axis_name` holds tokens
    [i * T_l, (i + 1) * T_l). Each shard gathers the whole sequence's keys, values and segment ids
    ([B, T, ...]) and attends its queries to them: memory O(T) per shard for k and v and
    O(T_l * T) for the scores. Equals `k3.mla.attention` on the unsplit sequence.

    Args:
      q_BTHD, k_BTHD: [B, T_l, H, D] local queries and keys.
      v_BTHE: [B, T_l, H, E] local values (E may differ from D).
      segment_ids_BT: optional [B, T_l] local document ids; tokens attend within the same id only.
      scale: logit scale.
      axis_name: the mesh axis that splits T.

    Returns:
      [B, T_l, H, E] in q's dtype (fp32 softmax; probabilities cast to v's dtype for the PV product).
    """
    B, T_l = q_BTHD.shape[:2]
    k_BSHD = lax.all_gather(k_BTHD, axis_name, axis=1, tiled=True)
    v_BSHE = lax.all_gather(v_BTHE, axis_name, axis=1, tiled=True)
    seg_BS = None if segment_ids_BT is None else lax.all_gather(segment_ids_BT, axis_name, axis=1, tiled=True)
    q_pos_T = lax.axis_index(axis_name) * T_l + jnp.arange(T_l)
    allowed_BTS = _allowed(q_pos_T, jnp.arange(k_BSHD.shape[1]), segment_ids_BT, seg_BS, B)
    # Every query sees at least itself, so no row is fully masked and softmax has no 0/0.
    p_BHTS = jax.nn.softmax(_masked_scores(q_BTHD, k_BSHD, scale, allowed_BTS), axis=-1)
    o_BTHE = jnp.einsum("bhts,bshe->bthe", p_BHTS.astype(v_BSHE.dtype), v_BSHE, preferred_element_type=jnp.float32)
    return o_BTHE.astype(q_BTHD.dtype)


def mla_attention_ring(q_BTHD, k_BTHD, v_BTHE, segment_ids_BT, scale, *, axis_name="context"):
    """Causal attention within documents over a sequence split along T, passing k/v around a ring.

    Call inside a `jax.shard_map` body in which shard i of `axis_name` holds tokens
    [i * T_l, (i + 1) * T_l). At step j shard i holds the key/value block of shard (i - j) mod P,
    folds it into an fp32 online-softmax accumulator unless the block lies entirely in its future,
    and passes it on to shard i + 1 (P - 1 `ppermute`s; the send of the next block does not depend
    on this step's arithmetic, so the two can overlap). Memory: two k/v blocks (the one in use and
    the one arriving) and O(T_l^2) scores.
    Shards late in the sequence do more blocks than early ones (contiguous split, no load balancing).
    Equals `k3.mla.attention` on the unsplit sequence. Arguments and result (q_BTHD, k_BTHD:
    [B, T_l, H, D]; v_BTHE: [B, T_l, H, E]; -> [B, T_l, H, E]) as `mla_attention_context_parallel`.
    """
    B, T_l, H, _ = q_BTHD.shape
    E = v_BTHE.shape[-1]
    n_shards = lax.all_gather(jnp.zeros((), jnp.int32), axis_name).shape[0]
    me = lax.axis_index(axis_name)
    q_pos_T = me * T_l + jnp.arange(T_l)
    perm = [(i, (i + 1) % n_shards) for i in range(n_shards)]

    def fold(carry, block):
        m_BHT, l_BHT, acc_BHTE = carry
        k_blk, v_blk, seg_blk, src = block
        allowed_BTS = _allowed(q_pos_T, src * T_l + jnp.arange(T_l), segment_ids_BT, seg_blk, B)
        s_BHTS = _masked_scores(q_BTHD, k_blk, scale, allowed_BTS)
        # The running max only keeps exp finite; the result does not depend on it.
        m_new_BHT = lax.stop_gradient(jnp.maximum(m_BHT, jnp.max(s_BHTS, axis=-1)))
        # Step 0 is the shard's own (diagonal) block, where every row sees itself, so m is finite
        # from then on; the guard only keeps a fully masked row of a later block at exp(-inf) = 0.
        m_safe_BHT = jnp.where(jnp.isfinite(m_new_BHT), m_new_BHT, 0.0)
        p_BHTS = jnp.exp(s_BHTS - m_safe_BHT[..., None])
        rescale_BHT = jnp.exp(m_BHT - m_safe_BHT)
        pv_BHTE = jnp.einsum("bhts,bshe->bhte", p_BHTS.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
        return m_new_BHT, rescale_BHT * l_BHT + p_BHTS.sum(-1), rescale_BHT[..., None] * acc_BHTE + pv_BHTE

    carry = (
        jnp.full((B, H, T_l), -jnp.inf, jnp.float32),
        jnp.zeros((B, H, T_l), jnp.float32),
        jnp.zeros((B, H, T_l, E), jnp.float32),
    )
    k_blk, v_blk, seg_blk = k_BTHD, v_BTHE, segment_ids_BT
    for step in range(n_shards):
        if step < n_shards - 1:
            k_next, v_next, seg_next = lax.ppermute((k_blk, v_blk, seg_blk), axis_name, perm)
        src = (me - step) % n_shards
        if step == 0:
            carry = fold(carry, (k_blk, v_blk, seg_blk, src))
        else:
            carry = lax.cond(src < me, fold, lambda c, blk: c, carry, (k_blk, v_blk, seg_blk, src))
        if step < n_shards - 1:
            k_blk, v_blk, seg_blk = k_next, v_next, seg_next
    _, l_BHT, acc_BHTE = carry
    o_BHTE = acc_BHTE / l_BHT[..., None]
    return o_BHTE.transpose(0, 2, 1, 3).astype(q_BTHD.dtype)


# ----------------------------------------------------------------------------------------------------
# shard_map wrappers
# ----------------------------------------------------------------------------------------------------


def _axes_size(mesh, axes):
    return math.prod(mesh.shape[a] for a in axes)


def _check_divisible(what, size, mesh, axes):
    n = _axes_size(mesh, axes)
    if size % n:
        raise ValueError(f"{what} = {size} is not divisible by the size {n} of mesh axes {tuple(axes)}")


def _specs(mesh, B, T, H, batch_axes, head_axis, context_axis):
    """(batch spec entry, head spec entry) after checking that B, T and H divide over their axes."""
    batch_axes = tuple(batch_axes)
    if context_axis not in mesh.shape:
        raise ValueError(f"context axis {context_axis!r} is not a mesh axis {tuple(mesh.axis_names)}")
    _check_divisible("sequence length T", T, mesh, (context_axis,))
    _check_divisible("batch size B", B, mesh, batch_axes)
    head_axes = () if head_axis is None else (head_axis,)
    _check_divisible("number of heads H", H, mesh, head_axes)
    return (batch_axes or None), head_axis


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
    b, h = _specs(mesh, B, T, H, batch_axes, head_axis, context_axis)
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


def mla_attention_sharded(
    mesh,
    q,
    k,
    v,
    segment_ids,
    scale,
    *,
    batch_axes: Sequence[str] = (),
    head_axis: str | None = None,
    context_axis: str = "context",
    ring: bool = False,
):
    """`mla_attention_context_parallel` (or, with ring=True, `mla_attention_ring`) under
    `jax.shard_map` on `mesh`: B over batch_axes, T over context_axis, H over head_axis.

    Args:
      mesh: a `jax.sharding.Mesh` with `context_axis` (and the batch and head axes, if given).
      q, k: [B, T, H, D] queries and keys.
      v: [B, T, H, E] values.
      segment_ids: optional [B, T] document ids.
      scale: logit scale.
      batch_axes: mesh axes that split B (empty: B replicated).
      head_axis: mesh axis that splits H, or None.
      context_axis: mesh axis that splits T; T must be divisible by its size.
      ring: pass k/v blocks around the ring instead of all-gathering them.

    Returns:
      [B, T, H, E] in q's dtype, as `k3.mla.attention`.

    Raises:
      ValueError: when T, B or H does not divide over its mesh axes.
    """
    B, T, H, _ = jnp.shape(q)
    b, h = _specs(mesh, B, T, H, batch_axes, head_axis, context_axis)
    attend = mla_attention_ring if ring else mla_attention_context_parallel
    spec_BTHD = PartitionSpec(b, context_axis, h, None)
    args, in_specs = [q, k, v], [spec_BTHD, spec_BTHD, spec_BTHD]
    if segment_ids is not None:
        args.append(segment_ids)
        in_specs.append(PartitionSpec(b, context_axis))

    def body(q, k, v, *seg):
        return attend(q, k, v, seg[0] if seg else None, scale, axis_name=context_axis)

    return jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=spec_BTHD, check_vma=False)(*args)
