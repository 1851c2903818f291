"""`python -m tracetap`: the same command line as the `tracetap` script."""

from tracetap.proxy.cli import main

raise SystemExit(main())
