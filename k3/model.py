"""The language model: embedding -> decoder layers -> final norm -> untied LM head.

Layer l has a token mixer (KDA or MLA) and an FFN (dense GLU for l < first_k_dense, MoE after),
laid out by `k3.config.layer_kinds`. Layers that repeat with the mixer period (K3: KDA, KDA, KDA,
MLA; K2: MLA) are stacked along a leading ``layers`` axis and run with ``jax.lax.scan``, so compile
time does not grow with depth, or unrolled like the rest (``model.layer_loop``: `LAYER_LOOPS`); the
irregular head (dense layers) and tail (K3's extra final MLA) are always unrolled. The residual
stream (plain or Block AttnRes) is the scan carry.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3 import attn_res
from k3.backends import Table
from k3.config import layer_kinds
from k3.ffn import EXPERT_PRODUCTS, GLU_OUTPUT, GLUMLP
from k3.kda.layer import KDA
from k3.mla.layer import MLA, qk_clip
from k3.moe.layer import MoE, new_bias
from k3.nn import FUSED_INPUTS, WEIGHT_CAST, RMSNorm, cast, normal, param
from k3.sharding import Sharder, constrain
from pallas_kernels.common import ATTENTION_RESIDUALS, KDA_INPUTS, KDA_RESIDUALS

_ACT_BTD = ("batch", "seq", "act_embed")

# What a rematerialised layer group keeps for the backward pass (``model.remat_policy``, used when
# ``model.remat`` is on); each entry returns a `jax.checkpoint` policy.
REMAT_POLICIES = Table("model.remat_policy", default="full")


@REMAT_POLICIES.register("full")
def _keep_inputs_only():
    """Keep each group's inputs only: the whole forward runs again in the backward pass."""
    return None


@REMAT_POLICIES.register("dots")
def _keep_projections():
    """Keep the outputs of matmuls without batch dimensions (the layers' projections, the shared
    experts, the router), recompute the rest (norms, gates, attention and KDA kernels, batched
    expert GEMMs): less recomputation than 'full' for the memory of the projection outputs."""
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable


# The '*_kernels' policies also keep every parameter's compute-dtype cast (`k3.nn.WEIGHT_CAST`):
# recomputing a layer then reads the bf16 copy instead of converting the fp32 parameter again
# (K3 1024:12 compiled for the H200: 181 fewer kernels and 7.3 GB less traffic per step, for 2.1 GiB
# more peak memory).
_KERNEL_RESIDUALS = (KDA_RESIDUALS, ATTENTION_RESIDUALS, WEIGHT_CAST)
# Policies that keep the Pallas KDA kernel's inputs across the forward (the planner counts them).
SAVES_KDA_INPUTS = frozenset({"dots_kernels_glu_inputs"})
# Policies whose saved residuals include the weight casts (the planner counts their bytes).
SAVES_WEIGHT_CASTS = frozenset({"dots_kernels", "dots_kernels_glu", "dots_kernels_glu_inputs",
                                "dots_kernels_glu_experts", "matmuls_kernels"})
# Policies that keep the routed experts' gate/up products and combined outputs (the planner counts them).
SAVES_EXPERT_PRODUCTS = frozenset({"dots_kernels_glu_experts"})


@REMAT_POLICIES.register("dots_kernels")
def _keep_projections_and_kernel_residuals():
    """'dots', plus what the Pallas KDA and flash-attention kernels save for their backward (named
    by their custom_vjps): their forward kernels run once instead of again inside the backward pass,
    for the memory of those residuals (KDA: w, qg, kg, v_new, Aqk, T and the per-chunk states, about
    eight [B, T, H, K] arrays per layer; attention: o and the log-sum-exp), and every parameter's
    compute-dtype cast."""
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*_KERNEL_RESIDUALS))


@REMAT_POLICIES.register("dots_kernels_glu")
def _keep_projections_kernel_residuals_and_glu():
    """'dots_kernels', plus every gated activation's output (`k3.ffn.GLU_OUTPUT`: the experts'
    [E, C, F] and the dense FFNs' [N, F]): the backward pass then reads it for the down projection's
    weight gradient instead of running the activation again, which XLA fused with the activation's
    derivative and wrote as fp32 intermediates (K3 1024:12 profile on the H200)."""
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*_KERNEL_RESIDUALS, GLU_OUTPUT))


