"""``python -m handbook_lib ...``: see :mod:`handbook_lib.cli`."""

from handbook_lib.cli import main

raise SystemExit(main())
