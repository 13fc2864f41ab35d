"""Multi-head Latent Attention (DeepSeek-V3 / K2) and Gated MLA (K3).

q = W_qb RMSNorm(W_qa x)                               per head: [q_nope | q_rope]
[c_kv | k_rope] = W_kva x; [k_nope | v] = W_kvb RMSNorm(c_kv)    k_rope shared by all heads
o = W_o (sigmoid(W_g x) * softmax(q k^T * (nope + rope)^-0.5) v)   (gate only in K3)

K2 rotates the rope parts with RoPE; K3 leaves them unrotated (NoPE). Attention is causal and
restricted to the query's own document when ``segment_ids`` are given; its kernel is an entry of
`ATTENTION`, keyed by ``model.mla.attention_impl``:
  'xla'           ``jax.nn.dot_product_attention``'s XLA form: keeps the [B, H, T, T] scores for the
                  backward pass (every platform; the CPU default);
  'cudnn'         cuDNN's fused flash attention, documents as a [B, 1, T, T] mask (GPU);
  'pallas'        JAX's Pallas (Triton) flash attention with segment ids (GPU);
  'flash'         `pallas_kernels.flash_attention`: Pallas flash attention that visits only the key
                  blocks of the query's own document (work ~ sum of doc_len^2, not T^2; the GPU
                  default: 3.9x cuDNN forward+backward with documents of 512 in rows of 4096, on an
                  H200); interpreted off the GPU.
The fused kernels need bf16/fp16 operands; with fp32 compute they run the 'xla' form instead.

Decoding is the layer's too: its latent cache (`MLA.init_cache`), attending new tokens to it
(`MLA.extend`) and writing their entries into it (`write_rows`). The attention over the cached
latents is an entry of `DECODE_ATTENTION`, keyed by ``model.mla.decode_impl``:
  'xla'           einsums over the whole cache capacity, masked past each row's length ('auto'
                  off the GPU);
  'pallas'        `pallas_kernels.mla_decode`: split-S flash decoding that reads each row's cached
                  latents once and only up to its length ('auto' on a GPU: on an H200 the all-MLA
                  model's step at 32K context, batch 8, takes 3.40 ms against 6.19 ms with 'xla',
                  BENCHMARKS.md); interpreted off the GPU;
  'pallas_merged' the same, and for one new token per row a second kernel that merges the splits
                  with the token's own key (`latent_decode_step`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3.backends import Table
from k3.mla.parallel import mla_attention_sharded
from k3.nn import RMSNorm, cast, fuse_inputs, normal, param, project_inputs, sigmoid_gated
from k3.sharding import Sharder, spec_axes

ATTENTION = Table("model.mla.attention_impl", default="xla", auto={"gpu": "flash"})
DECODE_ATTENTION = Table("model.mla.decode_impl", default="xla", auto={"gpu": "pallas"})


@DECODE_ATTENTION.register("xla")
def decode_attention_xla(q_lat_BTHR, q_rope_BTHE, c_old_BSR, r_old_BSE, c_new_BTR, r_new_BTE, start_B,
                         scale: float) -> jax.Array:
    """Softmax attention of T new tokens per row over the row's cached latents (positions < start_B)
    and, causally, the new tokens' own latents; weight-absorbed queries. Returns o_lat [B, T, H, R]
    fp32. q_lat, c: R = kv_lora wide; q_rope, r: the rope width; cache entries in the cache dtype."""
    cd, f32 = c_old_BSR.dtype, jnp.float32
    S, T = c_old_BSR.shape[1], q_lat_BTHR.shape[1]
    # The cache is read in its own dtype with fp32 accumulation: upcasting it first would write
    # and re-read a copy twice its size, and at long contexts reading the cache is the step's cost.
    s_old = (jnp.einsum("bthr,bsr->bhts", q_lat_BTHR, c_old_BSR, preferred_element_type=f32)
             + jnp.einsum("bthe,bse->bhts", q_rope_BTHE, r_old_BSE, preferred_element_type=f32))
    s_new = (jnp.einsum("bthr,bur->bhtu", q_lat_BTHR, c_new_BTR, preferred_element_type=f32)
             + jnp.einsum("bthe,bue->bhtu", q_rope_BTHE, r_new_BTE, preferred_element_type=f32))
    past = jnp.arange(S)[None, :] < start_B[:, None]  # [B, S]
    causal = jnp.tril(jnp.ones((T, T), bool))
    s_old = jnp.where(past[:, None, None, :], s_old * scale, -jnp.inf)
    s_new = jnp.where(causal[None, None], s_new * scale, -jnp.inf)
    # One softmax over [old | new] without concatenating them: a [B, H, T, S + T] copy per
    # layer and step would grow with the context like the cache read itself.
    top = jnp.maximum(jnp.max(s_old, axis=-1, keepdims=True), jnp.max(s_new, axis=-1, keepdims=True))
    e_old, e_new = jnp.exp(s_old - top), jnp.exp(s_new - top)
    inv = 1.0 / (jnp.sum(e_old, axis=-1, keepdims=True) + jnp.sum(e_new, axis=-1, keepdims=True))
    # The output is rounded to the cache dtype, as a fused attention kernel's would be.
    return (jnp.einsum("bhts,bsr->bthr", (e_old * inv).astype(cd), c_old_BSR)
            + jnp.einsum("bhtu,bur->bthr", (e_new * inv).astype(cd), c_new_BTR)).astype(f32)


@DECODE_ATTENTION.register("pallas")
def decode_attention_pallas(q_lat_BTHR, q_rope_BTHE, c_old_BSR, r_old_BSE, c_new_BTR, r_new_BTE, start_B,
                            scale: float) -> jax.Array:
    """`decode_attention_xla` with the cached part through `pallas_kernels.mla_decode` (fp32 partial
    sums merged with the new tokens' part by the log-sum-exp rule). Same shapes."""
    from pallas_kernels.mla_decode import latent_attention_partial, merge_partials

    f32, T = jnp.float32, q_lat_BTHR.shape[1]
    o_old, m_old, l_old = latent_attention_partial(q_lat_BTHR, q_rope_BTHE, c_old_BSR, r_old_BSE, start_B,
                                                   scale=scale)
    s_new = (jnp.einsum("bthr,bur->bthu", q_lat_BTHR, c_new_BTR, preferred_element_type=f32)
             + jnp.einsum("bthe,bue->bthu", q_rope_BTHE, r_new_BTE, preferred_element_type=f32))
    causal = jnp.tril(jnp.ones((T, T), bool))[None, :, None, :]
    s_new = jnp.where(causal, s_new * scale, -jnp.inf)
    m_new = jnp.max(s_new, axis=-1)  # finite: each token sees itself
    e_new = jnp.exp(s_new - m_new[..., None])
    o_new = jnp.einsum("bthu,bur->bthr", e_new.astype(c_new_BTR.dtype), c_new_BTR, preferred_element_type=f32)
    o, _, l = merge_partials(o_old, m_old, l_old, o_new, m_new, jnp.sum(e_new, axis=-1))
    return o / l[..., None]


@DECODE_ATTENTION.register("pallas_merged")
def decode_attention_pallas_merged(q_lat_BTHR, q_rope_BTHE, c_old_BSR, r_old_BSE, c_new_BTR, r_new_BTE, start_B,
                                   scale: float) -> jax.Array:
    """'pallas' with, for one new token per row (a decode step), the splits' merge, the token's own
    score and the softmax division in a second kernel (`pallas_kernels.mla_decode.latent_decode_step`)
    instead of about five XLA kernels. Same shapes."""
    from pallas_kernels.mla_decode import latent_decode_step

    if q_lat_BTHR.shape[1] != 1:
        return decode_attention_pallas(q_lat_BTHR, q_rope_BTHE, c_old_BSR, r_old_BSE, c_new_BTR, r_new_BTE, start_B,
                                       scale)
    return latent_decode_step(q_lat_BTHR, q_rope_BTHE, c_old_BSR, r_old_BSE, c_new_BTR, r_new_BTE, start_B,
                              scale=scale)


def segment_positions(segment_ids_BT: jax.Array) -> jax.Array:
    """Position of each token inside its document: [B, T] int32, restarting at 0 per segment."""
    T = segment_ids_BT.shape[1]
    idx = jnp.arange(T, dtype=jnp.int32)[None, :]
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids_BT[:, :1], bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    return idx - start_idx


def apply_rope(x_BTHR: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding on the last axis (even width R), half-split convention, fp32 math."""
    R = x_BTHR.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, R, 2, dtype=jnp.float32) / R))
    angle = positions_BT[..., None].astype(jnp.float32) * inv_freq  # [B, T, R/2]
    cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]
    x = x_BTHR.astype(jnp.float32)
    x1, x2 = x[..., : R // 2], x[..., R // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTHR.dtype)


def _pad_v(v_BTHE, D):
    E = v_BTHE.shape[-1]
    return jnp.pad(v_BTHE, ((0, 0), (0, 0), (0, 0), (0, D - E))) if E < D else v_BTHE


def _document_mask(segment_ids_BT):
    if segment_ids_BT is None:
        return None
    return segment_ids_BT[:, None, :, None] == segment_ids_BT[:, None, None, :]


def _fused_sdpa(q_BTHD, k_BTHD, v_BTHE, segment_ids_BT, scale: float, implementation: str) -> jax.Array:
    """``jax.nn.dot_product_attention`` (equal head dims: v is zero-padded to D, the output sliced
    back to E), causal, with documents as a boolean mask."""
    E, D = v_BTHE.shape[-1], q_BTHD.shape[-1]
    out = jax.nn.dot_product_attention(q_BTHD, k_BTHD, _pad_v(v_BTHE, D), mask=_document_mask(segment_ids_BT),
                                       scale=scale, is_causal=True, implementation=implementation)
    return out[..., :E]


@ATTENTION.register("xla")
def xla_attention(q_BTHD, k_BTHD, v_BTHE, segment_ids_BT, scale: float) -> jax.Array:
    """Causal softmax attention within documents. q, k: [B,T,H,D]; v: [B,T,H,E] with E <= D -> [B,T,H,E]."""
    return _fused_sdpa(q_BTHD, k_BTHD, v_BTHE, segment_ids_BT, scale, "xla")


def _low_precision(*xs) -> bool:
    return all(x.dtype in (jnp.bfloat16, jnp.float16) for x in xs)


@ATTENTION.register("cudnn", platforms=("gpu",))
def cudnn_attention(q_BTHD, k_BTHD, v_BTHE, segment_ids_BT, scale: float) -> jax.Array:
    """`xla_attention` through cuDNN's fused kernel (bf16/fp16 only; fp32 runs the XLA form). Same shapes."""
    impl = "cudnn" if _low_precision(q_BTHD, k_BTHD, v_BTHE) else "xla"
    return _fused_sdpa(q_BTHD, k_BTHD, v_BTHE, segment_ids_BT, scale, impl)


@ATTENTION.register("pallas", platforms=("gpu",))
def pallas_attention(q_BTHD, k_BTHD, v_BTHE, segment_ids_BT, scale: float) -> jax.Array:
    """`xla_attention` through JAX's Pallas (Triton) flash attention with segment ids. Same shapes."""
    if not _low_precision(q_BTHD, k_BTHD, v_BTHE):
        return xla_attention(q_BTHD, k_BTHD, v_BTHE, segment_ids_BT, scale)
    from jax.experimental.pallas.ops.gpu.attention import mha

    E, D = v_BTHE.shape[-1], q_BTHD.shape[-1]
    out = mha(q_BTHD, k_BTHD, _pad_v(v_BTHE, D), segment_ids_BT, sm_scale=scale, causal=True)
    return out[..., :E]


@ATTENTION.register("flash")
def flash_attention(q_BTHD, k_BTHD, v_BTHE, segment_ids_BT, scale: float) -> jax.Array:
    """`xla_attention` through the document-skipping Pallas kernel (bf16/fp16; fp32 runs the XLA form).
    Documents must be contiguous runs of one segment id. Same shapes."""
    if not _low_precision(q_BTHD, k_BTHD, v_BTHE):
        return xla_attention(q_BTHD, k_BTHD, v_BTHE, segment_ids_BT, scale)
    from pallas_kernels.flash_attention import flash_attention as kernel

    return kernel(q_BTHD, k_BTHD, v_BTHE, segment_ids_BT, scale=scale)


def attention(q_BTHD, k_BTHD, v_BTHE, segment_ids_BT, scale: float, impl: str = "xla") -> jax.Array:
    """Causal attention within documents through the `ATTENTION` entry ``impl``. q, k: [B,T,H,D];
    v: [B,T,H,E] with E <= D. Returns [B,T,H,E]."""
    return ATTENTION.get(impl)(q_BTHD, k_BTHD, v_BTHE, segment_ids_BT, scale)


def max_attention_logit(q_BTHD, k_BTHD, segment_ids_BT, scale: float) -> jax.Array:
    """Per-head max of the attended logits q.k * scale over the batch: [H] fp32, no gradient.

    A second QK^T pass (flash attention does not expose its logits); only run when QK-Clip is on.
    """
    q, k = jax.lax.stop_gradient(q_BTHD), jax.lax.stop_gradient(k_BTHD)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    T = q.shape[1]
    allowed = jnp.tril(jnp.ones((T, T), bool))[None, None]
    if segment_ids_BT is not None:
        allowed = allowed & (segment_ids_BT[:, None, :, None] == segment_ids_BT[:, None, None, :])
    return jnp.max(jnp.where(allowed, s, -jnp.inf), axis=(0, 2, 3))


def qk_clip(mla: "MLA", max_logit_H: jax.Array, tau: float) -> None:
    """K2's QK-Clip, in place: per head h with S_h > tau, gamma = tau / S_h scales the head's
    q_nope and k_nope weights by sqrt(gamma) and its q_rope weights by gamma; the shared k_rope is
    left alone. ``max_logit_H`` may carry leading (stacked-layer) axes matching the weights'."""
    gamma = jnp.minimum(1.0, tau / jnp.maximum(max_logit_H, 1e-6))[..., None, :, None]  # [..., 1, H, 1]
    nope = mla.nope
    q_b = mla.q_b[...]
    q_scale = jnp.concatenate([jnp.broadcast_to(jnp.sqrt(gamma), gamma.shape[:-1] + (nope,)),
                               jnp.broadcast_to(gamma, gamma.shape[:-1] + (q_b.shape[-1] - nope,))], -1)
    mla.q_b[...] = (q_b * q_scale).astype(q_b.dtype)
    kv_b = mla.kv_b[...]
    kv_scale = jnp.concatenate([jnp.broadcast_to(jnp.sqrt(gamma), gamma.shape[:-1] + (nope,)),
                                jnp.ones(gamma.shape[:-1] + (kv_b.shape[-1] - nope,), gamma.dtype)], -1)
    mla.kv_b[...] = (kv_b * kv_scale).astype(kv_b.dtype)


class MLA(nnx.Module):
    """Multi-head latent attention layer; see the module docstring. x: [B, T, D] -> [B, T, D]."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, sharder: Sharder | None = None):
        a = cfg.mla
        D, H = cfg.d_model, a.n_heads
        self.sharder = sharder
        self.n_heads, self.nope, self.rope, self.v_dim = H, a.qk_nope_dim, a.qk_rope_dim, a.v_head_dim
        self.kv_lora = a.kv_lora_rank
        self.use_rope, self.theta = a.use_rope, a.rope_theta
        self.attend = ATTENTION.get(a.attention_impl)
        self.decode_attend = DECODE_ATTENTION.get(a.decode_impl)
        self.dtype = jnp.dtype(cfg.dtype)
        self.scale = (a.qk_nope_dim + a.qk_rope_dim) ** -0.5
        init = normal(cfg.init_std)
        qk = a.qk_nope_dim + a.qk_rope_dim
        if a.q_lora_rank > 0:
            self.q_a = param(rngs, init, (D, a.q_lora_rank), ("embed", "q_lora"))
            self.q_norm = RMSNorm(a.q_lora_rank, a.norm_eps, rngs=rngs)
            self.q_b = param(rngs, init, (a.q_lora_rank, H, qk), ("q_lora", "heads", "head_dim"))
        else:
            self.q_a, self.q_norm = None, None
            self.q_b = param(rngs, init, (D, H, qk), ("embed", "heads", "head_dim"))
        self.kv_a = param(rngs, init, (D, a.kv_lora_rank + a.qk_rope_dim), ("embed", "kv_lora"))
        self.kv_norm = RMSNorm(a.kv_lora_rank, a.norm_eps, rngs=rngs)
        self.kv_b = param(rngs, init, (a.kv_lora_rank, H, a.qk_nope_dim + a.v_head_dim),
                          ("kv_lora", "heads", "head_dim"))
        self.w_gate = (param(rngs, init, (D, H, a.v_head_dim), ("embed", "heads", "head_dim"))
                       if a.output_gate else None)
        self.w_o = param(rngs, init, (H, a.v_head_dim, D), ("heads", "head_dim", "embed"))

    @property
    def inputs(self) -> tuple[str, ...]:
        """Weights that read the layer's input x, in the order of their fused serving layout."""
        if getattr(self, "fused_shapes", None):
            return tuple(n for n, _ in self.fused_shapes)
        return ("q_a" if self.q_a is not None else "q_b", "kv_a") + (("w_gate",) if self.w_gate is not None else ())

    def fuse_inputs(self) -> None:
        """Serving layout: the input projections as one matrix (`k3.nn.fuse_inputs`)."""
        fuse_inputs(self, self.inputs)

    def split_kv_up(self) -> None:
        """Serving layout: kv_b [kv_lora, H, nope + v] as its key half ``kv_b_k`` [kv_lora, H, nope] and
        value half ``kv_b_v`` [kv_lora, H, v], in place: the two absorbed matrices a decode step reads.
        Sliced out of kv_b and cast to fp32 every step, they are a weight copy per step (compiled for an
        H100: one kernel per MLA layer). For inference only, as `k3.model.served` is."""
        if self.kv_b is None:
            return
        kv_b = self.kv_b[...]
        self.kv_b_k = nnx.Param(kv_b[..., : self.nope], out_sharding=("kv_lora", "heads", "head_dim"))
        self.kv_b_v = nnx.Param(kv_b[..., self.nope:], out_sharding=("kv_lora", "heads", "head_dim"))
        self.kv_b = None

    def _kv_up_halves(self, dtype) -> tuple[jax.Array, jax.Array]:
        """kv_b's key half [kv_lora, H, nope] and value half [kv_lora, H, v] in ``dtype``, in either layout."""
        if self.kv_b is None:  # the serving layout (`split_kv_up`)
            return cast(self.kv_b_k, dtype), cast(self.kv_b_v, dtype)
        kv_b = cast(self.kv_b, dtype)
        return kv_b[..., : self.nope], kv_b[..., self.nope:]

    def _project(self, x_BTD):
        """The input projections of x [B, T, D] (in the compute dtype): queries before RoPE
        [B, T, H, nope + rope], the latent and shared rope key [B, T, kv_lora + rope], and the output
        gate's logits [B, T, H, v_dim] (None without the gate)."""
        dt = self.dtype
        q, kv, *gate = project_inputs(self, x_BTD, self.inputs, dt)
        if self.inputs[0] == "q_a":
            q = jnp.einsum("btr,rhk->bthk", self.q_norm(q), cast(self.q_b, dt))
        return q, kv, (gate[0] if gate else None)

    def project_qkv(self, x_BTD, positions_BT):
        """q, k: [B, T, H, nope + rope]; v: [B, T, H, v_dim] (RoPE applied when configured); and the
        output gate's logits [B, T, H, v_dim] (None without the gate)."""
        dt = self.dtype
        x = x_BTD.astype(dt)
        q, kv, gate = self._project(x)
        c_kv, k_rope = kv[..., : self.kv_lora], kv[..., self.kv_lora:]
        kv_b = cast(self.kv_b, dt) if self.kv_b is not None else jnp.concatenate(self._kv_up_halves(dt), axis=-1)
        kv_up = jnp.einsum("btr,rhk->bthk", self.kv_norm(c_kv), kv_b)
        k_nope, v = kv_up[..., : self.nope], kv_up[..., self.nope:]
        q_nope, q_rope = q[..., : self.nope], q[..., self.nope:]
        k_rope = k_rope[:, :, None, :]
        if self.use_rope:
            q_rope = apply_rope(q_rope, positions_BT, self.theta)
            k_rope = apply_rope(k_rope, positions_BT, self.theta)
        k_rope = jnp.broadcast_to(k_rope, q_rope.shape)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        k = jnp.concatenate([k_nope, k_rope], axis=-1)
        return q, k, v, gate

    def __call__(self, x_BTD: jax.Array, segment_ids_BT: jax.Array | None = None,
                 positions_BT: jax.Array | None = None, return_max_logit: bool = False):
        """y [B, T, D]; with ``return_max_logit`` also the per-head max attention logit [H] (for QK-Clip)."""
        if positions_BT is None:
            positions_BT = (segment_positions(segment_ids_BT) if segment_ids_BT is not None
                            else jnp.broadcast_to(jnp.arange(x_BTD.shape[1]), x_BTD.shape[:2]))
        q, k, v, gate = self.project_qkv(x_BTD, positions_BT)
        sh = self.sharder
        if sh is not None and sh.size("context") > 1:
            # The sequence is split: each device's queries attend to the gathered keys and values.
            B, T, H, _ = q.shape
            o = mla_attention_sharded(sh.mesh, q, k, v, segment_ids_BT, self.scale,
                                      batch_axes=spec_axes(sh.spec(("batch",), (B,))[0]),
                                      head_axis=sh.spec(("act_heads",), (H,))[0], context_axis="context")
        else:
            with jax.named_scope("attention_core"):
                o = self.attend(q, k, v, segment_ids_BT, self.scale)
        max_logit = max_attention_logit(q, k, segment_ids_BT, self.scale) if return_max_logit else None
        if gate is not None:
            o = sigmoid_gated(o, gate, self.dtype)
        y = jnp.einsum("bthk,hkd->btd", o.astype(self.dtype), cast(self.w_o, self.dtype))
        return (y, max_logit) if return_max_logit else y

    # ------------------------------------------------------------------------------------------
    # Incremental decoding: the compressed latent cache, with the up-projection absorbed

    def init_cache(self, batch: int, max_len: int, dtype) -> dict:
        """Empty decode cache for ``max_len`` tokens per row: the normed latent 'c_kv' [B, S, kv_lora]
        and the shared key part 'k_rope' [B, S, rope] (rotated at its position for K2)."""
        return {"c_kv": jnp.zeros((batch, max_len, self.kv_lora), dtype),
                "k_rope": jnp.zeros((batch, max_len, self.rope), dtype)}

    def extend(self, x_BTD: jax.Array, cache: dict, start_B: jax.Array, n_valid_B: jax.Array,
               keep_inputs: bool = False):
        """Attends T new tokens per row to the cached ones and themselves; returns (y [B, T, D], rows).

        Row b's new tokens sit at positions start_B[b] + t; the cache's positions below start_B[b]
        are the row's past. ``rows``: the new tokens' cache entries, {'c_kv': [B, T, kv_lora],
        'k_rope': [B, T, rope]} in the cache dtype, for the caller to write at those positions
        (`write_rows`). The layer never writes the cache itself: inside a scan over
        stacked layers a written copy would cost a whole layer cache per step, where the caller's
        scatter into its carry writes T rows in place. Tokens past a row's ``n_valid_B[b]`` are
        returned too: they lie beyond its length, no valid query attends to them, and the next call
        overwrites them. Weight absorption: the queries move into the latent space (q_nope W_kb_k)
        and the output leaves it through W_kb_v, so the cache is never expanded to per-head keys.
        """
        del n_valid_B, keep_inputs  # a rollback only shortens the row's length: nothing to keep
        dt = self.dtype
        x = x_BTD.astype(dt)
        B, T, _ = x.shape
        c_old, r_old = cache["c_kv"], cache["k_rope"]
        cd, f32 = c_old.dtype, jnp.float32
        positions = start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        q, kv, gate = self._project(x)
        c_kv, k_rope = self.kv_norm(kv[..., : self.kv_lora]), kv[..., self.kv_lora:]
        q_nope, q_rope = q[..., : self.nope], q[..., self.nope:]
        if self.use_rope:
            q_rope = apply_rope(q_rope, positions, self.theta)
            k_rope = apply_rope(k_rope[:, :, None, :], positions, self.theta)[:, :, 0]
        # The new entries are used as they will be stored, so later steps see the same values.
        c_new, r_new = c_kv.astype(cd), k_rope.astype(r_old.dtype)
        w_kb_k, w_kb_v = self._kv_up_halves(f32)
        q_lat = jnp.einsum("bthn,rhn->bthr", q_nope.astype(f32), w_kb_k).astype(cd)
        q_rope = q_rope.astype(r_old.dtype)
        o_lat = self.decode_attend(q_lat, q_rope, c_old, r_old, c_new, r_new, start_B, self.scale)
        o = jnp.einsum("bthr,rhv->bthv", o_lat, w_kb_v)
        if gate is not None:
            o = sigmoid_gated(o, gate, dt)
        y = jnp.einsum("bthk,hkd->btd", o.astype(dt), cast(self.w_o, dt))
        return y, {"c_kv": c_new, "k_rope": r_new}


def write_rows(cache_BSX: jax.Array, rows_BTX: jax.Array, start_B: jax.Array, r=None) -> jax.Array:
    """Writes row b's T new entries at positions start_B[b] + t of an MLA cache array [B, S, X]
    (or of repeat ``r`` of a stacked one [R, B, S, X]); positions past S are dropped.

    rows: [B, T, X] (`MLA.extend`'s new entries), cast to the cache's dtype; start: [B] int32, the
    tokens already cached per row. Returns the updated cache array (the caller's scan carry, so
    the scatter happens in place).
    """
    B, T = rows_BTX.shape[:2]
    pos = start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    b = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    rows = rows_BTX.astype(cache_BSX.dtype)
    if r is None:
        return cache_BSX.at[b, pos].set(rows, mode="drop")
    return cache_BSX.at[r, b, pos].set(rows, mode="drop")