@REMAT_POLICIES.register("dots_kernels_glu_inputs")
def _keep_projections_kernel_residuals_glu_and_kda_inputs():
    """'dots_kernels_glu', plus the Pallas KDA kernel's own inputs (`pallas_kernels.common.KDA_INPUTS`:
    q, k, v after the short-conv branches, the gate and its cumsum, beta), which the other policies
    recompute for the kernel's backward: the conv branches' forward kernels and the gate's cumsum
    run once. K3 1024:12 at 32K tokens compiled for the H200: 54 fewer kernels, 8.5 GB and 1.8 ms of
    floor less per step, for 2.9 GiB more memory (10 bytes per token, head and channel, then; 14 since
    the backward reads the raw gate as well, for the clamp's mask)."""
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*_KERNEL_RESIDUALS, GLU_OUTPUT, KDA_INPUTS))


@REMAT_POLICIES.register("dots_kernels_glu_experts")
def _keep_projections_kernel_residuals_glu_and_expert_products():
    """'dots_kernels_glu', plus the routed experts' gate and up products and their combined outputs
    (`k3.ffn.EXPERT_PRODUCTS`), which the other '*_kernels' policies recompute (three batched expert
    GEMMs per MoE layer: the GLU's backward needs gate and up, the combine weights' gradient the
    outputs). Costs R (2 F + W) bytes of the compute dtype per MoE layer, R the expert rows
    (`k3.moe.cost.expert_product_bytes`)."""
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*_KERNEL_RESIDUALS, GLU_OUTPUT, EXPERT_PRODUCTS))


@REMAT_POLICIES.register("matmuls_kernels")
def _keep_all_matmuls_and_kernel_residuals():
    """'dots_kernels', plus the outputs of batched matmuls (the routed experts' grouped GEMMs), which
    'dots' recomputes: the least recomputation short of no remat."""
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_saveable,
        jax.checkpoint_policies.save_only_these_names(*_KERNEL_RESIDUALS))


def _constrain_stream(stream: dict, sharder: Sharder | None) -> dict:
    """Pins the residual stream's activations (and the AttnRes bank [M, B, T, D]) to the batch layout."""
    if sharder is None:
        return stream
    out = dict(stream)
    for key in ("h", "partial"):
        if key in out:
            out[key] = constrain(out[key], _ACT_BTD, sharder)
    if "bank" in out:
        out["bank"] = constrain(out["bank"], (None,) + _ACT_BTD, sharder)
    return out


class DecoderLayer(nnx.Module):
    """One layer: [AttnRes mix] -> norm -> mixer -> add; [AttnRes mix] -> norm -> FFN -> add."""

    def __init__(self, cfg, mixer: str, ffn: str, *, rngs: nnx.Rngs, track_max_logit: bool = False,
                 sharder: Sharder | None = None, may_start: bool = True):
        """may_start: whether any index this layer runs at starts an AttnRes block
        (`k3.attn_res.may_start_block`); False lets it skip the bank write."""
        self.mixer_kind, self.ffn_kind = mixer, ffn
        self.may_start = may_start
        self.sharder = sharder
        self.track_max_logit = track_max_logit and mixer == "mla"
        self.block_size = cfg.attn_res_block_size
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)
        self.mixer = (KDA(cfg, rngs=rngs, sharder=sharder) if mixer == "kda"
                      else MLA(cfg, rngs=rngs, sharder=sharder))
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)
        if ffn == "dense":
            self.ffn = GLUMLP(cfg.d_model, cfg.dense_ffn_dim, activation=cfg.activation,
                              init_std=cfg.init_std, dtype=jnp.dtype(cfg.dtype), rngs=rngs,
                              beta_gate=cfg.situ_beta_gate, beta_up=cfg.situ_beta_up)
        else:
            self.ffn = MoE(cfg, rngs=rngs, sharder=sharder)
        if cfg.residual == "attn_res":
            self.attn_mix = AttnResMix(cfg.d_model, cfg.norm_eps, rngs=rngs, impl=cfg.attn_res_impl, sharder=sharder)
            self.ffn_mix = AttnResMix(cfg.d_model, cfg.norm_eps, rngs=rngs, impl=cfg.attn_res_impl, sharder=sharder)
        else:
            self.attn_mix = self.ffn_mix = None

    def __call__(self, stream: dict, layer_idx, segment_ids_BT):
        """Returns the updated stream and this layer's statistics: MoE routing ('load', 'balance')
        and, when tracked, the MLA per-head max logit ('max_logit'); {} when there are none."""
        stream = _constrain_stream(stream, self.sharder)
        x = attn_res.read(stream, self.attn_mix, self._bank_count(layer_idx, "attention"), self.attn_norm)
        stats = {}
        if self.track_max_logit:
            a, stats["max_logit"] = self.mixer(x, segment_ids_BT, return_max_logit=True)
        else:
            a = self.mixer(x, segment_ids_BT)
        stream = attn_res.add_attention(stream, a, layer_idx, self.block_size, self.may_start)
        x = attn_res.read(stream, self.ffn_mix, self._bank_count(layer_idx, "ffn"), self.ffn_norm)
        if self.ffn_kind == "moe":
            f, layer_stats = self.ffn(x)
            stats.update(layer_stats)
        else:
            f = self.ffn(x)
        return _constrain_stream(attn_res.add_ffn(stream, f), self.sharder), stats

    def _bank_count(self, layer_idx, sublayer: str) -> int | None:
        """The bank's count at this mix when the layer index is static (an unrolled layer), so the mix
        skips the empty slots; None in a scanned body, where the index is traced."""
        return attn_res.bank_count(layer_idx, self.block_size, sublayer) if isinstance(layer_idx, int) else None

    def extend(self, stream: dict, cache: dict, layer_idx, start_B, n_valid_B, keep_inputs: bool = False):
        """Decode path of `__call__`: the mixer continues from its ``cache``; returns (stream, update):
        a KDA layer's whole new cache, or an MLA layer's new rows (see `MLA.extend`)."""
        x = attn_res.read(stream, self.attn_mix, self._bank_count(layer_idx, "attention"), self.attn_norm)
        a, cache = self.mixer.extend(x, cache, start_B, n_valid_B, keep_inputs)
        stream = attn_res.add_attention(stream, a, layer_idx, self.block_size, self.may_start)
        x = attn_res.read(stream, self.ffn_mix, self._bank_count(layer_idx, "ffn"), self.ffn_norm)
        if self.ffn_kind == "moe":
            f = self.ffn(x, decode=True)[0]
        else:
            f = self.ffn(x)
        return attn_res.add_ffn(stream, f), cache


