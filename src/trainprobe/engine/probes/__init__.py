"""Probes attach to PyTorch through public hook APIs and turn tensors into rows."""
