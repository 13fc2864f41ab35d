"""Core numerical ops (attention kernels, gates) in plain JAX."""
