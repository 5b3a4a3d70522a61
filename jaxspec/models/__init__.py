"""Model definitions (Flax NNX)."""
