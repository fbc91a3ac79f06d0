"""The PyTorch backend: statistics kernels, model and optimizer views, gradient hooks,
collectives, AMP step skips and the device-to-host copy (see :mod:`.backend`)."""
