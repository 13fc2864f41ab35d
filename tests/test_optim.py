"""Optimizer: LR schedules, Muon/AdamW assignment from logical axes, Muon and AdamW steps."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import all_eqns, tiny_model_cfg
from k3 import muon as muon_lib
from k3 import optim
from k3.config import default_config
from k3.model import Model, cross_entropy
from k3.params import abstract_model

# Module-level state (fixtures, references) is shared: keep this file on one test worker.
pytestmark = pytest.mark.xdist_group("optim")

# XLA's CPU backend optimisations dominate these tests' runtime (the Muon update alone unrolls
# Newton-Schulz for every matrix); the numbers do not need optimised code.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _jit(fn):
    return jax.jit(fn, compiler_options=FAST_COMPILE)


def _cfg(steps=10, **optim_overrides):
    c = default_config()
    c.steps = steps
    c.optim.update(optim_overrides)
    return c


def _dims(d):
    """MuonDimensionNumbers -> ((reduction axes), (output axes)); None stays None."""
    if d is None:
        return None
    as_tuple = lambda a: (a,) if isinstance(a, int) else tuple(a)
    return as_tuple(d.reduction_axis), as_tuple(d.output_axis)


def _n_off_band(m):
    """How many singular values lie outside [0.5, 1.5] x their median."""
    s = np.linalg.svd(np.asarray(m, np.float64), compute_uv=False)
    return int(np.sum((s < 0.5 * np.median(s)) | (s > 1.5 * np.median(s))))


def _sv_ratio(m):
    s = np.linalg.svd(np.asarray(m, np.float64), compute_uv=False)
    return s.max() / s.min()


# ---------------------------------------------------------------------------------------------
# Schedules


def test_cosine_schedule_warmup_and_end():
    o = _cfg().optim
    o.update(dict(lr=2.0, min_lr_ratio=0.1, warmup_steps=10, schedule="cosine"))
    s = optim.learning_rate_schedule(o, 100)
    ramp = np.array([float(s(t)) for t in range(11)])
    np.testing.assert_allclose(ramp, 2.0 * np.arange(1, 12) / 11, rtol=1e-6)  # linear from ~0 to peak
    assert ramp[0] < 0.1 * 2.0
    for t in (10, 37, 55, 90):
        want = 0.2 + (2.0 - 0.2) * 0.5 * (1 + math.cos(math.pi * (t - 10) / 90))
        np.testing.assert_allclose(float(s(t)), want, rtol=1e-5)
    np.testing.assert_allclose(float(s(100)), 0.2, rtol=1e-5)
    np.testing.assert_allclose(float(s(1000)), 0.2, rtol=1e-5)  # stays at the floor
    after = np.array([float(s(t)) for t in range(10, 101)])
    assert np.all(np.diff(after) <= 1e-7)


def test_warmup_length_from_fraction():
    o = _cfg().optim
    o.update(dict(warmup_steps=-1, warmup_frac=0.01))
    assert optim.warmup_steps(o, 300) == 3
    assert optim.warmup_steps(o, 10) == 1  # at least one step when warmup_frac > 0
    o.warmup_frac = 0.0
    assert optim.warmup_steps(o, 300) == 0
    o.lr = 1.0
    np.testing.assert_allclose(float(optim.learning_rate_schedule(o, 300)(0)), 1.0)  # no warmup
    o.warmup_steps = 7
    assert optim.warmup_steps(o, 300) == 7


def test_wsd_schedule_stable_then_sqrt_cooldown():
    o = _cfg().optim
    o.update(dict(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, decay_frac=0.2, schedule="wsd"))
    s = optim.learning_rate_schedule(o, 100)
    np.testing.assert_allclose(float(s(0)), 1 / 11, rtol=1e-6)
    np.testing.assert_allclose([float(s(t)) for t in range(10, 80)], 1.0, rtol=1e-6)  # flat middle
    for t in (80, 84, 90, 95, 99):
        want = 0.1 + 0.9 * (1 - math.sqrt((t - 80 + 1) / 20))
        np.testing.assert_allclose(float(s(t)), want, rtol=1e-5)
    np.testing.assert_allclose(float(s(99)), 0.1, rtol=1e-5)  # the last step runs at the minimum
    np.testing.assert_allclose(float(s(100)), 0.1, rtol=1e-5)
    np.testing.assert_allclose(float(s(150)), 0.1, rtol=1e-5)


def test_adam_schedule_is_scaled_copy():
    o = _cfg().optim
    o.update(dict(lr=3e-3, adam_lr=1e-3, warmup_steps=5, schedule="wsd"))
    s, sa = optim.learning_rate_schedule(o, 50), optim.learning_rate_schedule(o, 50, peak_lr=o.adam_lr)
    for t in (0, 3, 20, 45, 50):
        np.testing.assert_allclose(float(sa(t)), float(s(t)) * o.adam_lr / o.lr, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Dimension numbers


def test_param_dimension_numbers_rule():
    pdn = lambda name, axes, per_head=False: _dims(optim.param_dimension_numbers(name, axes, per_head))
    assert pdn("embed", ("vocab", "embed")) is None
    assert pdn("lm_head", ("embed", "vocab")) is None
    assert pdn("weight", ("norm",)) is None
    assert pdn("weight", ("layers", "norm")) is None
    assert pdn("dt_bias", ("heads", "head_dim")) is None
    assert pdn("conv_q", ("conv", "heads", "head_dim")) is None
    assert pdn("w_q", ("embed", "heads", "head_dim")) == ((0,), (1, 2))
    assert pdn("w_q", ("embed", "heads", "head_dim"), True) == ((0,), (2,))
    assert pdn("w_gate", ("embed", "heads", "head_dim"), True) == ((0,), (1, 2))  # not Q/K/V
    assert pdn("w_o", ("heads", "head_dim", "embed")) == ((0, 1), (2,))
    assert pdn("w_down", ("mlp", "embed")) == ((0,), (1,))
    assert pdn("w_beta", ("embed", "heads")) == ((0,), (1,))
    assert pdn("router", ("embed", "experts")) == ((0,), (1,))  # experts as an output dim
    assert pdn("w_up", ("layers", "experts", "expert_embed", "expert_mlp")) == ((2,), (3,))


@pytest.fixture(scope="module")
def abstract_params():
    return {
        "unrolled": nnx.state(abstract_model(tiny_model_cfg()), nnx.Param),  # KDA x3, MLA; no scan
        "scanned": nnx.state(abstract_model(tiny_model_cfg(n_layers=8)), nnx.Param),  # 2 x period 4
    }


def test_dimension_numbers_of_unrolled_model(abstract_params):
    params = abstract_params["unrolled"]
    dims, dims_ph = optim.muon_dimension_numbers(params), optim.muon_dimension_numbers(params, per_head=True)
    pure = nnx.to_pure_dict(params)
    is_leaf = lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)
    assert jax.tree.structure(dims, is_leaf=is_leaf) == jax.tree.structure(pure)
    kda, mla = dims["head_layers"][0]["mixer"], dims["head_layers"][3]["mixer"]
    kda_ph, mla_ph = dims_ph["head_layers"][0]["mixer"], dims_ph["head_layers"][3]["mixer"]
    layer = dims["head_layers"][0]
    for adam in (dims["embed"], dims["lm_head"], dims["final_norm"]["weight"], dims["out_mix"]["query"],
                 layer["attn_norm"]["weight"], layer["attn_mix"]["query"], layer["ffn_mix"]["norm"],
                 kda["A_log"], kda["dt_bias"], kda["o_norm"], kda["conv_q"], kda["conv_k"], kda["conv_v"],
                 mla["q_norm"]["weight"], mla["kv_norm"]["weight"], layer["ffn"]["latent_norm"]["weight"]):
        assert adam is None
    assert _dims(kda["w_q"]) == ((0,), (1, 2))
    assert _dims(kda_ph["w_q"]) == ((0,), (2,))
    assert _dims(kda_ph["w_k"]) == _dims(kda_ph["w_v"]) == ((0,), (2,))
    assert _dims(kda_ph["w_gate"]) == _dims(kda["w_gate"]) == ((0,), (1, 2))
    assert _dims(kda["w_o"]) == _dims(mla["w_o"]) == ((0, 1), (2,))  # [H, K, D]: reduce over (H, K)
    assert _dims(mla["q_b"]) == ((0,), (1, 2)) and _dims(mla_ph["q_b"]) == ((0,), (2,))
    assert _dims(mla_ph["kv_b"]) == ((0,), (2,))
    ffn = layer["ffn"]
    assert _dims(ffn["w_gate"]) == _dims(ffn["w_up"]) == ((1,), (2,))  # [E, W, F]: experts batched
    assert _dims(ffn["w_down"]) == ((1,), (2,))
    assert _dims(ffn["shared"]["w_down"]) == ((0,), (1,))


def test_dimension_numbers_of_scanned_model(abstract_params):
    params = abstract_params["scanned"]
    dims, dims_ph = optim.muon_dimension_numbers(params), optim.muon_dimension_numbers(params, per_head=True)
    assert not dims.get("head_layers")  # every layer is in the scanned body
    kda, mla = dims["body"]["layers"][0]["mixer"], dims["body"]["layers"][3]["mixer"]
    assert params["body"]["layers"][0]["mixer"]["w_q"].shape == (2, 32, 2, 8)
    assert _dims(kda["w_q"]) == ((1,), (2, 3))  # 'layers' (axis 0) stays a batch axis
    assert _dims(dims_ph["body"]["layers"][0]["mixer"]["w_q"]) == ((1,), (3,))
    assert _dims(kda["w_o"]) == ((1, 2), (3,))
    assert _dims(dims_ph["body"]["layers"][3]["mixer"]["kv_b"]) == ((1,), (3,))
    assert _dims(mla["kv_a"]) == ((1,), (2,))
    ffn = dims["body"]["layers"][1]["ffn"]
    assert _dims(ffn["w_up"]) == ((2,), (3,))  # [L, E, W, F]: layers and experts batched
    assert _dims(ffn["router"]) == ((1,), (2,))
    assert kda["A_log"] is None and kda["dt_bias"] is None and kda["conv_q"] is None
    assert dims["body"]["layers"][0]["attn_norm"]["weight"] is None
    assert dims["embed"] is None and dims["lm_head"] is None


def test_weight_decay_mask(abstract_params):
    mask = optim.weight_decay_mask(abstract_params["scanned"])
    mixer = mask["body"]["layers"][0]["mixer"]
    assert mask["embed"] and mask["lm_head"]
    assert mixer["w_q"] and mixer["w_o"] and mask["body"]["layers"][0]["ffn"]["w_gate"]
    assert not any([mask["final_norm"]["weight"], mask["out_mix"]["query"], mixer["A_log"],
                    mixer["dt_bias"], mixer["conv_q"], mixer["o_norm"],
                    mask["body"]["layers"][0]["attn_norm"]["weight"]])


# ---------------------------------------------------------------------------------------------
# Optimizer steps on a tiny model


def _update_fn(tx):
    def step(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return updates, optax.apply_updates(params, updates), opt_state
    return _jit(step)


@pytest.fixture(scope="module")
def tiny():
    """A one-layer MLA + LatentMoE model (params, rest, loss+grad fn) and a jitted step per optimizer."""
    mcfg = tiny_model_cfg(n_layers=1, mixer="mla")
    graphdef = nnx.graphdef(abstract_model(mcfg))
    # 'rbg' keys and one jitted init: eager threefry init compiles once per parameter shape.
    params, rest = _jit(lambda: nnx.split(
        Model(mcfg, rngs=nnx.Rngs(jax.random.key(0, impl="rbg"))), nnx.Param, ...)[1:])()
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, mcfg.vocab_size)

    @_jit
    def loss_and_grads(params):
        def loss_fn(p):
            logits, _ = nnx.merge(graphdef, p, rest)(tokens[:, :-1])
            return cross_entropy(logits, tokens[:, 1:])
        return jax.value_and_grad(loss_fn)(params)

    common = dict(lr=1e-2, adam_lr=4e-3, warmup_steps=0, weight_decay=0.1, clip_norm=1.0)
    opts = {}
    for name in ("muon", "adamw"):
        cfg = _cfg(steps=10, name=name, **common)
        tx, schedule = optim.build_optimizer(cfg, params)
        opts[name] = (cfg, tx, schedule, _update_fn(tx))
    return params, loss_and_grads, opts


def _random_like(params, seed):
    """Standard-normal arrays in the structure of ``params`` (numpy: nothing to compile)."""
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(treedef, [jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in leaves])


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_steps_reduce_loss(tiny, name):
    params, loss_and_grads, opts = tiny
    _, tx, _, step = opts[name]
    opt_state = tx.init(params)
    losses = []
    for _ in range(5):
        loss, grads = loss_and_grads(params)
        losses.append(float(loss))
        _, new_params, opt_state = step(grads, opt_state, params)
        # The train-step contract: State of Param in, State of Param (same structure, metadata) out.
        assert isinstance(new_params, nnx.State)
        assert jax.tree.structure(new_params) == jax.tree.structure(params)
        params = new_params
    assert all(np.isfinite(losses))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
    assert losses[-1] < losses[0] - 0.5, losses


def test_muon_update_is_orthogonal_and_adam_elsewhere(tiny):
    params, _, opts = tiny
    cfg, tx, schedule, step = opts["muon"]
    zeros = jax.tree.map(jnp.zeros_like, params)  # no decay term: the update is the optimizer's alone
    grads = _random_like(params, seed=0)
    updates, _, _ = step(grads, tx.init(zeros), zeros)
    u, g = nnx.to_pure_dict(updates), nnx.to_pure_dict(grads)
    lr, adam_lr = float(schedule(0)), cfg.optim.adam_lr
    q_a = np.asarray(u["head_layers"][0]["mixer"]["q_a"])  # [D, q_lora] = [32, 16]
    assert _sv_ratio(g["head_layers"][0]["mixer"]["q_a"]) > 3.0
    assert _sv_ratio(q_a) < 2.0  # Newton-Schulz flattens the spectrum (into about [0.7, 1.1])
    # consistent_rms=0.2: every Muon update has RMS ~ 0.2 * lr, whatever the shape.
    assert 0.7 < np.sqrt(np.mean(q_a ** 2)) / (0.2 * lr) < 1.2
    experts = np.asarray(u["head_layers"][0]["ffn"]["w_gate"])  # [E, W, F]: each expert on its own
    # Square Gaussian blocks now and then have one singular value too small for 5 NS steps to lift.
    assert all(_n_off_band(e) <= 1 for e in experts)
    # Adam leaves (norm gains, embedding): first step is -c * adam_lr * sign(g), c from Nesterov.
    for path in (("final_norm", "weight"), ("head_layers", 0, "attn_norm", "weight"), ("embed",)):
        uu, gg = u, g
        for k in path:
            uu, gg = uu[k], gg[k]
        mag = np.abs(np.asarray(uu))
        np.testing.assert_allclose(mag, mag.mean(), rtol=1e-2)  # |g| >> eps
        assert 0.9 < mag.mean() / adam_lr < 1.6
        assert np.all(np.sign(uu) == -np.sign(gg))


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_weight_decay_goes_where_the_mask_says(tiny, name):
    params, _, opts = tiny
    cfg, tx, schedule, step = opts[name]
    grads = jax.tree.map(jnp.zeros_like, params)  # zero gradients: the update is the decay alone
    updates, _, _ = step(grads, tx.init(params), params)
    u, p = nnx.to_pure_dict(updates), nnx.to_pure_dict(params)
    wd, lr = cfg.optim.weight_decay, float(schedule(0))
    adam_lr = cfg.optim.adam_lr if name == "muon" else lr
    mixer, ffn = ("head_layers", 0, "mixer"), ("head_layers", 0, "ffn")

    def at(tree, *path):
        for k in path:
            tree = tree[k]
        return np.asarray(tree)

    np.testing.assert_allclose(at(u, *mixer, "q_a"), -lr * wd * at(p, *mixer, "q_a"), rtol=1e-4, atol=1e-12)
    np.testing.assert_allclose(at(u, *ffn, "w_up"), -lr * wd * at(p, *ffn, "w_up"), rtol=1e-4, atol=1e-12)
    np.testing.assert_allclose(at(u, "embed"), -adam_lr * wd * at(p, "embed"), rtol=1e-4, atol=1e-12)
    np.testing.assert_allclose(at(u, "lm_head"), -adam_lr * wd * at(p, "lm_head"), rtol=1e-4, atol=1e-12)
    for path in (("final_norm", "weight"), ("out_mix", "norm"), (*mixer, "kv_norm", "weight")):
        assert np.all(at(u, *path) == 0.0)


class _HeadProjection(nnx.Module):
    """A KDA-style Q projection [D, H, K] with H*K > D, so a whole-matrix Muon update is wide."""

    def __init__(self):
        self.w_q = nnx.Param(jnp.zeros((8, 4, 8)), out_sharding=("embed", "heads", "head_dim"))
        self.o_norm = nnx.Param(jnp.ones((8,)), out_sharding=("head_dim",))


def test_per_head_muon_orthogonalises_each_head():
    params = nnx.state(_HeadProjection(), nnx.Param)
    grads = _random_like(params, seed=3)
    out = {}
    for per_head in (False, True):
        tx, _ = optim.build_optimizer(_cfg(lr=1.0, warmup_steps=0, per_head_muon=per_head), params)
        updates, _, _ = _update_fn(tx)(grads, tx.init(params), params)
        out[per_head] = np.asarray(nnx.to_pure_dict(updates)["w_q"])
    per_head_ratios = [_sv_ratio(out[True][:, h, :]) for h in range(4)]
    whole_ratios = [_sv_ratio(out[False][:, h, :]) for h in range(4)]
    assert max(per_head_ratios) < 2.0, per_head_ratios
    assert _sv_ratio(out[False].reshape(8, 32)) < 2.0  # whole-matrix Muon: the 8 x 32 matrix is
    assert max(whole_ratios) > 3.0, whole_ratios         # orthogonal, its head blocks are not


def test_bf16_first_moment_runs_newton_schulz_in_bf16_and_matches_fp32(tiny):
    params, _, opts = tiny
    cfg32, tx32, _, step32 = opts["muon"]
    cfg16 = _cfg(steps=10, name="muon", lr=1e-2, adam_lr=4e-3, warmup_steps=0, weight_decay=0.1, clip_norm=1.0,
                 mu_dtype="bfloat16")
    tx16, _ = optim.build_optimizer(cfg16, params)
    grads = _random_like(params, seed=3)
    state16 = tx16.init(params)
    jaxpr = jax.make_jaxpr(lambda g, s, p: tx16.update(g, s, p))(grads, state16, params).jaxpr
    dots = [eqn for eqn in all_eqns(jaxpr) if eqn.primitive.name == "dot_general"]
    # Every Newton-Schulz product takes bf16 operands (and accumulates in fp32).
    assert dots and all(v.aval.dtype == jnp.bfloat16 for eqn in dots for v in eqn.invars)
    mus = [x for x in jax.tree.leaves(state16) if hasattr(x, "dtype") and x.ndim >= 2]
    assert any(x.dtype == jnp.bfloat16 for x in mus)
    u32, _, _ = step32(grads, tx32.init(params), params)
    u16, _, _ = _update_fn(tx16)(grads, state16, params)
    a, b = nnx.to_pure_dict(u32), nnx.to_pure_dict(u16)
    for path in (("head_layers", 0, "mixer", "q_a"), ("head_layers", 0, "ffn", "w_gate"), ("embed",)):
        x, y = a, b
        for k in path:
            x, y = x[k], y[k]
        x, y = np.asarray(x, np.float32).ravel(), np.asarray(y, np.float32).ravel()
        # Newton-Schulz only approximates the polar factor; in bf16 its 5 steps land a few % away
        # (measured 5% on q_a), pointing the same way.
        assert np.dot(x, y) / np.linalg.norm(x) / np.linalg.norm(y) > 0.995, path
        assert np.linalg.norm(x - y) / np.linalg.norm(x) < 0.1, path
    q_a = np.asarray(b["head_layers"][0]["mixer"]["q_a"], np.float32)
    assert _sv_ratio(q_a) < 2.0  # still a flattened spectrum


# ---------------------------------------------------------------------------------------------
# Folded Newton-Schulz (k3.muon) against optax's


def _optax_ns(x, dims):
    coeffs = jnp.asarray(muon_lib.NS_COEFFS, x.dtype)
    return optax.contrib._muon.orthogonalize_via_newton_schulz(x, coeffs, 5, dimension_numbers=dims)


NS_CASES = [  # (shape, reduction axes, output axes): batched, tall, wide, square, multi-axis, one row
    ((3, 7, 12), (1,), (2,)), ((12, 5), (0,), (1,)), ((4, 6, 3, 5), (1, 2), (3,)),
    ((6, 4, 5), (0,), (1, 2)), ((5, 2, 7), (0,), (2,)), ((2, 9, 9), (1,), (2,)), ((1, 13), (0,), (1,)),
]


@pytest.mark.parametrize("shape,red,out", NS_CASES)
def test_folded_newton_schulz_is_optax_polynomial_float64(shape, red, out):
    dims = optax.contrib.MuonDimensionNumbers(red, out)
    x = jnp.asarray(np.random.default_rng(sum(shape)).standard_normal(shape))
    with jax.enable_x64(True):
        x64 = jnp.asarray(x, jnp.float64)
        ours, ref = muon_lib.newton_schulz(x64, dims), _optax_ns(x64, dims)
        assert ours.dtype == jnp.float64 and ours.shape == shape
        np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-10, atol=1e-12)


def test_folded_newton_schulz_bf16_error_no_larger_than_optax():
    """Against the float64 polynomial, on matrices of the experts' aspect: the folded form's bf16
    error (fp32 Gram and M) is at most optax's bf16 error, summed over fresh inputs."""
    rng = np.random.default_rng(7)
    err = {"folded": 0.0, "optax": 0.0}
    for shape, red, out in [((4, 48, 96), (1,), (2,)), ((4, 80, 40), (1,), (2,)), ((2, 64, 64), (1,), (2,))]:
        dims = optax.contrib.MuonDimensionNumbers(red, out)
        x = rng.standard_normal(shape)
        with jax.enable_x64(True):
            ref = np.asarray(_optax_ns(jnp.asarray(x, jnp.float64), dims))
        xb = jnp.asarray(x, jnp.bfloat16)
        for name, fn in (("folded", muon_lib.newton_schulz), ("optax", _optax_ns)):
            y = fn(xb, dims)
            assert y.dtype == jnp.bfloat16
            err[name] += np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref)
    assert err["folded"] <= err["optax"], err


