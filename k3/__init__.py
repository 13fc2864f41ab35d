"""K3: pretraining Kimi-K3-style and Kimi-K2-style language models in JAX/Flax NNX."""

import flax

# Parameters carry logical axis names (``out_sharding`` metadata) that `k3.sharding` maps to a mesh.
# Flax would otherwise try to shard them eagerly at creation, which needs a mesh even on a laptop CPU.
flax.config.update("flax_always_shard_variable", False)

__version__ = "0.1.0"


def __getattr__(name):
    # `k3.generate` without importing the model code on every `import k3.<module>`.
    if name == "generate":
        from k3.decode import generate

        return generate
    raise AttributeError(f"module 'k3' has no attribute {name!r}")
