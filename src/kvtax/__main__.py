from kvtax.cli import main

raise SystemExit(main())