def test_folded_newton_schulz_zero_matrix_gives_zero():
    dims = optax.contrib.MuonDimensionNumbers((1,), (2,))
    x = jnp.zeros((2, 4, 6)).at[1].set(1.0)
    y = np.asarray(muon_lib.newton_schulz(x, dims))
    assert np.all(y[0] == 0.0) and np.all(np.isfinite(y))


def _run_two_muons(params, impls, seeds, rtol):
    """Steps two ``optim.newton_schulz`` impls side by side on the same gradients (``seeds``),
    checking every update agrees; returns ({impl: tx}, {impl: state}, {impl: update fn}, last grads)."""
    common = dict(lr=1e-2, adam_lr=4e-3, warmup_steps=0, weight_decay=0.1, clip_norm=1.0)
    txs = {ns: optim.build_optimizer(_cfg(steps=10, name="muon", newton_schulz=ns, **common), params)[0]
           for ns in impls}
    states = {ns: tx.init(params) for ns, tx in txs.items()}
    assert jax.tree.structure(states[impls[0]]) == jax.tree.structure(states[impls[1]])
    steps = {ns: _update_fn(tx) for ns, tx in txs.items()}
    for seed in seeds:
        grads = _random_like(params, seed=seed)
        out = {ns: steps[ns](grads, states[ns], params) for ns in txs}
        for ns in txs:
            states[ns] = out[ns][2]
        for a, b in zip(jax.tree.leaves(out[impls[0]][0]), jax.tree.leaves(out[impls[1]][0])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=1e-7)
    return txs, states, steps, grads


