"""Shared test helpers: small model configs built from the schema."""

import functools
import os
import tempfile

# Tests are dominated by XLA compile time on a small CPU: trade run-time speed for compile speed.
# Subprocesses started by the tests (the launchers) inherit this.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# One persistent compilation cache for the session, shared with the launcher subprocesses, so each
# distinct program compiles once.
_CACHE = os.path.join(tempfile.gettempdir(), f"k3-test-jax-cache-{os.getuid()}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax
import pytest

# Eight CPU devices for the mesh tests (data, fsdp, tensor, expert, context and mixed meshes).
# Single-device tests run on device 0 as before.
jax.config.update("jax_num_cpu_devices", int(os.environ.get("K3_TEST_CPU_DEVICES", "8")))
import jax.numpy as jnp
from flax import nnx

from k3.config import default_config


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_caches_per_module():
    """Drops JAX's in-memory compiled programs after each test module (the persistent disk cache
    stays). Running test_model, test_plan and test_decode in one process, XLA's CPU backend (jaxlib
    0.10.2) crashed with a segfault while serializing the K3 `generate` program in
    test_decode.py::test_speculative_generate_equals_greedy_generate (an abort in its compile when
    the disk cache was off); with the caches cleared between modules all 63 tests pass."""
    yield
    jax.clear_caches()


def tiny_model_cfg(**overrides):
    """A very small validated model config (fast to compile), with nested overrides 'a.b': v."""
    c = default_config()
    m = c.model
    m.update(dict(vocab_size=97, d_model=32, n_layers=4, dense_ffn_dim=48, attn_res_block_size=2))
    m.mla.update(dict(n_heads=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_dim=8, qk_rope_dim=4, v_head_dim=8))
    m.kda.update(dict(n_heads=2, head_dim=8, chunk_size=16))
    m.moe.update(dict(n_experts=8, top_k=2, expert_dim=16, latent_dim=16, shared_dim=24, hist_bins=64))
    for key, val in overrides.items():
        node = m
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = val
    return m


@pytest.fixture
def x64():
    """float64 for this test only, so other test files keep jax's default."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


@pytest.fixture
def small_cfg():
    return tiny_model_cfg()


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens, segment_ids):
    return nnx.merge(graphdef, state)(tokens, segment_ids)


def forward(model, tokens, segment_ids=None):
    """Jitted model forward; models of the same structure share one compilation."""
    graphdef, state = nnx.split(model)
    return _forward(graphdef, state, tokens, segment_ids)


def depth_mix_plain(cands, valid, extra, extra_valid, w, eps):
    """Block AttnRes's depth mix as plain autodiff-able jnp over the concatenated candidates: the
    reference for `k3.attn_res.depth_mix` and its kernels. cands [M, B, T, D], extra [B, T, D]."""
    v = jnp.concatenate([cands, extra[None]], axis=0)
    ok = jnp.concatenate([valid, jnp.asarray(extra_valid)[None]])
    lg = jnp.einsum("mbtd,d->mbt", v, w) / jnp.sqrt(jnp.mean(v * v, axis=-1) + eps)
    p = jax.nn.softmax(jnp.where(ok[:, None, None], lg, -jnp.inf), axis=0)
    return jnp.einsum("mbt,mbtd->btd", p, v)


def all_eqns(jaxpr):
    """The equations of a jaxpr and of every jaxpr nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for val in eqn.params.values():
            for sub in (val if isinstance(val, (tuple, list)) else [val]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from all_eqns(inner)


def greedy_step_logits(cfg, tokens_BT, max_len: int, seed: int = 3):
    """Logits [B, T, V] of feeding ``tokens_BT`` one token at a time through `k3.decode.extend` of a
    model built from ``cfg`` (weights from ``seed``), with a cache of ``max_len`` tokens per row."""
    from k3 import decode
    from k3.model import Model

    model = Model(cfg, rngs=nnx.Rngs(seed))
    ext = jax.jit(lambda t, c: decode.extend(model, t, c))
    cache = decode.init_cache(model, tokens_BT.shape[0], max_len)
    out = []
    for i in range(tokens_BT.shape[1]):
        lg, cache = ext(tokens_BT[:, i:i + 1], cache)
        out.append(lg)
    return jnp.concatenate(out, axis=1)
