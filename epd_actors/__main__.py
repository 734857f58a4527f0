"""``python -m epd_actors``."""

import sys

from .program.cli import main

# The guard matters: vLLM starts its engine-core process with "spawn", which
# imports this module again in the child (as __mp_main__).
if __name__ == "__main__":
    sys.exit(main())
