"""The memory/communication planner: per-device parameter and optimizer bytes against hand counts,
and the command line on the full-size configs (abstract shapes only: nothing is allocated)."""

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import tiny_model_cfg

from k3 import plan as P
from k3.config import default_config
from k3.mla.cost import ATTENTION_CORE_BYTES, MLA_SCORE_BYTES, mla_residual_bytes, mla_scores
from k3.kda.cost import kda_residual_bytes
from k3.kda.layer import KDA
from k3.moe.cost import expert_product_bytes, moe_residual_bytes, moe_traced_extra_bytes
from k3.optim import param_dimension_numbers
from k3.params import count_params

# Module-level state (fixtures, references) is shared: keep this file on one test worker.
pytestmark = pytest.mark.xdist_group("plan")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE = {a: 1 for a in P.MESH_AXES}


def _cfg(**optim):
    c = default_config()
    c.model = tiny_model_cfg()
    c.optim.update(optim)
    return c


@pytest.fixture(scope="module")
def tiny():
    return P.load_model(_cfg())


def _hand_shards(axes, shape) -> int:
    """fsdp:2, expert:2 by hand: the model-width-like axes take fsdp then expert (ZeRO over both),
    the experts' width fsdp, the experts the expert axis; a mesh axis shards one dimension at most."""
    n, free = 1, {"fsdp", "expert"}
    for name, size in zip(axes, shape):
        prefs = {"embed": ("fsdp", "expert"), "q_lora": ("fsdp", "expert"), "kv_lora": ("fsdp", "expert"),
                 "decay_rank": ("fsdp", "expert"), "expert_embed": ("fsdp",), "experts": ("expert",)}.get(name, ())
        taken = 1
        for axis in prefs:
            if axis in free and size % (taken * 2) == 0:
                taken, n = taken * 2, n * 2
                free.discard(axis)
    return n


def test_param_bytes_match_hand_count(tiny):
    sh = P.plan_sharder(dict(ONE, fsdp=2, expert=2))
    pb = P.param_bytes(tiny.infos, sh)
    per = pb["per_param"]
    # embedding [97, 32] (vocab, embed): 97 does not split, 32 does over fsdp x expert.
    assert per["embed"] == 97 * 32 * 4 / 4
    assert per["lm_head"] == 32 * 97 * 4 / 4
    # routed experts [8, 16, 16] (experts, expert_embed, expert_mlp): expert x fsdp.
    assert per["head_layers/0/ffn/w_gate"] == 8 * 16 * 16 * 4 / 4
    # router [32, 8] (embed, experts): the width takes fsdp and expert, so the experts stay whole.
    assert per["head_layers/0/ffn/router"] == 32 * 8 * 4 / 4
    # norm gains stay whole; the KDA low-rank decay up-projection [8, 2, 8] splits its rank.
    assert per["head_layers/0/attn_norm/weight"] == 32 * 4
    assert per["head_layers/0/mixer/w_fb"] == 8 * 2 * 8 * 4 / 4
    hand = sum(math.prod(p.shape) * 4 / _hand_shards(p.axes, p.shape) for p in tiny.infos)
    assert pb["total"] == pytest.approx(hand, rel=1e-12)
    assert pb["global"] == sum(math.prod(p.shape) * 4 for p in tiny.infos)


def test_one_device_total_is_count_params(tiny):
    pb = P.param_bytes(tiny.infos, P.plan_sharder(ONE))
    assert pb["total"] == count_params(tiny.cfg.model)["total_params"] * 4
    assert pb["replicated"] == []


@pytest.mark.parametrize("mesh", [ONE, dict(ONE, fsdp=2, expert=2)])
def test_optimizer_bytes_follow_muon_adamw_split(tiny, mesh):
    sh = P.plan_sharder(mesh)
    ob = P.optimizer_bytes(tiny.opt_leaves, tiny.infos, sh)
    shards = dict(zip((p.name for p in tiny.infos), P.param_shards(tiny.infos, sh)))
    muon = sum(p.nbytes / shards[p.name] for p in tiny.infos
               if param_dimension_numbers(str(p.path[-1]), p.axes) is not None)
    adam = sum(2 * p.nbytes / shards[p.name] for p in tiny.infos
               if param_dimension_numbers(str(p.path[-1]), p.axes) is None)
    assert ob["muon"] == pytest.approx(muon) and ob["adam"] == pytest.approx(adam)
    assert ob["other"] < 64  # step counts and Newton-Schulz coefficients only
    assert P.optimizer_bytes_by_rule(tiny.infos, "muon", sh) == pytest.approx(muon + adam)
    kinds = {p.name: p.muon for p in tiny.infos}
    assert kinds["head_layers/0/mixer/w_q"] and kinds["head_layers/0/ffn/w_gate"]
    assert not kinds["embed"] and not kinds["head_layers/0/attn_norm/weight"]


