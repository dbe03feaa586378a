"""``python -m trl_bandpo.demo``: run the demo (see `trl_bandpo.demo`)."""

import sys

from .cli import main

sys.exit(main())
