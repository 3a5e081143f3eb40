"""``python -m hf_dsinfer``: the same as the ``hf-dsinfer`` command."""

import sys

from .cli import main

sys.exit(main())