def test_folded_muon_equals_optax_muon_and_shares_its_state(tiny):
    params = tiny[0]
    _, states, steps, grads = _run_two_muons(params, ("folded", "optax"), (10, 11, 12), rtol=2e-4)
    # Either state restores into the other: the folded step continues from optax's state.
    u, _, _ = steps["folded"](grads, states["optax"], params)
    for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(steps["optax"](grads, states["optax"], params)[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-7)


def test_grouped_newton_schulz_equals_per_leaf_float64():
    """Leaves of equal matrix shape (in any layout: batched, multi-axis, transposed storage) share one
    batched chain, a leaf over the size bound and leaves of other shapes stay alone; every output
    equals that leaf's own `newton_schulz`."""
    M = optax.contrib.MuonDimensionNumbers
    cases = [((3, 6, 10), M((1,), (2,))), ((6, 10), M((0,), (1,))), ((2, 3, 2, 10), M((1, 2), (3,))),
             ((10, 6), M((1,), (0,))), ((5, 10, 6), M((1,), (2,))), ((4, 6, 10), M((1,), (2,))),
             ((7, 7), M((0,), (1,)))]
    rng = np.random.default_rng(3)
    with jax.enable_x64(True):
        xs = [jnp.asarray(rng.standard_normal(shape)) for shape, _ in cases]
        dims = [d for _, d in cases]
        ys = muon_lib.newton_schulz_grouped(xs, dims, max_elems=200)
        for x, d, y in zip(xs, dims, ys):
            assert y.shape == x.shape and y.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(y), np.asarray(muon_lib.newton_schulz(x, d)), rtol=1e-11,
                                       atol=1e-13)
        # One chain per group: the four [6, 10] leaves of <= 200 elements (one of them stored
        # transposed) form one group; the 240-element [6, 10] leaf, the [10, 6] one and [7, 7] run alone.
        n_dots = lambda f: sum(e.primitive.name == "dot_general" for e in jax.make_jaxpr(f)(xs).eqns)
        grouped = n_dots(lambda xs: muon_lib.newton_schulz_grouped(xs, dims, max_elems=200))
        alone = n_dots(lambda xs: [muon_lib.newton_schulz(x, d) for x, d in zip(xs, dims)])
        per_chain = alone // len(xs)
        assert (alone, grouped) == (7 * per_chain, 4 * per_chain)


