"""jtilert: lowest-latency batch-1 decoding of MLA + sparse-attention + MoE models in JAX."""

from jtilert.checkpoint import load, save
from jtilert.config import PRESETS, ModelConfig, preset
from jtilert.generate import Generator, score
from jtilert.model import Transformer, init_cache, random_model
from jtilert.sampling import Sampling
from jtilert.sharding import make_mesh

__all__ = ["ModelConfig", "PRESETS", "preset", "Generator", "score", "Transformer", "init_cache", "random_model",
           "Sampling", "make_mesh", "load", "save"]
