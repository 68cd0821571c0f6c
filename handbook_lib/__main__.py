"""``python -m handbook_lib ...``: see :mod:`handbook_lib.face.cli`."""

from handbook_lib.face.cli import main

raise SystemExit(main())
