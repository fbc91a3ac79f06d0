"""The framework backends: every module that imports a training framework.

* :mod:`trainprobe.backends.torch`: PyTorch (the default);
* :mod:`trainprobe.backends.mindspore`: MindSpore (PyNative).

Each implements :class:`trainprobe.engine.backend.Backend`; the engine chooses one with
:func:`trainprobe.engine.backend.backend_for`, importing only the framework asked for.
"""
