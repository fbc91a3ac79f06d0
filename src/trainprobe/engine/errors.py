"""Errors raised to users."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid.

    The message always starts with the JSON path of the offending field and says which
    values are accepted, e.g.
    ``monitors.weight_grad.ops[1]: 'nrom' is not one of min, max, mean, norm, nans, zeros``.
    Raised when a monitor is constructed (config files) or started (arguments such as a missing
    optimizer), never during training.
    """
