"""`python -m rayfree.cli ...` is the `rayfree` command."""

import sys

from .main import main

sys.exit(main())
