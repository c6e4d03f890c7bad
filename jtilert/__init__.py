"""jtilert: lowest-latency batch-1 decoding of MLA + sparse-attention + MoE models in JAX."""

from jtilert import compile_cache
from jtilert.checkpoint import load, save
from jtilert.config import PRESETS, ModelConfig, preset
from jtilert.converter import convert, verify
from jtilert.generate import Generator, score
from jtilert.model import Transformer, init_cache, random_model
from jtilert.ops import DecodeConfig
from jtilert.sampling import Sampling
from jtilert.sharding import make_mesh
from jtilert.synthetic import random_checkpoint

compile_cache.enable()

__all__ = ["DecodeConfig", "ModelConfig", "PRESETS", "preset", "Generator", "score", "Transformer", "init_cache", "random_model",
           "Sampling", "make_mesh", "load", "save", "convert", "verify", "random_checkpoint"]
