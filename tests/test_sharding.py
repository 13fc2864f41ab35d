"""Mesh training on 8 CPU devices: every mesh gives the one-device losses, gradients and router
biases, parameters are laid out as the rules say, checkpoints move between mesh shapes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import tiny_model_cfg
from k3 import sharding
from k3.config import default_config
from k3.checkpoints import abstract_like, checkpoint_manager, restore_checkpoint, save_checkpoint
from k3.steps import RunError, make_run

# Module-level state (fixtures, references) is shared: keep this file on one test worker.
pytestmark = pytest.mark.xdist_group("sharding")

B, T = 8, 32


def run_cfg(style: str, mesh: dict, optimizer: str = "muon", **moe):
    """k3_tiny- or k2_tiny-style small model on ``mesh``."""
    c = default_config()
    # Two layers keep each mesh's compile short: KDA + MLA (k3) or MLA + MLA (k2), both MoE.
    c.model = tiny_model_cfg(n_layers=2, mla_period=2)
    if style == "k2":
        c.model.update(dict(mixer="mla", activation="swiglu", residual="plain"))
        c.model.mla.update(dict(use_rope=True, output_gate=False))
        c.model.moe.update(dict(latent_dim=0, balancing="sign"))
        c.optim.update(dict(qk_clip=True, schedule="wsd"))
    c.model.moe.update(moe)
    c.data.batch_size, c.data.seq_len = B, T
    c.optim.warmup_steps = 0
    c.optim.name = optimizer
    for key, val in mesh.items():
        c.mesh[key] = val
    return c


def make_batch(seed: int) -> dict:
    r = np.random.default_rng(seed)
    inputs = r.integers(0, 97, (B, T)).astype(np.int32)
    # Documents of random lengths, some boundaries falling on context-shard edges.
    segments = np.cumsum(r.random((B, T)) < 0.08, axis=1).astype(np.int32)
    segments[:, T // 2:] += 1
    return {"inputs": inputs, "targets": np.roll(inputs, -1, axis=1), "segment_ids": segments,
            "loss_mask": (r.random((B, T)) < 0.9).astype(np.float32)}


def train_steps(cfg, n_steps: int = 2):
    """(losses, grads of the first batch at the initial parameters, final state) of a short run."""
    run, state = make_run(cfg)
    batch0 = run.put_batch(make_batch(0))
    grads = jax.jit(jax.grad(lambda p, r, b: run.loss_fn(p, r, b)[0]))(state["params"], state["rest"], batch0)
    grads = jax.tree.map(np.asarray, nnx.to_pure_dict(grads))
    losses = []
    for i in range(n_steps):
        state, m = run.train_step(state, run.put_batch(make_batch(i)))
        losses.append(float(m["loss"]))
    return run, losses, grads, state


_REFERENCE = {}


def reference(style: str, optimizer: str = "muon"):
    if (style, optimizer) not in _REFERENCE:
        _REFERENCE[style, optimizer] = train_steps(run_cfg(style, {}, optimizer))
    return _REFERENCE[style, optimizer]


# (mesh, optimizer, in the quick suite): Muon's Newton-Schulz on expert-sharded matrices, AdamW
# elsewhere (a third of the compile time). The single-axis meshes data, fsdp and expert are parts
# of the mixed one, and tensor splits are also checked per layer (test_expert_parallel,
# test_context_parallel, test_pallas_kda); they and the K2 variants run as slow tests.
MESHES = {
    "data": (dict(data=8), "adamw", False),
    "fsdp": (dict(fsdp=8), "adamw", False),
    "tensor": (dict(tensor=2), "adamw", False),
    "expert": (dict(expert=8), "muon", False),
    "context": (dict(context=4), "adamw", True),
    "mixed": (dict(data=2, fsdp=2, expert=2), "adamw", True),
}
MESH_CASES = [pytest.param(name, style, marks=() if quick and style == "k3" else pytest.mark.slow)
              for name, (_, _, quick) in MESHES.items() for style in ("k3", "k2")]


@pytest.mark.parametrize("mesh_name, style", MESH_CASES)
def test_mesh_matches_one_device(mesh_name, style):
    mesh, optimizer, _ = MESHES[mesh_name]
    _, ref_losses, ref_grads, ref_state = reference(style, optimizer)
    run, losses, grads, state = train_steps(run_cfg(style, mesh, optimizer))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    flat_ref, flat = jax.tree.leaves(ref_grads), jax.tree.leaves(grads)
    for g_ref, g in zip(flat_ref, flat):
        scale = max(float(np.max(np.abs(g_ref))), 1e-6)
        np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-5 * scale)
    # Router biases come from the summed histograms / loads: the global-batch statistics.
    for b_ref, b in zip(jax.tree.leaves(ref_state["rest"]), jax.tree.leaves(state["rest"])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(b_ref), atol=1e-6)
    assert_laid_out_by_rules(run, state)


def assert_laid_out_by_rules(run, state):
    """Each parameter's sharding is the rules' spec, and each device holds only its shard."""
    sharder = run.sharder
    flat = jax.tree_util.tree_leaves_with_path(state["params"], is_leaf=lambda x: isinstance(x, nnx.Variable))
    n_sharded = 0
    for path, var in flat:
        axes = sharding.variable_axes(var)
        want = sharder.spec(axes, var.shape)
        arr = var[...]
        assert arr.sharding.spec == want or arr.sharding.is_equivalent_to(NamedSharding(sharder.mesh, want), arr.ndim), \
            (jax.tree_util.keystr(path), arr.sharding.spec, want)
        shard_shape = arr.addressable_shards[0].data.shape
        expected = tuple(d // math.prod(sharder.size(a) for a in sharding.spec_axes(e))
                         for d, e in zip(arr.shape, tuple(want) + (None,) * (arr.ndim - len(want))))
        assert shard_shape == expected, (jax.tree_util.keystr(path), shard_shape, expected)
        n_sharded += shard_shape != arr.shape
    if any(sharder.size(a) > 1 for a in ("fsdp", "tensor", "expert")):
        assert n_sharded > 0


def test_expert_mesh_shards_experts_and_fsdp_shards_embed():
    run, state = make_run(run_cfg("k3", dict(fsdp=2, expert=4)))
    ffn = state["params"]["head_layers"][0]["ffn"]
    w_gate = ffn["w_gate"][...]  # [E=8, W, F]: 2 experts per device, W split over fsdp
    assert w_gate.sharding.spec == P("expert", "fsdp", None)
    assert w_gate.addressable_shards[0].data.shape == (2, 8, 16)
    # Dense parameters: model width over fsdp and then the expert axis (ZeRO-3 over both).
    assert state["params"]["embed"][...].sharding.spec == P(None, ("fsdp", "expert"))
    # Optimizer moments follow their parameters.
    opt_leaves = [x for p, x in jax.tree_util.tree_leaves_with_path(state["opt"])
                  if "'w_gate'" in jax.tree_util.keystr(p) and x.shape == w_gate.shape]
    assert opt_leaves and all(x.sharding.spec == P("expert", "fsdp", None) for x in opt_leaves)


@pytest.mark.slow
def test_capacity_drops_are_counted_in_the_metrics():
    run, state = make_run(run_cfg("k3", dict(expert=4, data=2), "adamw", capacity_factor=0.25))
    _, m = run.train_step(state, run.put_batch(make_batch(0)))
    assert float(m["dropped_routes"]) > 0  # the exact count is checked in test_expert_parallel


def test_checkpoint_restores_onto_another_mesh(tmp_path):
    cfg_a = run_cfg("k3", dict(fsdp=4, expert=2), "adamw")
    run_a, state_a = make_run(cfg_a)
    expected = jax.tree.map(np.asarray, state_a)
    mngr = checkpoint_manager(cfg_a, tmp_path)
    save_checkpoint(mngr, state_a, {"pos": 1}, cfg_a)
    mngr.wait_until_finished()
    for mesh in (dict(data=2, tensor=2), {}):
        cfg_b = run_cfg("k3", mesh, "adamw")
        run_b, state_b = make_run(cfg_b)
        restored, meta = restore_checkpoint(checkpoint_manager(cfg_b, tmp_path), abstract_like(state_b))
        assert meta["data"] == {"pos": 1}
        for a, b, want in zip(jax.tree.leaves(expected), jax.tree.leaves(restored), jax.tree.leaves(state_b)):
            np.testing.assert_array_equal(np.asarray(b), a)
            assert b.sharding.is_equivalent_to(want.sharding, b.ndim)


# ---------------------------------------------------------------- rules, mesh sizes, checks
def _sharder(**sizes):
    cfg = default_config().mesh
    for k, v in sizes.items():
        cfg[k] = v
    n = math.prod(v for v in sizes.values() if v > 0) if -1 not in sizes.values() else 8
    return sharding.Sharder(sharding.make_mesh(cfg, jax.devices()[:n]))


def test_rules_resolve_with_divisibility_and_no_axis_reuse():
    sh = _sharder(fsdp=2, tensor=2, expert=2)
    assert sh.spec(("embed", "heads", "head_dim"), (32, 4, 8)) == P(("fsdp", "expert"), "tensor", None)
    assert sh.spec(("vocab", "embed"), (97, 32)) == P(None, ("fsdp", "expert"))  # tensor does not divide 97
    assert sh.spec(("embed",), (6,)) == P("fsdp")  # expert would not divide 6 / 2 = 3
    # q_lora prefers the axes embed already took in the same array: left unsharded.
    assert sh.spec(("embed", "q_lora"), (32, 16)) == P(("fsdp", "expert"), None)
    assert sh.spec(("batch", "seq"), (8, 32)) == P(("fsdp", "expert"), None)
    sh8 = _sharder(data=-1)
    assert sh8.size("data") == 8
    with pytest.raises(KeyError, match="no sharding rule"):
        sh.spec(("not_an_axis",), (4,))


def test_rule_overrides_and_mesh_errors():
    rules = dict(sharding.parse_rules("vocab=tensor+fsdp,embed="))
    assert rules["vocab"] == ("tensor", "fsdp") and rules["embed"] == ()
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        sharding.parse_rules("heads=model")
    cfg = default_config().mesh
    cfg.data, cfg.fsdp = 3, -1
    with pytest.raises(ValueError, match="not a multiple"):
        sharding.mesh_shape(cfg, 8)
    cfg.data, cfg.fsdp = 4, 4
    with pytest.raises(ValueError, match="16 devices but 8"):
        sharding.mesh_shape(cfg, 8)


def test_bad_meshes_fail_with_clear_errors():
    with pytest.raises(RunError, match="needs 16 devices"):
        make_run(run_cfg("k3", dict(data=4, fsdp=4)))
    cfg = run_cfg("k3", dict(data=8))
    cfg.data.batch_size = 4
    with pytest.raises(RunError, match="multiple of the 8 devices"):
        make_run(cfg)
    cfg = run_cfg("k3", dict(context=8))
    cfg.data.seq_len = 36
    with pytest.raises(RunError, match="seq_len=36 must be a multiple of mesh.context=8"):
        make_run(cfg)


def test_replicated_large_parameter_fails_fast():
    sh = _sharder(fsdp=8)
    state = {"big": jnp.zeros((512, 256)), "norm": jnp.zeros((256,))}
    good = {"big": sh.sharding(("embed", None), (512, 256)), "norm": sh.replicated()}
    sharding.check_sharded(state, good)
    bad = {"big": sh.replicated(), "norm": sh.replicated()}
    with pytest.raises(ValueError, match=r"99.8% of the parameters are fully replicated.*\['big'\]"):
        sharding.check_sharded(state, bad)


def test_workdir_of_an_older_schema_is_still_this_run(tmp_path):
    """A run.json written before keys were added (mesh, capacity) is the same run at the defaults."""
    import json

    from k3.checkpoints import check_workdir, run_identity, write_run_file

    cfg = run_cfg("k3", {})
    write_run_file(cfg, tmp_path)
    saved = json.loads((tmp_path / "run.json").read_text())
    del saved["identity"]["model"]["moe"]["capacity_factor"]
    for key, value in (("param_dtype", "float32"), ("style", "k3")):  # retired keys that had no effect
        saved["identity"]["model"][key] = saved["config"]["model"][key] = value
    (tmp_path / "run.json").write_text(json.dumps(saved))
    (tmp_path / "checkpoints" / "1").mkdir(parents=True)  # the identity guards a run's checkpoints
    assert check_workdir(cfg, tmp_path) is True  # accepted: the same run
    cfg.model.moe.capacity_factor = 1.0
    with pytest.raises(RunError, match="capacity_factor"):
        check_workdir(cfg, tmp_path)
    cfg.model.moe.capacity_factor = 0.0
    cfg.model.moe.ep_dispatch = "padded"  # how, not what: not part of the identity
    assert "ep_dispatch" not in json.dumps(run_identity(cfg))
    check_workdir(cfg, tmp_path)
    # The loss's form is how too: a run written before model.ce_impl (the autodiff form) resumes under either.
    for impl in ("autodiff", "custom_vjp"):
        cfg.model.ce_impl = impl
        assert "ce_impl" not in json.dumps(run_identity(cfg)) and check_workdir(cfg, tmp_path) is True


def test_layer_loop_follows_the_run_in_the_workdir(tmp_path):
    """'auto' takes the parameter layout of the run already in the workdir (a GPU run resumed on a
    CPU keeps its unrolled layers), else this platform's; a run.json written with the old
    ``scan_layers`` key is the same run under ``layer_loop``."""
    import json

    from k3.backends import targeting
    from k3.checkpoints import check_workdir, settle_layer_loop, write_run_file

    fresh = run_cfg("k3", {})
    settle_layer_loop(fresh, tmp_path / "none")
    assert fresh.model.layer_loop == "scan"  # this CPU
    with targeting("gpu"):
        on_gpu = run_cfg("k3", {})
        settle_layer_loop(on_gpu, tmp_path / "none")
    assert on_gpu.model.layer_loop == "unroll"
    write_run_file(on_gpu, tmp_path)
    (tmp_path / "checkpoints" / "1").mkdir(parents=True)
    resumed = run_cfg("k3", {})
    settle_layer_loop(resumed, tmp_path)
    assert resumed.model.layer_loop == "unroll" and check_workdir(resumed, tmp_path) is True
    explicit = run_cfg("k3", {})
    explicit.model.layer_loop = "scan"
    settle_layer_loop(explicit, tmp_path)  # a value the user named is kept, and it is another run
    with pytest.raises(RunError, match="layer_loop"):
        check_workdir(explicit, tmp_path)

    saved = json.loads((tmp_path / "run.json").read_text())
    for part in ("identity", "config"):
        del saved[part]["model"]["layer_loop"]
        saved[part]["model"]["scan_layers"] = False
    (tmp_path / "run.json").write_text(json.dumps(saved))
    old = run_cfg("k3", {})
    settle_layer_loop(old, tmp_path)
    assert old.model.layer_loop == "unroll" and check_workdir(old, tmp_path) is True