def test_grouped_muon_equals_folded_muon(tiny):
    params = tiny[0]
    txs, states, _, grads = _run_two_muons(params, ("grouped", "folded"), (20, 21), rtol=1e-5)
    # The tiny model has same-shape matrices in several leaves: grouping takes fewer matmuls.
    n_dots = {ns: sum(e.primitive.name == "dot_general"
                      for e in jax.make_jaxpr(lambda g, s, p: txs[ns].update(g, s, p))(grads, states[ns], params).eqns)
              for ns in txs}
    assert n_dots["grouped"] < n_dots["folded"], n_dots


def test_bench_optimizer_counts_newton_schulz_flops_and_times_the_impls():
    from experiments import bench_optimizer

    class TwoMatrices(nnx.Module):
        def __init__(self):
            # [experts, in, out] = 3 matrices 4 x 6; [layers, heads, head_dim, embed] = 2 matrices 8 x 5.
            self.w_up = nnx.Param(jnp.zeros((3, 4, 6)), out_sharding=("experts", "expert_embed", "expert_mlp"))
            self.w_o = nnx.Param(jnp.zeros((2, 2, 4, 5)), out_sharding=("layers", "heads", "head_dim", "embed"))
            self.norm = nnx.Param(jnp.ones((5,)), out_sharding=("embed",))

    flops = bench_optimizer.newton_schulz_flops(nnx.state(TwoMatrices(), nnx.Param))
    assert flops == 5 * (3 * (4 * 16 * 6 + 2 * 64) + 2 * (4 * 25 * 8 + 2 * 125))
    rows = [bench_optimizer.bench("k3:64:2", impl, [], steps=1) for impl in ("folded", "grouped", "optax")]
    for row in rows:
        assert row["ms"] > 0 and row["ns_tflop"] > 0 and row["bytes_gb"] > 0
    assert rows[0]["ns_tflop"] == rows[1]["ns_tflop"] == rows[2]["ns_tflop"]
    assert rows[1]["dots"] < rows[0]["dots"]  # K3's same-shape matrices share their chains