def test_adamw_keeps_two_moments_per_parameter():
    mdl = P.load_model(_cfg(name="adamw"))
    sh = P.plan_sharder(dict(ONE, fsdp=2))
    ob = P.optimizer_bytes(mdl.opt_leaves, mdl.infos, sh)
    params = P.param_bytes(mdl.infos, sh)["total"]
    assert ob["muon"] == 0 and ob["adam"] == pytest.approx(2 * params)


def test_plan_memory_and_remat(tiny):
    full = P.plan(tiny, dict(ONE, fsdp=2, expert=2), "h200", batch=8, seq=64, remat=True)
    none = P.plan(tiny, dict(ONE, fsdp=2, expert=2), "h200", batch=8, seq=64, remat=False)
    mem = full["memory"]
    assert mem["total"] == pytest.approx(mem["params"] + mem["optimizer"] + mem["gradients"]
                                         + max(mem["activations"], mem["optimizer_transient"])
                                         + mem["router_biases"])
    assert mem["gradients"] == mem["params"]
    assert full["fits"] and full["micro_batch"] == 2
    # The tiny model's 4 layers are unrolled (no scanned body); remat recomputes each one.
    assert none["memory"]["activations"] > mem["activations"]
    terms_full, terms_none = full["memory"]["activation_terms"], none["memory"]["activation_terms"]
    assert terms_full["kept_layers"] == 0 and terms_none["kept_layers"] > 0
    assert {r["what"] for r in full["collectives"]} >= {"FSDP all-gather of parameters",
                                                        "expert all-to-all (dispatch + return)"}


def test_parse_mesh_errors():
    assert P.parse_mesh("fsdp:-1,expert:2", devices=8) == dict(ONE, fsdp=4, expert=2)
    for text, devices, message in [("fsdp:2,foo:2", None, "unknown mesh axis 'foo'"),
                                   ("fsdp:x", None, "must be an integer"),
                                   ("fsdp:-1", None, "--devices"),
                                   ("fsdp:3,expert:2", 8, "multiply to 6"),
                                   ("fsdp:2,fsdp:2", None, "twice")]:
        with pytest.raises(P.PlanError, match=message):
            P.parse_mesh(text, devices)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "launch.plan", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_cli_full_k3_on_512_h200s():
    r = _cli("--config=experiments/configs/k3_full.py", "--mesh=fsdp:8,expert:64", "--device=h200", "--batch=512")
    assert r.returncode == 0, r.stderr
    assert "512 x NVIDIA H200" in r.stdout
    assert "verdict: FITS" in r.stdout or "verdict: DOES NOT FIT" in r.stdout


def test_cli_suggest_finds_a_mesh_for_1024_h200s():
    r = _cli("--config=experiments/configs/k3_full.py", "--suggest", "--devices=1024", "--device=h200",
             "--config.model.moe.capacity_factor=1.25", "--suggest_contexts=8", "--top=3")
    assert r.returncode == 0, r.stderr
    assert "suggested: --mesh=" in r.stdout and "FITS at" in r.stdout


def test_cli_bad_mesh_exits_nonzero():
    r = _cli("--config=experiments/configs/k3_tiny.py", "--mesh=fsdp:2,foo:2")
    assert r.returncode != 0
    assert "unknown mesh axis 'foo'" in r.stderr


