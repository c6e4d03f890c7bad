"""The test set-up itself (conftest.py): numpy's global generator, from which the kernel tests draw
their inputs, starts every test seeded from the test's id."""

import zlib

import jax
import numpy as np
import pytest
from interpreted import new_key   # tests/interpreted.py (tests/ is on sys.path)

_draws = {}


@pytest.mark.parametrize("case", ["a", "b"])
def test_each_test_starts_from_its_own_seed(request, case):
    want = np.random.RandomState(zlib.crc32(request.node.nodeid.encode())).randint(1 << 30, size=4)
    assert (np.random.randint(1 << 30, size=4) == want).all()
    _draws[case] = jax.random.key_data(new_key())
    if len(_draws) == 2:   # both cases ran in this process: their keys differ
        assert (np.asarray(_draws["a"]) != np.asarray(_draws["b"])).any()
