"""Weights on disk: jtilert checkpoints (`checkpoint`, `folder`, and `arrays`, their orbax/zarr3 form), Hugging
Face safetensors folders (`hf`), the bounded-memory converter (`convert`) and synthetic checkpoints
(`synthetic`)."""