def test_plan_follows_the_kernels_the_platform_runs():
    """'auto' resolves on the planned device: on an H200 the flash kernel keeps no [B, H, T, S] scores
    (XLA's softmax keeps 16 B per score), and a GPU-only kernel planned for a TPU is a PlanError."""
    def kept(impl, device="h200"):
        c = _cfg()
        c.model.mla.attention_impl = impl
        res = P.plan(P.load_model(c), ONE, device, batch=2, seq=256, remat=False)
        return res["memory"]["activation_terms"]["kept_layers"]

    c = _cfg()
    n_mla = sum(m == "mla" for m, _ in P.layer_kinds(c.model))
    H, dqk, dv = c.model.mla.n_heads, c.model.mla.qk_nope_dim + c.model.mla.qk_rope_dim, c.model.mla.v_head_dim
    scores = n_mla * 2 * H * 256 * 256
    cores = {impl: n_mla * ATTENTION_CORE_BYTES[impl](2 * 256, H, dqk, dv, 4, 4) for impl in ("xla", "flash")}
    assert kept("xla") - kept("auto") == pytest.approx(scores * MLA_SCORE_BYTES + cores["xla"] - cores["flash"])
    assert kept("auto") == kept("flash") != kept("cudnn")
    assert kept("auto", "tpu-v5p") == kept("xla", "tpu-v5p") > kept("xla")  # and the jnp KDA core there
    with pytest.raises(P.PlanError, match="attention_impl='cudnn' runs only on gpu"):
        kept("cudnn", "tpu-v5p")


def test_saved_residual_bytes_follow_the_remat_policy_and_the_tokens():
    """Traced residuals: 'full' keeps less than 'dots', which keeps less than 'dots_kernels' with the
    GPU's kernels (their named residuals), less than 'dots_kernels_glu' (the gated activations'
    outputs too) and than no remat; they grow linearly with the batch (the parts that do not, such
    as the bf16 weight copies, cancel in the differences)."""
    def saved(policy, batch, remat=True, platform="gpu"):
        c = default_config()
        c.model = tiny_model_cfg(dtype="bfloat16")
        c.model.remat, c.model.remat_policy = remat, policy
        return P.saved_residual_bytes(c, batch, 32, platform=platform)

    full, dots, kernels, glu, none = (saved("full", 2), saved("dots", 2), saved("dots_kernels", 2),
                                      saved("dots_kernels_glu", 2), saved("full", 2, remat=False))
    assert 0 < full < dots < kernels < glu < none
    one, two, four = saved("dots", 1), dots, saved("dots", 4)
    assert four - two == pytest.approx(2 * (two - one), rel=0.05)
    # The CPU's kernels (jnp chunked KDA, XLA attention) name no residuals: the two policies differ
    # only by the kept bf16 weight casts, which do not grow with the batch and are at most 2 bytes a
    # parameter.
    casts = [saved("dots_kernels", b, platform="cpu") - saved("dots", b, platform="cpu") for b in (1, 4)]
    n_params = count_params(tiny_model_cfg(dtype="bfloat16"))["total_params"]
    assert casts[0] == casts[1]
    assert 0.5 * n_params < casts[0] / 2 <= n_params


def test_kept_kda_inputs_are_what_the_traced_step_keeps():
    """'dots_kernels_glu_inputs' keeps the Pallas KDA kernel's inputs (q, k, v, the gate and its
    cumsum, beta) of every KDA layer: the traced residuals exceed 'dots_kernels_glu''s by exactly the
    planner's 'kept_inputs', at two batches, and the recomputed group's working set no longer holds
    its inputs; with the jnp KDA core nothing is named and both agree."""
    def cfg(policy):
        c = default_config()
        c.model = tiny_model_cfg(dtype="bfloat16", **{"kda.head_dim": 16})
        c.model.remat, c.model.remat_policy = True, policy
        return c

    for batch in (1, 3):
        extra = (P.saved_residual_bytes(cfg("dots_kernels_glu_inputs"), batch, 32, platform="gpu")
                 - P.saved_residual_bytes(cfg("dots_kernels_glu"), batch, 32, platform="gpu"))
        terms = {p: P.plan(P.load_model(cfg(p)), ONE, "h200", batch=batch, seq=32,
                           remat=True)["memory"]["activation_terms"]
                 for p in ("dots_kernels_glu_inputs", "dots_kernels_glu")}
        planned = terms["dots_kernels_glu_inputs"]["kept_inputs"]
        assert extra == planned > 0, (batch, extra, planned)
        assert terms["dots_kernels_glu"]["kept_inputs"] == 0
        freed = terms["dots_kernels_glu"]["working_set"] - terms["dots_kernels_glu_inputs"]["working_set"]
        assert 0 < freed < planned, (freed, planned)
    assert (P.saved_residual_bytes(cfg("dots_kernels_glu_inputs"), 2, 32, platform="cpu")
            == P.saved_residual_bytes(cfg("dots_kernels_glu"), 2, 32, platform="cpu"))


def _output(layer, x, seg):
    # MoE takes no segments and returns (y, statistics).
    return layer(x)[0] if hasattr(layer, "route") else layer(x, seg)


