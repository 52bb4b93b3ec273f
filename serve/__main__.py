"""`python -m serve`: the same as the `serve` command."""
import sys

from serve.cli import main

sys.exit(main())
