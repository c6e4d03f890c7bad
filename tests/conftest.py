"""Test set-up: 8 host devices for mesh tests (before jax is imported), fp32 matmuls on CPU."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def tiny_random():
    """A random fp32 model of the tiny architecture (session-wide: building it takes seconds)."""
    from jtilert import random_model
    return random_model("tiny", fmt="fp32")


@pytest.fixture(scope="session")
def tiny_fp8():
    """The tiny architecture with fp8 block-scaled weights."""
    from jtilert import random_model
    return random_model("tiny", fmt="fp8", seed=1)
