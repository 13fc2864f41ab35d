"""Kimi Delta Attention: the layer with its decode cache and speculative replay (`k3.kda.layer`),
the delta-rule cores and their table (`k3.kda.ops`; the Pallas kernel registers there as the
'pallas' core), the core over a sequence split across devices (`k3.kda.parallel`), and what a layer
costs: forward FLOPs and the bytes it keeps and sends (`k3.kda.cost`)."""

from k3.kda.layer import KDA
from k3.kda.ops import KDA_CORES, kda_core

__all__ = ["KDA", "KDA_CORES", "kda_core"]
