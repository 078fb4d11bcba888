"""``python -m cupymoe.bench``: the reference benchmark suite."""
import sys

from .suite import main

sys.exit(main())
