"""Whole models: tiny K2 and K3 forward/backward, causality, dtypes, layer planning, configs."""

import collections
import contextlib
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.interpreters import partial_eval as pe
from jax._src.pallas.pallas_call import pallas_call_p

from conftest import forward, tiny_model_cfg
from k3.config import ConfigError, default_config, layer_kinds, validate
from k3.model import Model, cross_entropy, plan_layers


def _load(name):
    return importlib.import_module(f"experiments.configs.{name}").get_config()


def _loss_and_grads(model, tokens, seg=None):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def run(params):
        def loss_fn(p):
            logits, aux = nnx.merge(graphdef, p, rest)(tokens, seg)
            return cross_entropy(logits[:, :-1], tokens[:, 1:]), aux
        return jax.value_and_grad(loss_fn, has_aux=True)(params)
    return run(params)


@pytest.mark.parametrize("name", ["k3_tiny", "k2_tiny"])
def test_tiny_models_forward_backward(name):
    cfg = _load(name)
    validate(cfg)
    model = Model(cfg.model, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 48), 0, cfg.model.vocab_size)
    seg = jnp.concatenate([jnp.ones((2, 20), jnp.int32), jnp.full((2, 28), 2, jnp.int32)], axis=1)
    (loss, aux), grads = _loss_and_grads(model, tokens, seg)
    assert abs(float(loss) - math.log(cfg.model.vocab_size)) < 0.1
    leaves = jax.tree.leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert sum(float(jnp.sum(g ** 2)) for g in leaves) > 0
    n_moe = sum(f == "moe" for _, f in layer_kinds(cfg.model))
    assert aux["expert_load"].shape == (n_moe, cfg.model.moe.n_experts)
    np.testing.assert_allclose(aux["expert_load"].sum(-1), 2 * 48 * cfg.model.moe.top_k)


@pytest.mark.parametrize("overrides", [{}, {"mixer": "mla", "residual": "plain", "mla.use_rope": True}])
def test_model_is_causal(overrides):
    cfg = tiny_model_cfg(**overrides)
    model = Model(cfg, rngs=nnx.Rngs(1))
    T, t = 20, 10
    tokens = jax.random.randint(jax.random.key(2), (2, T), 0, cfg.vocab_size)
    changed = tokens.at[:, t + 1:].set((tokens[:, t + 1:] + 7) % cfg.vocab_size)
    # The router bias is fixed, so routing is per token and cannot leak across positions.
    out1, _ = forward(model, tokens)
    out2, _ = forward(model, changed)
    np.testing.assert_allclose(out1[:, : t + 1], out2[:, : t + 1], rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(out1[:, t + 1:] - out2[:, t + 1:]))) > 1e-3


def test_layer_loop_auto_unrolls_on_a_gpu_and_scans_elsewhere():
    from k3.backends import BackendError, targeting
    from k3.model import plan_layers

    cfg = tiny_model_cfg(n_layers=12, attn_res_block_size=3, first_k_dense=1)
    assert plan_layers(cfg) == ([0, 1, 2, 3], (4, 4, 2), [])  # CPU: 'scan'
    with targeting("gpu"):
        assert plan_layers(cfg) == (list(range(12)), (0, 4, 0), [])
        cfg.layer_loop = "scan"  # named values hold on any platform
        assert plan_layers(cfg)[1] == (4, 4, 2)
    cfg.layer_loop = "stacked"
    with pytest.raises(BackendError, match="model.layer_loop='stacked' is not one of"):
        plan_layers(cfg)


