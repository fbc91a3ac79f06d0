"""Callbacks that switch trainprobe on inside other trainers with one line.

* :mod:`trainprobe.integrations.transformers`: ``TrainProbeCallback`` for the Hugging Face
  ``Trainer`` (``pip install trainprobe[hf]``).
* :mod:`trainprobe.integrations.lightning`: ``TrainProbeCallback`` for Lightning
  (``pip install trainprobe[lightning]``).

Both take ``metrics_config=`` (training metrics: ``monitor_config`` / ``tensorboard``, see
:mod:`trainprobe.frontdoors.metrics`) and/or ``monitor_v2_config=`` (a Monitor V2 config). Configurations
are validated when the callback is created; the callbacks only use the trainers' own hooks.
Without ``tensorboard.tensorboard_dir`` the metrics go to the trainer's own loggers at its logging
cadence (Lightning: ``trainer.loggers``; Hugging Face: ``trainer.log()``, given ``trainer=``);
with it, to trainprobe's own event files.
"""