AttnResMix = attn_res.AttnResMix


class LayerGroup(nnx.Module):
    """One period of consecutive layers (e.g. KDA, KDA, KDA, MLA), the unit that is scanned
    (`walk_layers` runs its ``layers``)."""

    def __init__(self, cfg, kinds: list[tuple[str, str]], *, rngs: nnx.Rngs, track_max_logit: bool = False,
                 sharder: Sharder | None = None, may_start: tuple[bool, ...] | None = None):
        may_start = may_start or (True,) * len(kinds)
        self.layers = nnx.List([DecoderLayer(cfg, m, f, rngs=rngs, track_max_logit=track_max_logit,
                                             sharder=sharder, may_start=s) for (m, f), s in zip(kinds, may_start)])


# How the layers that repeat with the mixer period run (``model.layer_loop``); each entry maps
# (layer kinds, first body index, period) to the number of repeats stacked into the scanned body.
# Unrolled, each layer owns its arrays: compiled for an H200, a step then moves 15-28% fewer bytes
# (no weight slices out of the stack, no zero-filled stacked gradients or carried residuals), and
# on the H200 K3 and K2 1024:12 steps ran 7.7% and 12.5% faster (BENCHMARKS.md); the scan keeps compile
# time flat in depth, which is what a CPU run and a deep model want. The choice changes the parameter tree, so a run
# records the resolved value (`resolve_layer_loop`).
LAYER_LOOPS = Table("model.layer_loop", auto={"gpu": "unroll"}, default="scan")


@LAYER_LOOPS.register("scan")
def _scan_repeats(kinds: list, start: int, period: int) -> int:
    """As many whole periods from ``start`` as repeat the first one's layer kinds."""
    repeats = 0
    if start + period <= len(kinds):
        pattern = kinds[start:start + period]
        while (start + (repeats + 1) * period <= len(kinds)
               and kinds[start + repeats * period: start + (repeats + 1) * period] == pattern):
            repeats += 1
    return repeats


@LAYER_LOOPS.register("unroll")
def _no_repeats(kinds: list, start: int, period: int) -> int:
    """Nothing stacked: every layer is its own module."""
    return 0


def resolve_layer_loop(cfg, platform: str | None = None) -> None:
    """Replaces ``cfg.model.layer_loop='auto'`` by the entry it means on ``platform`` (default: this
    process's), in place, so that a run's saved config names its parameter layout."""
    cfg.model.layer_loop = LAYER_LOOPS.resolve(cfg.model.layer_loop, platform)


