"""Residual streams: plain pre-norm residuals (K2) and Block Attention Residuals (K3).

Block AttnRes replaces ``h + f(norm(h))``. Each sublayer reads a softmax mix, over depth, of the
candidates [token embedding, completed block sums..., running partial sum of the current block]:
    logit_m = sum_d w_d * gamma_d * v_md / rms(v_m),   input = sum_m softmax(logit)_m * v_m
with a learned pseudo-query w (zero-initialised, so the first mix is a uniform mean) and an
RMSNorm gain gamma, softmax in fp32. A block is ``attn_res_block_size`` layers; its sum (attention
and FFN outputs) joins the bank when the next block starts.

The stream is a pytree of fixed shapes (the bank is a buffer of ``n_slots`` with a count), so a
scanned layer stack can carry it and block boundaries can depend on a traced layer index.

What the depth mixes cost is here too: their forward FLOPs (`attn_res_flops`, summed by
`k3.params`), and the bytes a layer's mixes keep for the backward and a layer boundary saves
(`attn_res_bytes`, `stream_carry_bytes`, summed by `k3.plan`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import PartitionSpec

from k3.backends import Table
from k3.nn import RMSNorm, compute_dtype, ones, param, recomputed, rms_norm, zeros
from k3.sharding import Sharder
from pallas_kernels.attn_res import depth_mix_pallas, kernel_width_ok

# Bytes per candidate token of one depth mix: its probability, logit and inverse RMS in fp32, which
# `depth_mix` (and the kernels) keep beside the candidates themselves.
ATTN_RES_BYTES = 12.0


def _mix_logits(v, w, eps):
    """Unmasked logits and inverse RMS of candidates v [..., B, T, D] (compute dtype): ([..., B, T]) x 2."""
    r = jax.lax.rsqrt(jnp.mean(jnp.square(v), axis=-1) + eps)
    return jnp.einsum("...btd,d->...bt", v, w) * r, r


def _mix_forward(cands_MBTD, valid_M, extra_BTD, extra_valid, w_D, eps, n_valid=None):
    dt = compute_dtype(cands_MBTD, extra_BTD)
    cands_MBTD, valid_M = cands_MBTD[:n_valid], valid_M[:n_valid]
    v, ve, w = cands_MBTD.astype(dt), extra_BTD.astype(dt), w_D.astype(dt)
    lg, r = _mix_logits(v, w, eps)
    le, re = _mix_logits(ve, w, eps)
    lg_masked = jnp.where(valid_M[:, None, None], lg, -jnp.inf)
    le_masked = jnp.where(extra_valid, le, -jnp.inf)
    top = jnp.maximum(jnp.max(lg_masked, axis=0), le_masked)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    e, ee = jnp.exp(lg_masked - top), jnp.exp(le_masked - top)
    z = jnp.sum(e, axis=0) + ee
    z = jnp.where(z > 0, z, 1.0)  # no valid candidate: a zero mix instead of 0 / 0
    p, pe = e / z, ee / z
    out = jnp.einsum("mbt,mbtd->btd", p, v) + pe[..., None] * ve
    return out.astype(cands_MBTD.dtype), (p, pe, lg, le, r, re)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def depth_mix(cands_MBTD: jax.Array, valid_M: jax.Array, extra_BTD: jax.Array, extra_valid: jax.Array,
              w_D: jax.Array, eps: float, n_valid: int | None = None) -> jax.Array:
    """Softmax mix over depth of the valid candidates [M, B, T, D] and one further candidate [B, T, D]
    (validity: bool [M] and a bool scalar), scored by logit = (v . w) / rms(v): [B, T, D] in the
    candidates' dtype, computed in fp32 (float64 for float64 inputs). ``n_valid``: a static count
    that says the candidates past the first n_valid are invalid, so they are neither read nor given
    a (zero) gradient by any pass over the candidates; None: all M are read.

    Its backward reads the candidates as given and keeps only the per-candidate probabilities,
    logits and inverse RMS ([M, B, T] each) from the forward: autodiff kept fp32 copies of every
    candidate and their products, 12 bytes per candidate element, and passed over them several
    times. With g_m = dout . v_m and gbar = sum_m p_m g_m:
        dlogit_m = p_m (g_m - gbar)
        dv_m     = p_m dout + dlogit_m (r_m w - logit_m r_m^2 v_m / D)
        dw       = sum_{m, b, t} dlogit_m r_m v_m
    Invalid candidates get p = 0 and so no gradient. Reverse mode only (a custom VJP).
    """
    return _mix_forward(cands_MBTD, valid_M, extra_BTD, extra_valid, w_D, eps, n_valid)[0]


def _depth_mix_fwd(cands_MBTD, valid_M, extra_BTD, extra_valid, w_D, eps, n_valid):
    out, stats = _mix_forward(cands_MBTD, valid_M, extra_BTD, extra_valid, w_D, eps, n_valid)
    return out, (cands_MBTD, extra_BTD, w_D) + stats


def _depth_mix_bwd(eps, n_valid, res, dout_BTD):
    del eps
    cands_all, extra, w_D, p, pe, lg, le, r, re = recomputed(res)
    cands = cands_all[:n_valid]
    dt = p.dtype
    v, ve, w, d = cands.astype(dt), extra.astype(dt), w_D.astype(dt), dout_BTD.astype(dt)
    D = v.shape[-1]
    g, ge = jnp.einsum("btd,mbtd->mbt", d, v), jnp.einsum("btd,btd->bt", d, ve)
    gbar = jnp.sum(p * g, axis=0) + pe * ge
    dl, dle = p * (g - gbar), pe * (ge - gbar)
    dv = p[..., None] * d + dl[..., None] * (r[..., None] * w - (lg * r * r / D)[..., None] * v)
    dve = pe[..., None] * d + dle[..., None] * (re[..., None] * w - (le * re * re / D)[..., None] * ve)
    dw = jnp.einsum("mbt,mbtd->d", dl * r, v) + jnp.einsum("bt,btd->d", dle * re, ve)
    dv = jnp.pad(dv, ((0, cands_all.shape[0] - cands.shape[0]),) + ((0, 0),) * 3)
    return dv.astype(cands.dtype), None, dve.astype(extra.dtype), None, dw.astype(w_D.dtype)


depth_mix.defvjp(_depth_mix_fwd, _depth_mix_bwd)

# Who computes the depth mixes (``model.attn_res_impl``), each entry called as (cands, valid, extra,
# extra_valid, w, eps, n_valid, gamma, norm_eps, w_gain) and returning rms_norm(mix) * gamma when a
# gain is given (the pseudo-query is w * w_gain when w_gain is given): 'xla' the jnp `depth_mix` then
# `k3.nn.rms_norm`; 'pallas' one Pallas kernel forward and one
# backward for the mix (`pallas_kernels.attn_res`; interpreted off a GPU), the norm by XLA;
# 'pallas_norm' the norm inside the same two kernels (the mix is never written out): the GPU default,
# K3 1024:12's step 3.0 ms faster than with 'pallas' on an H100 (BENCHMARKS.md).
MIX_BACKENDS = Table("model.attn_res_impl", default="xla", auto={"gpu": "pallas_norm"})


@MIX_BACKENDS.register("xla")
def depth_mix_then_norm(cands_MBTD, valid_M, extra_BTD, extra_valid, w_D, eps, n_valid=None, gamma_D=None,
                        norm_eps=None, w_gain_D=None):
    """`depth_mix`, then `k3.nn.rms_norm` of its output (in the candidates' dtype) when a gain is given."""
    w = w_D if w_gain_D is None else w_D * w_gain_D
    out = depth_mix(cands_MBTD, valid_M, extra_BTD, extra_valid, w.astype(jnp.float32), eps, n_valid)
    return out if gamma_D is None else rms_norm(out, gamma_D, norm_eps)


@MIX_BACKENDS.register("pallas")
def depth_mix_kernels(cands_MBTD, valid_M, extra_BTD, extra_valid, w_D, eps, n_valid=None, gamma_D=None,
                      norm_eps=None, w_gain_D=None):
    """`depth_mix` through the Pallas kernels where the width suits their tiles (a power of two >= 16,
    `kernel_width_ok`), then `k3.nn.rms_norm`; other widths (the ladder's d384, d448) run
    `depth_mix_then_norm`."""
    if not kernel_width_ok(cands_MBTD.shape[-1]):
        return depth_mix_then_norm(cands_MBTD, valid_M, extra_BTD, extra_valid, w_D, eps, n_valid, gamma_D, norm_eps,
                                   w_gain_D)
    out = depth_mix_pallas(cands_MBTD, valid_M, extra_BTD, extra_valid, w_D, eps, n_valid=n_valid, w_gain_D=w_gain_D)
    return out if gamma_D is None else rms_norm(out, gamma_D, norm_eps)


@MIX_BACKENDS.register("pallas_norm")
def depth_mix_norm_kernels(cands_MBTD, valid_M, extra_BTD, extra_valid, w_D, eps, n_valid=None, gamma_D=None,
                           norm_eps=None, w_gain_D=None):
    """The mix and its RMSNorm in the same Pallas kernels (the norm on the fp32 mix, its backward
    rebuilt from the candidates) where the width suits their tiles; `depth_mix_then_norm` elsewhere."""
    if not kernel_width_ok(cands_MBTD.shape[-1]):
        return depth_mix_then_norm(cands_MBTD, valid_M, extra_BTD, extra_valid, w_D, eps, n_valid, gamma_D, norm_eps,
                                   w_gain_D)
    return depth_mix_pallas(cands_MBTD, valid_M, extra_BTD, extra_valid, w_D, eps, n_valid=n_valid, gamma_D=gamma_D,
                            norm_eps=norm_eps, w_gain_D=w_gain_D)


class AttnResMix(nnx.Module):
    """One depth mix: pseudo-query [D] (init 0) and key-norm gain [D] (init 1).

    ``impl``: a `MIX_BACKENDS` name ('auto': Pallas kernels on a GPU, `depth_mix` elsewhere). With a
    ``sharder`` over several devices the kernels run per device under `jax.shard_map`, tokens split
    as the batch and sequence rules say and D whole (each token's statistics need all of it).
    """

    def __init__(self, d_model: int, eps: float, *, rngs: nnx.Rngs, impl: str = "auto",
                 sharder: Sharder | None = None):
        self.eps, self.sharder = eps, sharder
        self.impl = MIX_BACKENDS.resolve(impl)
        self.query = param(rngs, zeros, (d_model,), ("embed",))
        self.norm = param(rngs, ones, (d_model,), ("embed",))

    def __call__(self, cands_MBTD: jax.Array, valid_M: jax.Array, extra_BTD: jax.Array | None = None,
                 extra_valid=None, n_valid: int | None = None, norm: RMSNorm | None = None) -> jax.Array:
        """Mix of the valid candidates -> [B, T, D] (`depth_mix`); ``norm(mix)`` when an RMSNorm is
        given (the 'pallas_norm' backend computes it in the mix's own kernels).

        cands: [M, B, T, D]; valid: [M] bool; extra: an optional further candidate [B, T, D] with its
        validity (a bool scalar). Passing the running partial sum as ``extra`` instead of
        concatenating it to the bank keeps the [M + 1, B, T, D] copy out of every sublayer.
        n_valid: a static count of leading candidates that may be valid (`bank_count`); the rest
        are skipped.
        """
        with jax.named_scope("attn_res"):
            if extra_BTD is None:
                extra_BTD, extra_valid = jnp.zeros_like(cands_MBTD[0]), False
            mix = MIX_BACKENDS.get(self.impl)
            gamma = None if norm is None else norm.weight[...]
            norm_eps = None if norm is None else norm.eps
            # The pseudo-query is query * norm gain; the kernels form the product themselves.
            args = (cands_MBTD, jnp.asarray(valid_M), extra_BTD, jnp.asarray(extra_valid, bool), self.query[...])
            gain = self.norm[...]
            sh = self.sharder
            if self.impl.startswith("pallas") and sh is not None and sh.mesh.size > 1:
                tok = sh.spec(("batch", "seq", None), extra_BTD.shape)
                cand = PartitionSpec(None, *tok)
                rep = PartitionSpec()
                if gamma is None:
                    return jax.shard_map(lambda *a: mix(*a[:5], self.eps, n_valid, None, None, a[5]), mesh=sh.mesh,
                                         in_specs=(cand, rep, tok, rep, rep, rep), out_specs=tok,
                                         check_vma=False)(*args, gain)
                return jax.shard_map(lambda *a: mix(*a[:5], self.eps, n_valid, a[6], norm_eps, a[5]), mesh=sh.mesh,
                                     in_specs=(cand, rep, tok, rep, rep, rep, rep), out_specs=tok,
                                     check_vma=False)(*args, gain, gamma)
            return mix(*args, self.eps, n_valid, gamma, norm_eps, gain)


def n_bank_slots(n_layers: int, block_size: int) -> int:
    """Bank capacity: the embedding plus every block that can complete before the output mix."""
    return 1 + -(-n_layers // block_size)


def attn_res_candidates(n_layers: int, block_size: int) -> int:
    """Total number of depth-mix candidates over all mixes (2 per layer + the output mix)."""
    total, completed = 0, 0
    for layer in range(n_layers):
        # Attention mix: embedding, completed blocks, and the partial (at a block start: the block
        # that just finished, banked right after); layer 0's attention reads the embedding alone.
        total += 1 if layer == 0 else 2 + completed
        if layer > 0 and layer % block_size == 0:
            completed += 1
        total += 2 + completed  # FFN mix: the partial now holds this layer's attention output
    return total + 1 + completed + 1


def attn_res_flops(m) -> float:
    """Forward FLOPs per token of all of a model's depth mixes (model config ``m``): 6 D per
    candidate (`attn_res_candidates`): a multiply-add per element each for its mean square, its logit
    and the weighted sum; 0.0 with plain residuals."""
    if m.residual != "attn_res":
        return 0.0
    return 6 * m.d_model * attn_res_candidates(m.n_layers, m.attn_res_block_size)


def attn_res_bytes(m, tokens: int, a: int) -> dict:
    """Bytes one layer's two depth mixes keep for the backward, per device: {'attn_res': 2
    ATTN_RES M N + N D a}: the per-candidate statistics of M = bank slots + 1 candidates of
    N = ``tokens`` local tokens (`ATTN_RES_BYTES`), and the partial sum after the attention
    sublayer, a new [N, D] candidate in the a-byte compute dtype (the bank and the partial before it
    are the layer's input, `stream_carry_bytes`); {} with plain residuals."""
    if m.residual != "attn_res":
        return {}
    M = n_bank_slots(m.n_layers, m.attn_res_block_size) + 1
    return {"attn_res": 2 * ATTN_RES_BYTES * M * tokens + tokens * m.d_model * a}


def stream_carry_bytes(m, tokens: int, a: int) -> int:
    """Bytes of the stream saved at a layer boundary, per device, in a-byte compute dtype: the bank
    plus the partial sum (bank slots + 1) N D a under Block AttnRes, the hidden state N D a with
    plain residuals (N = ``tokens`` local tokens, D = d_model)."""
    if m.residual == "attn_res":
        return (n_bank_slots(m.n_layers, m.attn_res_block_size) + 1) * tokens * m.d_model * a
    return tokens * m.d_model * a


def init_stream(emb_BTD: jax.Array, residual: str, n_slots: int) -> dict:
    """Starting stream from the token embedding."""
    if residual == "plain":
        return {"h": emb_BTD}
    bank = jnp.zeros((n_slots,) + emb_BTD.shape, emb_BTD.dtype).at[0].set(emb_BTD)
    return {"bank": bank, "count": jnp.ones((), jnp.int32), "partial": jnp.zeros_like(emb_BTD),
            "has_partial": jnp.zeros((), bool)}


def bank_count(layer_idx: int, block_size: int, sublayer: str) -> int:
    """How many bank slots hold something when layer ``layer_idx``'s 'attention' or 'ffn' mix reads a
    stream that `init_stream` started before layer 0: the embedding plus the blocks banked so far
    (a block is banked by the attention sublayer of the next block's first layer, after its read).
    The output mix after L layers reads ``bank_count(L - 1, block_size, 'ffn')``."""
    done = layer_idx if sublayer == "ffn" else layer_idx - 1
    return 1 + max(done, 0) // block_size


def read(stream: dict, mix: AttnResMix | None, n_valid: int | None = None, norm: RMSNorm | None = None) -> jax.Array:
    """The input of the next sublayer: [B, T, D], through its pre-norm ``norm`` when one is given.
    ``n_valid``: the stream's bank count when it is known statically (`bank_count`, unrolled
    layers), so the mix skips the slots past it; None: the traced count alone decides."""
    if "h" in stream:
        return stream["h"] if norm is None else norm(stream["h"])
    bank = stream["bank"]
    return mix(bank, jnp.arange(bank.shape[0]) < stream["count"], stream["partial"], stream["has_partial"],
               n_valid=n_valid, norm=norm)


def add_attention(stream: dict, out_BTD: jax.Array, layer_idx, block_size: int, may_start: bool = True) -> dict:
    """Adds an attention sublayer's output; at a block's first layer the finished block is banked.

    ``may_start=False`` says, statically, that ``layer_idx`` (traced in a scanned body) is never a
    block's first layer: the bank is then left alone instead of rewritten with its own slot, which
    under XLA cost an in-place update plus a copy of the whole [M, B, T, D] bank per layer."""
    if "h" in stream:
        return {"h": stream["h"] + out_BTD.astype(stream["h"].dtype)}
    out = out_BTD.astype(stream["partial"].dtype)
    if not may_start:
        return {**stream, "partial": stream["partial"] + out, "has_partial": jnp.ones((), bool)}
    starts = (layer_idx % block_size) == 0
    push = jnp.logical_and(starts, stream["has_partial"])
    count = stream["count"]
    # One slot is written either way (with its own value when nothing is pushed): a select between
    # the whole old and new bank would copy all of it at every layer.
    bank = stream["bank"]
    slot = jnp.where(push, stream["partial"], jax.lax.dynamic_index_in_dim(bank, count, 0, keepdims=False))
    return {
        "bank": jax.lax.dynamic_update_index_in_dim(bank, slot, count, axis=0),
        "count": count + push.astype(jnp.int32),
        "partial": jnp.where(starts, out, stream["partial"] + out),
        "has_partial": jnp.ones((), bool),
    }


def may_start_block(layer_idxs, block_size: int) -> bool:
    """Whether any of ``layer_idxs`` (the indices one layer object runs at: one, or one per repeat of
    a scanned body) is a block's first layer, where `add_attention` may bank the finished block."""
    return any(i % block_size == 0 for i in layer_idxs)


def add_ffn(stream: dict, out_BTD: jax.Array) -> dict:
    """Adds an FFN sublayer's output to the running sum."""
    if "h" in stream:
        return {"h": stream["h"] + out_BTD.astype(stream["h"].dtype)}
    return {**stream, "partial": stream["partial"] + out_BTD.astype(stream["partial"].dtype)}
