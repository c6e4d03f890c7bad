"""Weights on disk: jtilert checkpoints (`checkpoint`, `folder`), Hugging Face safetensors folders
(`hf`), the bounded-memory converter (`converter`) and synthetic checkpoints (`synthetic`)."""
