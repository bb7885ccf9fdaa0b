"""`python -m lmstack`: the same command as `lmstack`."""

from .launch import main

raise SystemExit(main())
