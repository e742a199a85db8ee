"""``python -m phasewise.cli``: the same as the ``phasewise`` command."""

import sys

from phasewise.cli import main

sys.exit(main())
