"""Multi-head Latent Attention (K2) and Gated MLA (K3): the layer with its latent decode cache,
QK-Clip and the attention backends' table (`k3.mla.layer`), attention over a sequence split across
devices (`k3.mla.parallel`), and what a layer costs: attention FLOPs and the bytes it keeps and
sends (`k3.mla.cost`)."""

from k3.mla.layer import ATTENTION, DECODE_ATTENTION, MLA, attention

__all__ = ["ATTENTION", "DECODE_ATTENTION", "MLA", "attention"]
