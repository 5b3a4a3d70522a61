"""Speculative decoding: draft-tree growth, verification, proposers and the compiled round loop."""