def plan_layers(m, platform: str | None = None) -> tuple[list[int], tuple[int, int, int], list[int]]:
    """Splits layer indices into (unrolled head, (start, period, repeats) scanned body, unrolled tail),
    with ``m.layer_loop`` resolved for ``platform`` (default: this process's)."""
    kinds = layer_kinds(m)
    L = len(kinds)
    period = 1 if m.mixer == "mla" else m.mla_period
    start = -(-m.first_k_dense // period) * period
    repeats = LAYER_LOOPS.get(m.layer_loop, platform)(kinds, start, period)
    if repeats < 2:  # nothing worth scanning
        return list(range(L)), (0, period, 0), []
    end = start + repeats * period
    return list(range(start)), (start, period, repeats), list(range(end, L))


class Model(nnx.Module):
    """K2-style or K3-style decoder LM, built from a validated ``cfg.model`` ConfigDict.

    ``track_max_logit`` makes MLA layers report their per-head max attention logit (QK-Clip).
    ``sharder`` (a mesh and the logical-axis rules, `k3.sharding`) makes the layers constrain their
    activations, run the routed experts expert-parallel and, on a ``context`` axis, split the
    sequence; None runs on one device.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs, track_max_logit: bool = False, sharder: Sharder | None = None):
        kinds = layer_kinds(cfg)
        self.sharder = sharder
        self.remat = cfg.remat
        self.ce_chunk = cfg.ce_chunk
        self.ce_impl = cfg.ce_impl
        self.remat_policy = REMAT_POLICIES.get(cfg.remat_policy)()
        self.n_layers, self.residual, self.dtype = cfg.n_layers, cfg.residual, jnp.dtype(cfg.dtype)
        self.n_slots = attn_res.n_bank_slots(cfg.n_layers, cfg.attn_res_block_size)
        self.block_size = cfg.attn_res_block_size
        head, (start, period, repeats), tail = plan_layers(cfg)
        self.head_idx, self.tail_idx = tuple(head), tuple(tail)
        self.body_start, self.body_period, self.body_repeats = start, period, repeats
        self.embed = param(rngs, normal(1.0), (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
        bs = cfg.attn_res_block_size
        self.head_layers = nnx.List([DecoderLayer(cfg, *kinds[i], rngs=rngs, track_max_logit=track_max_logit,
                                                  sharder=sharder, may_start=attn_res.may_start_block([i], bs))
                                     for i in head])
        if repeats:
            pattern = kinds[start:start + period]
            body_starts = tuple(attn_res.may_start_block([start + r * period + j for r in range(repeats)], bs)
                                for j in range(period))

            @nnx.split_rngs(splits=repeats)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_body(r):
                return LayerGroup(cfg, pattern, rngs=r, track_max_logit=track_max_logit, sharder=sharder,
                                  may_start=body_starts)

            self.body = make_body(rngs)
        else:
            self.body = None
        self.tail_layers = nnx.List([DecoderLayer(cfg, *kinds[i], rngs=rngs, track_max_logit=track_max_logit,
                                                  sharder=sharder, may_start=attn_res.may_start_block([i], bs))
                                     for i in tail])
        self.out_mix = (AttnResMix(cfg.d_model, cfg.norm_eps, rngs=rngs, impl=cfg.attn_res_impl, sharder=sharder)
                        if cfg.residual == "attn_res" else None)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)
        self.lm_head = param(rngs, normal(cfg.init_std), (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))

    def hidden(self, tokens_BT: jax.Array, segment_ids_BT: jax.Array | None = None):
        """Final-normed hidden states [B, T, D] for int tokens [B, T], and the routing statistics.

        The statistics mirror the layer layout: {'head': [per layer], 'body': [per position in the
        period, each stacked over repeats], 'tail': [per layer]}; a dense layer's entry is {}.
        """
        emb = jnp.take(self.embed[...], tokens_BT, axis=0).astype(self.dtype)
        emb = constrain(emb, _ACT_BTD, self.sharder)
        stream = attn_res.init_stream(emb, self.residual, self.n_slots)

        def step(layer, idx, stream, _):
            stream, stats = layer(stream, idx, segment_ids_BT)
            return stream, None, stats

        # Unrolled layers are rematerialised one by one, as each scanned group is (K3's dense first
        # layer and extra last MLA layer would otherwise keep every activation for the backward pass).
        stream, _, stats = walk_layers(self, stream, step, remat=self.remat, policy=self.remat_policy)
        return attn_res.read(stream, self.out_mix, self.out_bank_count(), self.final_norm), stats

    def out_bank_count(self) -> int:
        """The bank's count when the output mix reads it (`k3.attn_res.bank_count`)."""
        return attn_res.bank_count(self.n_layers - 1, self.block_size, "ffn")

    def loss(self, tokens_BT: jax.Array, segment_ids_BT: jax.Array | None, targets_BT: jax.Array,
             mask_BT: jax.Array | None = None):
        """(Mean next-token loss over unmasked positions, aux as `__call__`'s), for [B, T] tokens,
        targets and mask. With ``model.ce_chunk`` > 0 the loss never forms the [B, T, V] logits
        (`linear_cross_entropy`)."""
        if not self.ce_chunk:
            logits, aux = self(tokens_BT, segment_ids_BT)
            return CROSS_ENTROPY[self.ce_impl](logits, targets_BT, mask_BT), aux
        h, stats = self.hidden(tokens_BT, segment_ids_BT)
        mask = jnp.ones(targets_BT.shape, jnp.float32) if mask_BT is None else mask_BT
        loss = linear_cross_entropy(h, cast(self.lm_head, self.dtype), targets_BT, mask, self.ce_chunk)
        return loss, {"expert_load": expert_loads(stats), "layer_stats": stats}

    def __call__(self, tokens_BT: jax.Array, segment_ids_BT: jax.Array | None = None):
        """Logits [B, T, V] (compute dtype) and aux outputs.

        aux: 'expert_load' [n_moe_layers, E] fp32 token counts in layer order; 'layer_stats' the
        per-layer routing statistics that `k3.moe.update_router_biases` consumes.
        """
        h, stats = self.hidden(tokens_BT, segment_ids_BT)
        logits = jnp.einsum("btd,dv->btv", h, cast(self.lm_head, self.dtype))
        logits = constrain(logits, ("batch", "seq", "act_vocab"), self.sharder)
        return logits, {"expert_load": expert_loads(stats), "layer_stats": stats}


def replace_slot(old, new, r):
    """A layer's slot after its step: ``new``, or for a stacked body slot, ``new`` at repeat ``r``."""
    if r is None:
        return new
    return jax.tree.map(lambda C, u: jax.lax.dynamic_update_index_in_dim(C, u.astype(C.dtype), r, 0), old, new)


def walk_layers(model: Model, carry, step, slots: dict | None = None, write=replace_slot, remat: bool = False,
                policy=None):
    """Runs ``step`` over every layer in order: the unrolled head, the scanned body (one ``lax.scan``
    over the repeats of a period), the unrolled tail. The one owner of the layer layout: the forward
    pass, decoding and the per-layer state built on them all go through it.

    step(layer, idx, carry, slot) -> (carry, new_slot, out): ``idx`` is the layer's index (traced in the
    body), ``slot`` its entry of ``slots`` (None without slots), e.g. a decode cache.
    slots, and the returned slots and outs: {'head': [per layer], 'body': [per position of the period,
    stacked over the repeats], 'tail': [per layer]} (see `per_layer`).
    write(old_slot, new_slot, r): the slot kept after the step; ``r`` is the repeat for a body slot
    (None for head and tail layers). The body's slots ride in the scan's carry and are written in
    place: a scan's xs -> ys would copy every stacked slot each step.
    remat: each unrolled layer and each body group is a ``jax.checkpoint`` with ``policy``.

    Returns (carry, slots or None, outs).
    """
    new = {"head": [], "body": [], "tail": []}
    outs = {"head": [], "body": [], "tail": []}

    def unrolled(part, idxs, layers, carry):
        for n, (i, layer) in enumerate(zip(idxs, layers)):
            slot = None if slots is None else slots[part][n]
            if remat:
                graphdef, state = nnx.split(layer)

                def run(state, carry, slot, i=i, graphdef=graphdef):
                    return step(nnx.merge(graphdef, state), i, carry, slot)

                carry, slot_new, out = jax.checkpoint(run, policy=policy)(state, carry, slot)
            else:
                carry, slot_new, out = step(layer, i, carry, slot)
            new[part].append(None if slots is None else write(slot, slot_new, None))
            outs[part].append(out)
        return carry

    carry = unrolled("head", model.head_idx, model.head_layers, carry)
    if model.body is not None:
        # Plain lax.scan over the stacked state: merging inside the step keeps every NNX object at
        # the step's trace level, so this runs under jit, grad and remat alike.
        graphdef, state = nnx.split(model.body)
        start, period = model.body_start, model.body_period

        def group_step(c, state_r):
            carry, r, body = c
            body = None if body is None else list(body)
            group_outs = []
            for j, layer in enumerate(nnx.merge(graphdef, state_r).layers):
                slot = None if body is None else jax.tree.map(
                    lambda x: jax.lax.dynamic_index_in_dim(x, r, 0, keepdims=False), body[j])
                carry, slot_new, out = step(layer, start + r * period + j, carry, slot)
                if body is not None:
                    body[j] = write(body[j], slot_new, r)
                group_outs.append(out)
            return (carry, r + 1, body), group_outs

        if remat:
            group_step = jax.checkpoint(group_step, policy=policy)
        body = None if slots is None else list(slots["body"])
        (carry, _, body), outs["body"] = jax.lax.scan(group_step, (carry, jnp.asarray(0, jnp.int32), body), state)
        new["body"] = body
    carry = unrolled("tail", model.tail_idx, model.tail_layers, carry)
    return carry, (None if slots is None else new), outs


def _repeat_of(var: nnx.Variable, r: int) -> nnx.Variable:
    """Repeat ``r`` of a body variable stacked over the repeats, its logical axes without 'layers'."""
    meta = {k: v for k, v in var.get_metadata().items() if k not in ("eager_sharding", "hijax", "ref")}
    axes = meta.get("out_sharding")
    if axes is not None and len(axes) == var.ndim and axes[0] == "layers":
        meta["out_sharding"] = tuple(axes[1:])
    return type(var)(var[...][r], **meta)


def unrolled(model: Model) -> Model:
    """The same model with every layer unrolled: the scanned body's stacked weights split into one
    module per layer (the arrays of ``model`` are not changed; head, tail and the rest are shared).

    For decoding. A scan over the body slices each layer's weights out of their stack at every step,
    which is a copy of all body weights per generated token; unrolled layers read their own arrays in
    place. The cost is one copy of the body weights when this runs (inside a jitted decode loop: once,
    before the loop) and compile time that grows with depth. Caches and per-layer outputs follow the
    returned model's layout: every layer under 'head' (`per_layer`, `walk_layers`).
    """
    if model.body is None:
        return model
    graphdef, state = nnx.split(model)
    out = nnx.merge(graphdef, state)  # a new module tree over the same arrays
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    body = []
    for r in range(out.body_repeats):
        for layer in out.body.layers:
            g, st = nnx.split(layer)
            body.append(nnx.merge(g, jax.tree.map(lambda v, r=r: _repeat_of(v, r), st, is_leaf=is_var)))
    out.head_layers = nnx.List(list(out.head_layers) + body + list(out.tail_layers))
    out.head_idx = tuple(range(len(out.head_layers)))
    out.tail_layers, out.tail_idx = nnx.List([]), ()
    out.body, out.body_repeats = None, 0
    return out


def served(model: Model) -> Model:
    """The model as a decode server holds it: every layer unrolled (`unrolled`), each mixer's input
    projections fused into one matrix (`k3.nn.fuse_inputs`), each MLA's kv up-projection split into the
    key and value halves its decode step reads (`k3.mla.layer.MLA.split_kv_up`), each MoE's router,
    latent down-projection and shared gate/up stacked into one matrix (`k3.moe.layer.MoE.fuse_inputs`)
    and each latent MoE's two output projections into another (`k3.moe.layer.MoE.fuse_outputs`), so a
    step reads each weight once, in place. Same outputs up to matmul rounding; ``model`` itself is not
    changed. The fused weights are a copy (made once, at load time or before a jitted decode loop);
    training the served model would orthogonalise the fused matrix as one under Muon, so it is for
    inference only.
    """
    graphdef, state = nnx.split(unrolled(model))
    out = nnx.merge(graphdef, state)  # new modules over the same arrays: the fusion below is local
    for layer in out.head_layers:
        fuse = getattr(layer.mixer, "fuse_inputs", None)
        if fuse is not None and getattr(layer.mixer, FUSED_INPUTS, None) is None:
            fuse()
        for split in (getattr(layer.mixer, "split_kv_up", None), getattr(layer.ffn, "fuse_inputs", None),
                      getattr(layer.ffn, "fuse_outputs", None)):
            if split is not None:
                split()
    return out


def per_layer(model: Model, fn) -> dict:
    """``fn(layer)`` for every layer in `walk_layers`' layout; a body position's value is broadcast
    over the repeats (``fn`` sees the stacked layer, so it must not depend on its weights' values)."""
    def stacked(layer):
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (model.body_repeats,) + x.shape), fn(layer))

    return {"head": [fn(layer) for layer in model.head_layers],
            "body": [stacked(layer) for layer in model.body.layers] if model.body is not None else [],
            "tail": [fn(layer) for layer in model.tail_layers]}


