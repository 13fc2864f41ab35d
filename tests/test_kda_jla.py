"""model.kda.impl='jla' (jax-linear-attention's Mosaic GPU kernels) against the jnp chunked reference.

The kernels run on Hopper GPUs only (JAX 0.11.2, the 'jla' extra), so these tests run on such a
machine; elsewhere the backend refuses to build (tests/test_backends.py) and its config rules are
checked on the CPU.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3.kda.ops import kda_core

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu" or importlib.util.find_spec("jla") is None,
    reason="the jax-linear-attention kernels need a Hopper GPU and the 'jla' extra")


def _inputs(B, T, H, K, V, seed):
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = jnp.asarray(unit(rng.standard_normal((B, T, H, K))), jnp.bfloat16)
    k = jnp.asarray(unit(rng.standard_normal((B, T, H, K))), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.bfloat16)
    g = -5.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H, K))))
    g[:, : T // 3] = -5.0  # a stretch at the gate's bound
    beta = jnp.asarray(rng.uniform(0.05, 1.0, (B, T, H)), jnp.float32)
    h0 = jnp.asarray(0.1 * rng.standard_normal((B, H, K, V)), jnp.float32)
    seg = np.ones((B, T), np.int32)
    seg[0, 77:] = 2  # a document starts inside a chunk of row 0
    do = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32)
    return (q, k, v, jnp.asarray(g, jnp.float32), beta), h0, jnp.asarray(seg), do


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("B, T, H, K, V", [(2, 200, 2, 64, 64), (1, 129, 1, 128, 128), (1, 1, 2, 64, 64)])
def test_jla_kda_matches_the_chunked_reference(B, T, H, K, V):
    """Output, final state and the six gradients, at lengths that are not chunk multiples, with a
    document start inside a chunk and an initial state; bf16 kernels against the fp32 reference."""
    args, h0, seg, do = _inputs(B, T, H, K, V, seed=T)

    def run(impl):
        def f(q, k, v, g, beta, h0):
            up = (lambda x: x.astype(jnp.float32)) if impl == "chunk" else (lambda x: x)
            o, final = kda_core(up(q), up(k), up(v), g, beta, impl=impl, initial_state=h0, output_final_state=True,
                                segment_ids=seg, chunk_size=64)
            return jnp.sum(o.astype(jnp.float32) * do), (o, final)

        (_, (o, final)), grads = jax.value_and_grad(f, argnums=range(6), has_aux=True)(*args, h0)
        return o, final, grads

    o, final, grads = run("jla")
    o_ref, final_ref, grads_ref = run("chunk")
    assert o.shape == (B, T, H, V) and final.shape == (B, H, K, V) and final.dtype == jnp.float32
    assert _rel(o, o_ref) < 1e-2
    assert _rel(final, final_ref) < 1e-2
    for name, g, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, grads_ref):
        assert _rel(g, r) < 3e-2, name
