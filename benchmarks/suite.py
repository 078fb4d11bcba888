"""The cupymoe benchmark suite from a checkout, the same as ``python -m cupymoe.bench``; ``--help``
lists the options."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from cupymoe.bench.suite import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
