"""The MindSpore (PyNative) backend (see :mod:`.backend`). Importing a module here imports
MindSpore; :func:`trainprobe.backends.mindspore.runtime.require_mindspore` says what to install
when it is missing or unusable."""

from trainprobe.backends.mindspore.runtime import require_mindspore

require_mindspore()  # one ImportError saying what to install, before any module here imports MindSpore
