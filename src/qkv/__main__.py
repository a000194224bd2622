"""``python -m qkv`` runs the ``qkv`` command line."""

import sys

from .cli import main

sys.exit(main())