def expert_loads(stats: dict) -> jax.Array:
    """Per-expert token counts [n_moe_layers, E] in layer order, from the model's routing statistics."""
    rows = [st["load"][None] for st in stats["head"] if "load" in st]
    body = [st["load"] for st in stats["body"] if "load" in st]  # each [repeats, E]
    if body:
        rows.append(jnp.stack(body, axis=1).reshape(-1, body[0].shape[-1]))
    rows += [st["load"][None] for st in stats["tail"] if "load" in st]
    return jnp.concatenate(rows, axis=0) if rows else jnp.zeros((0, 0), jnp.float32)


def layers_with_stats(model: Model, stats: dict):
    """Pairs (layer, its statistics, stacked?) for every layer, matching `Model.hidden`'s layout."""
    out = [(layer, st, False) for layer, st in zip(model.head_layers, stats["head"])]
    if model.body is not None:
        out += [(layer, st, True) for layer, st in zip(model.body.layers, stats["body"])]
    out += [(layer, st, False) for layer, st in zip(model.tail_layers, stats["tail"])]
    return out


def apply_qk_clip(model: Model, stats: dict, tau: float) -> None:
    """QK-Clip on every MLA layer from the tracked max logits of the last forward pass (in place)."""
    for layer, st, _ in layers_with_stats(model, stats):
        if "max_logit" in st:
            qk_clip(layer.mixer, st["max_logit"], tau)


