"""python -m chatgen.cli COMMAND ...: the same as the `chatgen` console script."""

import sys

from chatgen.cli import main

sys.exit(main())