def _traced_layer_residuals(layer_cls, cfg, batch: int, seq: int, platform: str) -> float:
    """Bytes of one ``layer_cls`` layer's VJP residuals for a bf16 input [batch, seq, D], less the
    compute-dtype copies of its parameters (the planner counts those as kept weights)."""
    from flax import nnx

    from k3 import backends

    def residuals():
        layer = layer_cls(cfg.model, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
        x = jnp.zeros((batch, seq, cfg.model.d_model), jnp.bfloat16)
        seg = jnp.ones((batch, seq), jnp.int32)
        ids = {id(a) for a in jax.tree.leaves(params)}
        vjp = jax.vjp(lambda p, x: _output(nnx.merge(graphdef, p, rest), x, seg), params, x)[1]
        return [a for a in jax.tree.leaves(vjp) if id(a) not in ids and hasattr(a, "dtype")], params

    with backends.targeting(platform):
        leaves, params = jax.eval_shape(residuals)
    nbytes = lambda xs, size=None: sum(math.prod(a.shape) * (size or a.dtype.itemsize) for a in xs)  # noqa: E731
    return nbytes(leaves) - nbytes(jax.tree.leaves(params), 2)


@pytest.mark.parametrize("platform,conv", [("gpu", "pallas"), ("gpu", "xla"), ("cpu", "xla")])
def test_kda_residuals_are_what_the_traced_layer_keeps(platform, conv):
    """The planner's KDA layer bytes (`k3.kda.cost.kda_residual_bytes`) within 2% of the residuals
    JAX traces for the layer, for the Pallas core (GPU) with either conv backend and the jnp chunked
    core (CPU), at head dims 16-64, chunks 16-32 and a projection width unequal to d_model."""
    for heads, head_dim, chunk in ((4, 16, 16), (2, 64, 32), (3, 32, 16)):
        c = default_config()
        c.model = tiny_model_cfg(dtype="bfloat16", d_model=64, **{"kda.n_heads": heads, "kda.head_dim": head_dim,
                                                                "kda.chunk_size": chunk, "kda.conv_impl": conv})
        batch, seq = 2, 64
        traced = _traced_layer_residuals(KDA, c, batch, seq, platform)
        lay = P.make_layout(c, P.plan_sharder(ONE), batch, seq, platform=platform)
        assert (lay.kda_core, lay.kda_conv) == ("pallas" if platform == "gpu" else "chunk", conv)
        planned = kda_residual_bytes(c.model, lay, 2, False)[0]["kda"]
        assert planned == pytest.approx(traced, rel=0.02), (heads, head_dim, chunk, planned, traced)


@pytest.mark.parametrize("impl", ["flash", "xla"])
def test_mla_residuals_are_what_the_traced_layer_keeps(impl):
    """The planner's MLA layer bytes (`k3.mla.cost.mla_residual_bytes`) within 2% of the residuals JAX
    traces for the layer on a GPU's flash kernel and on XLA's softmax, with and without RoPE, the
    output gate and the query latent, at head widths that pad (d_v = 24) and that do not. XLA's scores
    are set apart: the trace keeps 11 bytes per score (mask, fp32 logits and exp, bf16 probabilities),
    the planner the 16 measured on the GPU (MLA_SCORE_BYTES)."""
    from k3.mla.layer import MLA

    for (rope, gate, rq), (H, dn, dr, dv, rkv) in zip(
            [(True, False, 40), (False, True, 40), (True, True, 0)], [(3, 32, 16, 32, 56), (4, 16, 8, 24, 16),
                                                                        (2, 40, 8, 16, 24)]):
        c = default_config()
        c.model = tiny_model_cfg(dtype="bfloat16", d_model=96, **{
            "mla.n_heads": H, "mla.qk_nope_dim": dn, "mla.qk_rope_dim": dr, "mla.v_head_dim": dv,
            "mla.q_lora_rank": rq, "mla.kv_lora_rank": rkv, "mla.attention_impl": impl, "mla.output_gate": gate,
            "mla.use_rope": rope})
        batch, seq = 2, 64
        traced = _traced_layer_residuals(MLA, c, batch, seq, "gpu")
        lay = P.make_layout(c, P.plan_sharder(ONE), batch, seq, platform="gpu")
        planned = mla_residual_bytes(c.model, lay, 2, False)[0]["mla"]
        if impl == "xla":
            scores = mla_scores(c.model, lay)
            planned, traced = planned - scores * MLA_SCORE_BYTES, traced - scores * 11
        assert planned == pytest.approx(traced, rel=0.02), (impl, rope, gate, rq, planned, traced)


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_moe_residuals_are_what_the_traced_layer_keeps(platform):
    """The planner's MoE layer bytes (`k3.moe.cost.moe_residual_bytes`) within 2% of the residuals JAX
    traces for the layer once the trace's own difference (`moe_traced_extra_bytes`) is added back:
    capacity experts (GPU) and ragged ones (CPU), with and without the latent and the shared expert,
    SiTU-GLU and SwiGLU."""
    from k3.moe.layer import MoE

    for E, k, F, W, Fs, act in ((8, 2, 16, 16, 24, "situ"), (16, 4, 32, 0, 0, "swiglu"), (8, 3, 24, 32, 16, "swiglu")):
        c = default_config()
        c.model = tiny_model_cfg(dtype="bfloat16", d_model=64, activation=act, **{
            "moe.n_experts": E, "moe.top_k": k, "moe.expert_dim": F, "moe.latent_dim": W, "moe.shared_dim": Fs})
        batch, seq = 2, 64
        traced = _traced_layer_residuals(MoE, c, batch, seq, platform)
        lay = P.make_layout(c, P.plan_sharder(ONE), batch, seq, platform=platform)
        planned = moe_residual_bytes(c.model, lay, 2, False)[0]["moe"] + moe_traced_extra_bytes(c.model, lay, 2)
        assert planned == pytest.approx(traced, rel=0.02), (platform, E, k, F, W, Fs, act, planned, traced)


def test_kept_expert_products_are_what_the_traced_step_keeps():
    """'dots_kernels_glu_experts' keeps every MoE layer's expert gate/up products and combined
    outputs: the traced residuals exceed 'dots_kernels_glu''s by exactly the planner's count, for
    the capacity experts (GPU) and the dropless ragged ones (CPU), at two batches and two capacities."""
    def cfg(policy, capacity):
        c = default_config()
        c.model = tiny_model_cfg(dtype="bfloat16")
        c.model.remat, c.model.remat_policy = True, policy
        c.model.moe.expert_capacity = capacity
        return c

    n_moe = sum(ffn == "moe" for _, ffn in P._layers(cfg("dots_kernels_glu", 1.0).model)[0])
    assert n_moe > 0
    for platform, batch, capacity in (("gpu", 1, 1.25), ("gpu", 3, 2.0), ("cpu", 2, 1.25)):
        extra = (P.saved_residual_bytes(cfg("dots_kernels_glu_experts", capacity), batch, 32, platform=platform)
                 - P.saved_residual_bytes(cfg("dots_kernels_glu", capacity), batch, 32, platform=platform))
        c = cfg("dots_kernels_glu_experts", capacity)
        lay = P.make_layout(c, P.plan_sharder(ONE), batch, 32, platform=platform)
        assert lay.experts == ("capacity" if platform == "gpu" else "ragged")
        per_layer = expert_product_bytes(c.model, lay, 2)
        assert extra == n_moe * per_layer > 0, (platform, batch, extra, per_layer)
    terms = {p: P.plan(P.load_model(cfg(p, 1.25)), ONE, "h200", batch=2, seq=32, remat=True)["memory"]
             ["activation_terms"]["kept_inputs"] for p in ("dots_kernels_glu_experts", "dots_kernels_glu")}
    assert terms["dots_kernels_glu"] == 0 and terms["dots_kernels_glu_experts"] > 0


# ---------------------------------------------------------------------------------------------
# Muon's Newton-Schulz: FLOPs per update and the update's transient memory


def _ns_flops_by_hand(infos, shards_of) -> float:
    total = 0.0
    for p in infos:
        d = param_dimension_numbers(str(p.path[-1]), p.axes)
        if d is None:
            continue
        r = math.prod(p.shape[i] for i in d.reduction_axis)
        o = math.prod(p.shape[i] for i in d.output_axis)
        m, n = min(r, o), max(r, o)
        total += 5 * (4 * m * m * n + 2 * m ** 3) * (math.prod(p.shape) // (r * o)) / shards_of(p)
    return total


@pytest.mark.parametrize("mesh", [ONE, dict(ONE, fsdp=2, expert=2)])
def test_newton_schulz_flops_per_device_and_optimizer_time(tiny, mesh):
    est = P.plan(tiny, mesh, "h200", batch=8, seq=64)
    sharded = mesh is not ONE
    hand = _ns_flops_by_hand(tiny.infos, lambda p: _hand_shards(p.axes, p.shape) if sharded else 1)
    t = est["time"]
    assert t["newton_schulz_flops_per_device"] == pytest.approx(hand, rel=1e-12)
    assert t["optimizer_s"] == pytest.approx(hand / (P.DEVICES["h200"].bf16_flops * t["mfu"]))
    assert t["step_s_serial"] == pytest.approx(t["compute_s"] + t["comm_s"] + t["optimizer_s"])
    adamw = P.plan(P.load_model(_cfg(name="adamw")), mesh, "h200", batch=8, seq=64)
    assert adamw["time"]["optimizer_s"] == 0 and adamw["memory"]["optimizer_transient"] == 0


@pytest.mark.parametrize("ns", ["grouped", "folded"])
@pytest.mark.parametrize("mu_dtype", ["bfloat16", "float32"])
def test_optimizer_transient_bounds_xla_temporaries(mu_dtype, ns):
    """The planned transient of the update is within 1.6x of the temporaries XLA's CPU compiler
    assigns to the real update (k3.optim's Muon, compiled on abstract shapes), for per-leaf and
    grouped Newton-Schulz: an upper bound in fp32. With bf16 moments the CPU compile runs every bf16
    dot on fp32 copies of its operands, which the plan does not count: down to 0.8x per leaf, and
    down to 0.65x grouped, where the copies are of whole concatenated groups (measured 0.88 and
    0.71). On the H200 the update of K2 1024:12 keeps 3.5 GiB of temporaries against the 12.7
    planned (BENCHMARKS.md)."""
    import jax
    import optax
    from flax import nnx

    from k3 import optim
    from k3.params import abstract_model

    c = _cfg(mu_dtype=mu_dtype, newton_schulz=ns)
    c.model = tiny_model_cfg(d_model=128, **{"moe.expert_dim": 128, "moe.latent_dim": 64, "moe.shared_dim": 128})
    params = nnx.state(abstract_model(c.model), nnx.Param)
    tx, _ = optim.build_optimizer(c, params)

    def update(state, grads):
        p, o = state
        u, o = tx.update(grads, o, p)
        return optax.apply_updates(p, u), o

    state = (params, jax.eval_shape(tx.init, params))
    xla = jax.jit(update, donate_argnums=0).lower(state, params).compile().memory_analysis().temp_size_in_bytes
    mdl = P.load_model(c)
    est = P.plan(mdl, ONE, "h200", batch=1, seq=16)
    planned = est["memory"]["optimizer_transient"]
    low = 1.0 if mu_dtype == "float32" else {"folded": 0.8, "grouped": 0.65}[ns]
    assert low <= planned / xla <= 1.6, (planned, xla)
    # At 16 tokens the update's transient, not the activations, sets the peak, and the plan says so.
    assert planned > est["memory"]["activations"]
    assert any("optimizer update's transient" in n for n in est["notes"])
    work = P.muon_work(mdl.infos, [1] * len(mdl.infos), 2 if mu_dtype == "bfloat16" else 4)
    assert 0 < work["largest"] < work["transient"] == pytest.approx(planned)


def test_lm_head_term_follows_the_loss_form():
    """The LM-head term: the whole logits once in the compute dtype with the loss's own VJP (their
    gradient takes their place), logits plus fp32 log-softmax under autodiff, and with model.ce_chunk
    one chunk's logits (micro rows x chunk positions) plus a fp32 logsumexp per token."""
    terms = {}
    for chunk, impl in ((0, "custom_vjp"), (0, "autodiff"), (16, "custom_vjp")):
        cfg = _cfg()
        cfg.model.vocab_size, cfg.model.ce_chunk, cfg.model.ce_impl = 4096, chunk, impl
        cfg.model.dtype = "bfloat16"
        est = P.plan(P.load_model(cfg), ONE, "h200", batch=4, seq=64, remat=False)
        terms[chunk, impl] = est["memory"]["activation_terms"]["lm_head"]
    a, N = 2, 4 * 64
    assert terms[0, "autodiff"] - terms[0, "custom_vjp"] == pytest.approx(N * 4096 * 4)
    assert terms[0, "autodiff"] - terms[16, "custom_vjp"] == pytest.approx((N - 4 * 16) * 4096 * (a + 4) - 4 * N)
