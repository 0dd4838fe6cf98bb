"""`python -m kvtax.cli ...`: the same as the `kvtax` script."""

from kvtax.cli import main

raise SystemExit(main())
