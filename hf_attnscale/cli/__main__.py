"""``python -m hf_attnscale.cli``: the same as the ``hf-attnscale`` command."""

import sys

from . import main

sys.exit(main())