def update_router_biases(model: Model, stats: dict, moe_cfg, n_tokens) -> None:
    """Moves every MoE layer's `RouterBias` in place from the model's routing statistics.

    ``stats`` is ``aux['layer_stats']`` of a forward pass, combined over micro-batches (loads and
    histograms add up; exact-QB biases average). Call after the optimizer step: the new bias is used
    from the next step. ``n_tokens`` is the number of routed tokens the statistics cover.
    """
    def fn(bias, st):
        return new_bias(bias, st, moe_cfg, n_tokens)

    for layer, st, stacked in layers_with_stats(model, stats):
        if "load" in st:
            st = {k: v for k, v in st.items() if k in ("load", "balance")}
            layer.ffn.router_bias[...] = (jax.vmap(fn) if stacked else fn)(layer.ffn.router_bias[...], st)


def linear_cross_entropy(h_BTD: jax.Array, w_DV: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array,
                         chunk: int) -> jax.Array:
    """``cross_entropy(h @ w, targets, mask)`` without the [B, T, V] logits: the sequence is cut into
    chunks of ``chunk`` tokens (the last one padded with masked tokens), and the forward and backward
    passes each compute one chunk's [B, chunk, V] logits at a time, in fp32 from the GEMM.

    Why: at K3's 163,840-token vocabulary the [B, T, V] logits are the step's largest activation
    (BENCHMARKS.md); `cross_entropy` keeps them for the backward in the compute dtype. The price is
    the logits' GEMM once more in the backward, and a scan's launches per chunk. Returns the mean loss
    (fp32 scalar); gradients for h (h's dtype) and w (w's dtype).
    """
    B, T, _ = h_BTD.shape
    pad = -T % chunk
    if pad:
        h_BTD = jnp.pad(h_BTD, ((0, 0), (0, pad), (0, 0)))
        targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))
        mask_BT = jnp.pad(mask_BT, ((0, 0), (0, pad)))
    n = (T + pad) // chunk
    # [n, B, chunk, ...]: one chunk per scan step; the batch axis stays whole (and sharded).
    h_nBcD = jnp.moveaxis(h_BTD.reshape(B, n, chunk, -1), 1, 0)
    t_nBc = jnp.moveaxis(targets_BT.reshape(B, n, chunk), 1, 0)
    m_nBc = jnp.moveaxis(mask_BT.astype(_acc(h_BTD)).reshape(B, n, chunk), 1, 0)
    return _linear_ce(h_nBcD, w_DV, t_nBc, m_nBc)


