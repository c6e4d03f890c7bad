"""A layer of the stacked weights and caches, as the decode step hands it to a kernel: `Layer(base,
offset)` names layer base + offset.

A layer loop's trip runs several layers, each at a fixed place in the trip: the loop carries the
trip's first layer (`base`, its counter) and each call site adds its place (`offset`, a constant).
A kernel takes both as operands (`operands`: two int32 [1] arrays) and adds them on the device,
so XLA computes nothing between the loop's counter and the kernels; an index computed in XLA
(base + 1, say) would be a kernel of its own before them, every layer. The plain index (`index`)
is for what runs in XLA anyway: the reference ops, jnp indexing, `lax.cond`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Layer:
    """Layer `base + offset` of a stack [L, ...]. `base`: an integer scalar (traced or not); `offset`:
    a Python int where the model names a layer, an int32 scalar where the Layer is an argument of a
    jitted kernel (a pytree: both are its leaves). Both may be negative; the sum is the index."""

    base: jax.Array
    offset: int | jax.Array = 0

    @staticmethod
    def of(layer) -> Layer:
        """`layer` as a Layer: a Layer, or an integer scalar (offset 0); its base a Python int or an
        int32 array. ValueError for anything else."""
        if not isinstance(layer, Layer):
            layer = Layer(layer)
        if isinstance(layer.base, int):
            return layer
        base = jnp.asarray(layer.base)
        if base.shape != () or not jnp.issubdtype(base.dtype, jnp.integer):
            raise ValueError(f"layer must be an integer scalar, got {base.dtype}{list(base.shape)}")
        return Layer(base.astype(jnp.int32), layer.offset)

    def __add__(self, k: int) -> Layer:
        """The layer k further on in the same stack: the offset moves, the base stays."""
        if not isinstance(k, int):
            raise TypeError(f"a Layer moves by a Python int, got {k!r}")
        return Layer(self.base, self.offset + k)

    def __sub__(self, k: int) -> Layer:
        return self + (-k)

    def index(self):
        """base + offset as one integer scalar, added in XLA (the base itself where the offset is 0)."""
        if isinstance(self.offset, int) and self.offset == 0:
            return self.base
        return self.base + self.offset

    def operands(self) -> tuple[jax.Array, jax.Array]:
        """(base, offset) as a kernel's two int32 [1] inputs, which it adds on the device (a scalar's
        reshape is a bitcast in XLA; a Python int offset a constant). ValueError unless the base is
        an integer scalar."""
        layer = Layer.of(self)
        return jnp.asarray(layer.base, jnp.int32).reshape(1), jnp.asarray(layer.offset, jnp.int32).reshape(1)


jax.tree_util.register_dataclass(Layer, data_fields=["base", "offset"], meta_fields=[])
