"""``python -m trainprobe``."""

import sys

from trainprobe.cli import main

sys.exit(main())
