"""jtilert: lowest-latency batch-1 decoding of MLA + sparse-attention + MoE models in JAX."""

from jtilert.pallas import interpret as _interpret

_interpret.reserve_interpreter_threads()   # before anything starts jax's CPU backend

from jtilert.runtime import compile_cache  # noqa: E402
from jtilert.store.checkpoint import load, save, verify
from jtilert.model.config import ModelConfig
from jtilert.model.presets import PRESETS, preset
from jtilert.store.convert import convert
from jtilert.runtime.generate import Generator, score
from jtilert.runtime.dispatch import use_dispatch_thread
from jtilert.model.transformer import Transformer, init_cache, random_model
from jtilert.ops.table import DecodeConfig
from jtilert.runtime.sampling import Sampling
from jtilert.runtime.tokenizer import tokenizer
from jtilert.parallel.sharding import make_mesh
from jtilert.store.synthetic import random_checkpoint

compile_cache.enable()

__all__ = ["DecodeConfig", "ModelConfig", "PRESETS", "preset", "Generator", "score", "Transformer", "init_cache", "random_model",
           "Sampling", "tokenizer", "make_mesh", "load", "save", "convert", "verify", "random_checkpoint",
           "use_dispatch_thread"]