@pytest.mark.slow
def test_scanned_and_unrolled_models_agree():
    """Same weights, both layer loops, rematerialised as a GPU run is: same logits and same gradient."""
    cfg = tiny_model_cfg(n_layers=12, attn_res_block_size=3, first_k_dense=1, remat=True,
                         remat_policy="dots", layer_loop="scan")
    scanned = Model(cfg, rngs=nnx.Rngs(3))
    assert scanned.body is not None and scanned.body_repeats == 2
    cfg_u = tiny_model_cfg(n_layers=12, attn_res_block_size=3, first_k_dense=1, remat=True,
                           remat_policy="dots", layer_loop="unroll")
    unrolled = Model(cfg_u, rngs=nnx.Rngs(4))
    assert unrolled.body is None
    # Copy the scanned weights into the unrolled model, layer by layer.
    state_u = nnx.state(unrolled)
    state_s = nnx.state(scanned)
    flat_u = dict(nnx.to_flat_state(state_u))
    for path, var in nnx.to_flat_state(state_s):
        if path[0] == "body":
            for r in range(scanned.body_repeats):
                layer = scanned.body_start + r * scanned.body_period + path[2]
                flat_u[("head_layers", layer) + path[3:]].set_value(var[...][r])
        elif path[0] == "tail_layers":
            flat_u[("head_layers", scanned.tail_idx[path[1]]) + path[2:]].set_value(var[...])
        else:
            flat_u[path].set_value(var[...])
    tokens = jax.random.randint(jax.random.key(5), (2, 20), 0, cfg.vocab_size)
    np.testing.assert_allclose(forward(scanned, tokens)[0], forward(unrolled, tokens)[0], rtol=2e-5, atol=2e-5)

    def embed_grad(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p):
            return cross_entropy(nnx.merge(graphdef, p, rest)(tokens)[0], tokens)

        return jax.jit(jax.grad(loss))(params)["embed"][...]

    g_s, g_u = embed_grad(scanned), embed_grad(unrolled)
    assert float(jnp.abs(g_s).max()) > 0
    np.testing.assert_allclose(g_s, g_u, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_bf16_forward_close_to_fp32():
    cfg = tiny_model_cfg()
    model32 = Model(cfg, rngs=nnx.Rngs(6))
    cfg16 = tiny_model_cfg(dtype="bfloat16")
    model16 = Model(cfg16, rngs=nnx.Rngs(6))
    tokens = jax.random.randint(jax.random.key(7), (2, 32), 0, cfg.vocab_size)
    l32, _ = forward(model32, tokens)
    l16, _ = forward(model16, tokens)
    assert l16.dtype == jnp.bfloat16
    p32 = jax.nn.softmax(l32.astype(jnp.float32), -1)
    p16 = jax.nn.softmax(l16.astype(jnp.float32), -1)
    assert float(jnp.max(jnp.abs(p32 - p16))) < 2e-2
    loss32 = cross_entropy(l32[:, :-1], tokens[:, 1:])
    loss16 = cross_entropy(l16[:, :-1], tokens[:, 1:])
    assert abs(float(loss32) - float(loss16)) < 1e-2


def test_layer_plans_of_published_models():
    k3 = _load("k3_full").model
    kinds = layer_kinds(k3)
    mla = [i + 1 for i, (m, _) in enumerate(kinds) if m == "mla"]
    assert mla == list(range(4, 93, 4)) + [93]  # 1-indexed full-attention layers of the release
    assert sum(m == "kda" for m, _ in kinds) == 69
    head, (start, period, repeats), tail = plan_layers(k3)
    assert (head, start, period, repeats, tail) == ([0, 1, 2, 3], 4, 4, 22, [92])
    k2 = _load("k2_full").model
    assert all(m == "mla" for m, _ in layer_kinds(k2))
    assert plan_layers(k2) == ([0], (1, 1, 60), [])


def test_config_errors_name_the_key():
    c = default_config()
    with pytest.raises(AttributeError):
        c.lock()
        c.model.not_a_key = 1
    c = default_config()
    c.model.mla.unknown_field = 3
    with pytest.raises(ConfigError, match="model.mla.unknown_field"):
        validate(c)
    c = default_config()
    c.model.activation = "gelu"
    with pytest.raises(ConfigError, match="model.activation"):
        validate(c)
    c = default_config()
    c.model.kda.gate_lower_bound = -6.0
    with pytest.raises(ConfigError, match="gate_lower_bound"):
        validate(c)
    c = default_config()
    c.model.update_from_flattened_dict({"first_k_dense": 99})
    with pytest.raises(ConfigError, match="first_k_dense"):
        validate(c)


@pytest.mark.slow
def test_remat_of_unrolled_and_scanned_layers_keeps_loss_and_gradients():
    """remat recomputes the layers outside the scanned body one by one and the body group by group;
    the numbers do not change. 7 layers, period 2: two unrolled head layers (the dense first one
    and the rest of its period), two scanned groups, the extra last MLA layer unrolled. Both remat
    policies ('full' keeps the inputs only, 'dots' also the projections) give the same numbers."""
    cfg = tiny_model_cfg(n_layers=7, mla_period=2, first_k_dense=1)
    head, (start, period, repeats), tail = plan_layers(cfg)
    assert head and repeats == 2 and tail
    tokens = jax.random.randint(jax.random.key(3), (2, 24), 0, cfg.vocab_size)
    segments = jnp.repeat(jnp.array([[0] * 10 + [1] * 14]), 2, axis=0)
    results = []
    for remat, policy in ((False, "full"), (True, "full"), (True, "dots")):
        cfg.remat, cfg.remat_policy = remat, policy
        graphdef, params, rest = nnx.split(Model(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)

        def loss(params):
            logits, _ = nnx.merge(graphdef, params, rest)(tokens[:, :-1], segments[:, :-1])
            return cross_entropy(logits, tokens[:, 1:])

        results.append(jax.jit(jax.value_and_grad(loss))(params))
    (l0, g0), *rest = results
    for l1, g1 in rest:
        np.testing.assert_allclose(l1, l0, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


def _live_kernel_calls(jaxpr) -> collections.Counter:
    """Pallas kernels by name that a jaxpr still runs once dead calls are removed (JAX keeps every
    pallas_call; XLA drops a kernel whose outputs nothing reads, so count as XLA would)."""
    def dce_rule(used_outs, eqn):
        return ([True] * len(eqn.invars), eqn) if any(used_outs) else ([False] * len(eqn.invars), None)

    keep = pe.dce_rules[pallas_call_p]
    pe.dce_rules[pallas_call_p] = dce_rule
    try:
        live, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    finally:
        pe.dce_rules[pallas_call_p] = keep
    counts = collections.Counter()

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive is pallas_call_p:
                counts[str(eqn.params["name"])] += 1
            for val in eqn.params.values():
                for sub in val if isinstance(val, (list, tuple)) else [val]:
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr) and eqn.primitive is not pallas_call_p:
                        walk(sub)

    walk(live)
    return counts


@pytest.mark.slow
def test_kernel_residual_policies_run_each_forward_kernel_once():
    """Under 'dots' a rematerialised layer runs the Pallas KDA and flash-attention forward kernels
    twice (forward, and again in the backward pass); 'dots_kernels' keeps what their custom_vjps
    name, so each runs once, as under 'dots_kernels_glu' (which also keeps the gated activations'
    outputs). The short-conv forward kernels feed the KDA kernel: they run again in the backward
    pass unless 'dots_kernels_glu_inputs' keeps the KDA kernel's inputs. Loss and gradients do not
    change."""
    cfg = tiny_model_cfg(**{"kda.impl": "pallas", "kda.conv_impl": "pallas", "mla.attention_impl": "flash",
                            "dtype": "bfloat16"})
    kinds = [mixer for mixer, _ in layer_kinds(cfg)]
    n_kda, n_mla = kinds.count("kda"), kinds.count("mla")
    tokens = jax.random.randint(jax.random.key(5), (2, 24), 0, cfg.vocab_size)
    results = []
    for policy, runs, conv_runs in (("dots", 2, 2), ("dots_kernels", 1, 2), ("dots_kernels_glu", 1, 2),
                                    ("dots_kernels_glu_inputs", 1, 1)):
        cfg.remat, cfg.remat_policy = True, policy
        graphdef, params, rest = nnx.split(Model(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)

        def loss(params):
            logits, _ = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
            return cross_entropy(logits, tokens[:, 1:])

        calls = _live_kernel_calls(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
        for name in ("kda_intra_fwd", "kda_state_fwd"):
            assert calls[name] == runs * n_kda, (policy, dict(calls))
        assert calls["flash_doc_fwd"] == runs * n_mla, (policy, dict(calls))
        assert calls["kda_state_bwd"] == n_kda and calls["flash_doc_dq"] == n_mla
        assert calls["kda_short_conv_fwd"] == 3 * conv_runs * n_kda, (policy, dict(calls))
        results.append(jax.jit(jax.value_and_grad(loss))(params))
    (l0, g0), *others = results
    for l1, g1 in others:
        np.testing.assert_allclose(l1, l0, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
            np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32), rtol=1e-5, atol=1e-6)


def test_the_retired_scan_layers_key_is_named_and_its_values_translate():
    from k3.config import renamed_setting

    cfg = default_config()
    with cfg.unlocked() if hasattr(cfg, "unlocked") else contextlib.nullcontext():
        cfg.model.scan_layers = False
    with pytest.raises(ConfigError, match=r"model.scan_layers is now model.layer_loop \('scan' for True"):
        validate(cfg)
    assert renamed_setting("model.scan_layers", False) == ("model.layer_loop", "unroll")
    assert renamed_setting("model.scan_layers", True) == ("model.layer_loop", "scan")
    assert renamed_setting("model.remat", True) == ("model.remat", True)
    with pytest.raises(ConfigError, match="only"):
        renamed_setting("model.scan_layers", "yes")


@pytest.mark.parametrize("B, T, chunk", [(2, 13, 4), (1, 1, 8), (3, 16, 16), (2, 9, 32)])
def test_linear_cross_entropy_equals_the_logits_form_float64(x64, B, T, chunk):
    """Loss and gradients of the chunked loss (`linear_cross_entropy`) against the logits form in
    float64: lengths not a multiple of the chunk, one token, a chunk longer than the sequence, masked
    positions."""
    from k3.model import linear_cross_entropy

    rng = np.random.default_rng(B * 100 + T)
    D, V = 6, 11
    h = jnp.asarray(rng.normal(size=(B, T, D)))
    w = jnp.asarray(rng.normal(size=(D, V)))
    t = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    mask = jnp.asarray(rng.random((B, T)) < 0.8, jnp.float64).at[0, 0].set(1.0)

    def ref(h, w):  # float64 throughout (`cross_entropy` takes its log-softmax in fp32)
        z = jnp.einsum("btd,dv->btv", h, w)
        nll = jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, t[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * mask) / jnp.sum(mask)

    def ours(h, w):
        return linear_cross_entropy(h, w, t, mask, chunk)

    (lr, gr), (lo, go) = (jax.value_and_grad(f, argnums=(0, 1))(h, w) for f in (ref, ours))
    assert lo.dtype == jnp.float64
    np.testing.assert_allclose(lo, lr, rtol=1e-12)
    for a, b in zip(go, gr):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("shape, masked", [((2, 13, 11), True), ((1, 1, 5), False), ((3, 7, 1), True),
                                           ((4, 6, 40), False)])
def test_cross_entropy_and_its_gradient_equal_the_log_softmax_form_float64(x64, shape, masked):
    """`cross_entropy`'s own VJP against autodiff of the log-softmax form, in float64: awkward
    shapes, one token, a one-word vocabulary, with and without a mask, logits far from 0."""
    from k3.model import cross_entropy

    rng = np.random.default_rng(sum(shape))
    z = jnp.asarray(rng.normal(size=shape) * 6.0 + 40.0)
    t = jnp.asarray(rng.integers(0, shape[-1], shape[:-1]), jnp.int32)
    mask = None
    if masked:
        mask = jnp.asarray(rng.random(shape[:-1]) < 0.7, jnp.float64).at[(0,) * (len(shape) - 1)].set(1.0)

    def ref(z):
        nll = -jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), t[..., None], axis=-1)[..., 0]
        return jnp.mean(nll) if mask is None else jnp.sum(nll * mask) / jnp.sum(mask)

    (lr, gr), (lo, go) = (jax.value_and_grad(f)(z) for f in (ref, lambda z: cross_entropy(z, t, mask)))
    assert lo.dtype == go.dtype == jnp.float64
    np.testing.assert_allclose(lo, lr, rtol=1e-13)
    np.testing.assert_allclose(go, gr, rtol=1e-10, atol=1e-15)
    if masked:  # masked positions get no gradient
        assert not np.any(np.asarray(go)[np.asarray(mask) == 0])


def test_cross_entropy_of_bf16_logits_takes_fp32_and_returns_a_bf16_gradient():
    """bf16 logits: the loss in fp32 equals the fp32 form on the same (rounded) logits, and the
    gradient comes back in bf16 within its rounding."""
    from k3.model import cross_entropy

    rng = np.random.default_rng(5)
    z16 = jnp.asarray(rng.normal(size=(3, 9, 50)) * 3, jnp.bfloat16)
    t = jnp.asarray(rng.integers(0, 50, (3, 9)), jnp.int32)
    mask = jnp.asarray(rng.random((3, 9)) < 0.8, jnp.float32)

    def ref(z):
        nll = -jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), t[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * mask) / jnp.sum(mask)

    lo, go = jax.value_and_grad(cross_entropy)(z16, t, mask)
    lr, gr = jax.value_and_grad(ref)(z16.astype(jnp.float32))
    assert lo.dtype == jnp.float32 and go.dtype == jnp.bfloat16
    assert float(lo) == pytest.approx(float(lr), rel=1e-6)
    np.testing.assert_allclose(np.asarray(go, np.float32), gr, rtol=1e-2, atol=2e-5)


