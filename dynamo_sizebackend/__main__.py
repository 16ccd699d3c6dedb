"""``python -m dynamo_sizebackend``: the ``sizebackend`` command."""
from .cli import main

raise SystemExit(main())
