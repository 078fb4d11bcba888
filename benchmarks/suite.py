"""The cupymoe benchmark suite (cases.json next to this file); the same as ``python -m cupymoe.bench``.

Everything lives in :mod:`cupymoe.bench`; ``--help`` lists the options.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from cupymoe.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
