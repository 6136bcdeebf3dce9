"""`python -m vlmrt.cli`."""

import sys

from . import main

sys.exit(main())
