"""``python -m epd_actors``."""

import sys

from .cli import main

sys.exit(main())
