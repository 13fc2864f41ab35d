"""Pallas kernels for the K3 model (GPU through the Triton lowering; CPU in interpret mode)."""
