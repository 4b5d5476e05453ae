"""`python -m oomguard.daemon.cli`: the same as the `oomguard` command."""

import sys

from oomguard.daemon.cli import main

sys.exit(main())
