"""Ownership transfer: adopt tensors into slices, prove the originals died, roll back on failure."""
