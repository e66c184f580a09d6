import sys

from retune.cli import main

sys.exit(main())

__all__: list[str] = []
