"""``python -m dynamo_sizebackend``: the ``sizebackend`` command."""
from .app.cli import main

raise SystemExit(main())
