"""``python -m qkv`` runs the ``qkv`` command line."""

from .cli import run

run()
