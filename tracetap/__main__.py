"""`python -m tracetap`: the same command line as the `tracetap` script."""

from tracetap.cli import main

raise SystemExit(main())