def test_global_norm_groups_leaves_and_equals_the_float64_norm(x64):
    """`optim.global_norm` over repeated shapes, mixed dtypes, a lone shape and a leaf past the grouping
    limit equals the float64 norm of everything; the clip built on it scales like optax's clip and keeps
    its (empty) state."""
    rng = np.random.default_rng(0)
    big = (muon_lib.GROUP_MAX_ELEMS // 1000 + 1, 1000)  # past the grouping bound
    tree = {"a": [rng.normal(size=(5, 3)) for _ in range(4)], "b": rng.normal(size=(7,)),
            "c": [rng.normal(size=big) * 1e-3 for _ in range(2)], "s": rng.normal(size=())}
    leaves = jax.tree.leaves(tree)
    want = math.sqrt(sum(float(np.sum(np.square(x))) for x in leaves))
    as_f32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)
    tree["a"][1] = jnp.asarray(tree["a"][1], jnp.bfloat16)  # a dtype group of its own
    want_mixed = math.sqrt(sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in jax.tree.leaves(tree)))
    assert float(optim.global_norm(as_f32)) == pytest.approx(want, rel=1e-6)
    assert float(optim.global_norm(jax.tree.map(jnp.asarray, tree))) == pytest.approx(want_mixed, rel=1e-6)
    mine, ref = optim.clip_by_global_norm(1.0), optax.clip_by_global_norm(1.0)
    assert jax.tree.structure(mine.init(as_f32)) == jax.tree.structure(ref.init(as_f32))
    for max_norm in (0.5 * want, 2.0 * want):  # clipped, then left alone
        got, _ = optim.clip_by_global_norm(max_norm).update(as_f32, mine.init(as_f32))
        exp, _ = optax.clip_by_global_norm(max_norm).update(as_f32, ref.init(as_f32))
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(exp)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-6, atol=0)
