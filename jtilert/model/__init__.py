"""The model: its configuration and presets (`config`, `presets`) and the Flax nnx modules with their
stacked layer weights and caches (`transformer`)."""
