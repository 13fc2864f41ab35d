"""Multi-head Latent Attention (K2) and Gated MLA (K3): the layer, QK-Clip and the attention
backends' table (`k3.mla.layer`), and attention over a sequence split across devices
(`k3.mla.parallel`)."""

from k3.mla.layer import ATTENTION, MLA, attention

__all__ = ["ATTENTION", "MLA", "attention"]
