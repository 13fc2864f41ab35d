"""Multi-head Latent Attention (K2) and Gated MLA (K3): the layer, QK-Clip and the attention
backends' table (`k3.mla.layer`)."""

from k3.mla.layer import ATTENTION, MLA, attention

__all__ = ["ATTENTION", "MLA", "attention"]
