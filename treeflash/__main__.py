"""`python -m treeflash ...`: the same as the `treeflash` console script."""
import sys

from .cli import main

sys.exit(main())
