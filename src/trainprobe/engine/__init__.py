"""The engine: everything the monitors share, written once and importing no framework.

Schedule and :class:`~trainprobe.engine.session.Session` (the step protocol), the
:class:`~trainprobe.engine.probes.base.Probe` lifecycle and its one fault guard, records
(:class:`~trainprobe.engine.records.RowBuffer` → :class:`~trainprobe.engine.records.StepBatch`),
the one background :class:`~trainprobe.engine.sinks.background.Writer` and the sinks, the
statistics' names (:mod:`trainprobe.engine.stats.ops`), patching, and the torch-free
:mod:`~trainprobe.engine.layout` of the output files that the offline tools read. What a
framework must provide is the :class:`~trainprobe.engine.backend.Backend` protocol; the
implementations live in :mod:`trainprobe.backends`. ``tests/test_imports.py`` checks that no
module here imports torch or MindSpore.
"""