def _acc(x) -> jnp.dtype:
    """Accumulation dtype: fp32, or float64 for float64 inputs (the tests' references)."""
    return jnp.promote_types(x.dtype, jnp.float32)


def _chunk_logits(h_BcD, w_DV):
    return jnp.einsum("bcd,dv->bcv", h_BcD, w_DV, preferred_element_type=_acc(h_BcD))


def _linear_ce_sums(h_nBcD, w_DV, t_nBc, m_nBc):
    """(summed masked nll, per-token logsumexp [n, B, c]) over the chunks."""
    def one(total, xs):
        h, t, m = xs
        z = _chunk_logits(h, w_DV)
        lse = jax.nn.logsumexp(z, axis=-1)
        nll = lse - jnp.take_along_axis(z, t[..., None], axis=-1)[..., 0]
        return total + jnp.sum(nll * m), lse
    return jax.lax.scan(one, jnp.zeros((), _acc(h_nBcD)), (h_nBcD, t_nBc, m_nBc))


@jax.custom_vjp
def _linear_ce(h_nBcD, w_DV, t_nBc, m_nBc):
    total, _ = _linear_ce_sums(h_nBcD, w_DV, t_nBc, m_nBc)
    return total / jnp.maximum(jnp.sum(m_nBc), 1.0)


