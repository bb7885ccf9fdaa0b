"""`python -m lmstack`: the same command as `lmstack`."""

from .cli import main

raise SystemExit(main())