@pytest.mark.slow  # the chunked loss's own VJP has quick tests above; this is the whole model's
@pytest.mark.parametrize("dtype, loss_rel, grad_rel", [("float32", 1e-6, 1e-4), ("bfloat16", 1e-3, 0.05)])
def test_ce_chunk_train_loss_and_gradients_match_the_whole_logits(dtype, loss_rel, grad_rel):
    """A tiny K3's training loss and gradients with model.ce_chunk, and with the whole logits' own VJP
    (model.ce_impl='custom_vjp'), against autodiff of the whole logits' log-softmax: equal in fp32; in
    bf16 within the rounding of the logits (the chunked form keeps them in fp32)."""
    from k3.config import default_config
    from k3.steps import make_run

    rng = np.random.default_rng(3)
    toks = rng.integers(0, 97, (2, 21)).astype(np.int32)
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.ones((2, 20), np.int32),
             "loss_mask": (rng.random((2, 20)) < 0.9).astype(np.float32)}
    out, evals = {}, {}
    for chunk, impl in ((0, "autodiff"), (0, "custom_vjp"), (8, "custom_vjp")):
        cfg = default_config()
        cfg.model = tiny_model_cfg(dtype=dtype, ce_chunk=chunk, ce_impl=impl)
        run, state = make_run(cfg)
        (loss, _), grads = jax.value_and_grad(run.loss_fn, has_aux=True)(state["params"], state["rest"], batch)
        out[chunk, impl] = float(loss), jax.tree.leaves(grads)
        evals[chunk, impl] = [float(x) for x in run.eval_step(state, batch)]
    ref = (0, "autodiff")
    # The whole logits' own VJP: the same logits and fp32 reductions, so equal up to summation order.
    assert out[0, "custom_vjp"][0] == pytest.approx(out[ref][0], rel=1e-6)
    for a, b in zip(out[0, "custom_vjp"][1], out[ref][1], strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= (1e-5 if dtype == "float32" else 0.01) * np.linalg.norm(b) + 1e-7
    got = (8, "custom_vjp")
    assert out[got][0] == pytest.approx(out[ref][0], rel=loss_rel)
    assert evals[got][1] == evals[ref][1] == float(batch["loss_mask"].sum())
    assert evals[got][0] == pytest.approx(evals[ref][0], rel=loss_rel)
    for a, b in zip(out[got][1], out[ref][1], strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= grad_rel * np.linalg.norm(b) + 1e-7
