"""Context (sequence) parallelism for MLA: causal attention over a sequence split across devices.

Shard i of one mesh axis (``context`` by default) holds tokens [i * T_l, (i + 1) * T_l) of every
[B, T, ...] input, T = P * T_l. The ``mla_attention_context_parallel`` and ``mla_attention_ring``
functions run inside a `jax.shard_map` body and see only their own segment; `mla_attention_sharded`
applies the shard_map for a given mesh. This module lives beside `k3.mla.layer` rather than among
its `ATTENTION` backends because it needs a mesh axis, while the backends run on one device.

The keys, values and segment ids are all-gathered along T and the local queries attend to the
whole sequence with a causal mask on global positions (`mla_attention_context_parallel`), or the key
and value blocks travel around the ring of shards with an online-softmax accumulator and blocks
entirely in a query shard's future are skipped (`mla_attention_ring`, which never holds more than
one remote block). Both equal `k3.mla.attention` on the unsplit sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from k3.sharding import context_parallel_specs

__all__ = ["mla_attention_context_parallel", "mla_attention_ring", "mla_attention_sharded"]


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
    b, h = context_parallel_specs(mesh, B, T, H, batch_axes, head_axis, context_axis)
    attend = mla_attention_ring if ring else mla_attention_context_parallel
    spec_BTHD = PartitionSpec(b, context_axis, h, None)
    args, in_specs = [q, k, v], [spec_BTHD, spec_BTHD, spec_BTHD]
    if segment_ids is not None:
        args.append(segment_ids)
        in_specs.append(PartitionSpec(b, context_axis))

    def body(q, k, v, *seg):
        return attend(q, k, v, seg[0] if seg else None, scale, axis_name=context_axis)

    return jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=spec_BTHD, check_vma=False)(*args)