def _linear_ce_fwd(h_nBcD, w_DV, t_nBc, m_nBc):
    total, lse = _linear_ce_sums(h_nBcD, w_DV, t_nBc, m_nBc)
    count = jnp.maximum(jnp.sum(m_nBc), 1.0)
    return total / count, (h_nBcD, w_DV, t_nBc, m_nBc, lse, count)


def _linear_ce_bwd(res, g):
    h_nBcD, w_DV, t_nBc, m_nBc, lse, count = res

    def one(dw_DV, xs):
        h, t, m, l = xs
        dz = _softmax_minus_onehot(_chunk_logits(h, w_DV), l, t, m * (g / count))
        dz = dz.astype(h.dtype)  # the GEMMs below run in the compute dtype, accumulating in fp32
        dh = jnp.einsum("bcv,dv->bcd", dz, w_DV, preferred_element_type=_acc(h)).astype(h.dtype)
        return dw_DV + jnp.einsum("bcd,bcv->dv", h, dz, preferred_element_type=_acc(h)), dh

    dw, dh = jax.lax.scan(one, jnp.zeros(w_DV.shape, _acc(h_nBcD)), (h_nBcD, t_nBc, m_nBc, lse))
    return dh, dw.astype(w_DV.dtype), None, None


_linear_ce.defvjp(_linear_ce_fwd, _linear_ce_bwd)


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array | None = None):
    """Mean next-token cross-entropy in nats over unmasked positions, for logits [..., V] (any float
    dtype; the log-sum-exp in fp32, or float64 for float64 logits), int targets [...] and an optional
    0/1 mask [...]. Gradient for the logits only, in their dtype.

    A custom VJP keeps the passes over the logits to the few it needs: the forward reads them twice
    for the log-sum-exp (max, then the sum of exponentials; the target logits are a gather), the
    backward reads them once and writes softmax - one-hot in their dtype. Differentiating the
    log-softmax instead left XLA about eight fp32 passes over the [B, T, V] array per step
    (BENCHMARKS.md), at 32K tokens and a 16K vocabulary about half of a small model's step.
    """
    acc = _acc(logits_BTV)
    mask = jnp.ones(targets_BT.shape, acc) if mask_BT is None else mask_BT.astype(acc)
    return _cross_entropy(logits_BTV, targets_BT, mask)


def _ce_terms(logits, targets, mask):
    """(mean loss, lse [...], count) with lse the fp32 log-sum-exp over the last axis."""
    z = logits.astype(mask.dtype)
    lse = jax.nn.logsumexp(z, axis=-1)
    z_t = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0].astype(mask.dtype)
    count = jnp.maximum(jnp.sum(mask), 1.0)
    return jnp.sum((lse - z_t) * mask) / count, lse, count


@jax.custom_vjp
def _cross_entropy(logits, targets, mask):
    return _ce_terms(logits, targets, mask)[0]


def _cross_entropy_fwd(logits, targets, mask):
    loss, lse, count = _ce_terms(logits, targets, mask)
    return loss, (logits, targets, mask, lse, count)


def _softmax_minus_onehot(z, lse, targets, weight):
    """d loss / d logits for logits z [..., V] (accumulation dtype), their log-sum-exp [...], int
    targets [...] and per-token weights [...] (mask times the loss's scale): weight (softmax - one-hot)."""
    hit = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1) == targets[..., None]
    return (jnp.exp(z - lse[..., None]) - hit.astype(z.dtype)) * weight[..., None]


def _cross_entropy_bwd(res, g):
    logits, targets, mask, lse, count = res
    dz = _softmax_minus_onehot(logits.astype(lse.dtype), lse, targets, mask * (g / count))
    return dz.astype(logits.dtype), None, None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def cross_entropy_autodiff(logits_BTV: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array | None = None):
    """`cross_entropy` as autodiff of the fp32 log-softmax (same shapes and value; XLA's backward makes
    several more fp32 passes over the logits). Kept as ``model.ce_impl='autodiff'`` for comparisons."""
    logp = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets_BT[..., None], axis=-1)[..., 0]
    if mask_BT is None:
        return jnp.mean(nll)
    mask = mask_BT.astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


# model.ce_impl: the loss over the whole [B, T, V] logits (model.ce_chunk = 0).
CROSS_ENTROPY = {"custom_vjp": cross_entropy, "autodiff": cross_entropy_autodiff}
