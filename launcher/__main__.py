"""``python -m launcher``: the ``kvstore`` command (launcher/cli.py)."""
import sys

from launcher.cli import main

sys.exit(main())
