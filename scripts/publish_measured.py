"""Write snapkv/storage/measured.json (what `snapkv info` shows) from the result files of `snapkv eval fidelity` listed in
snapkv.measure.published.RESULTS, scored with today's measure. Run after adding a result file there:

    .venv/bin/python scripts/publish_measured.py
    .venv/bin/python scripts/publish_measured.py --tables RESULT.json [MORE.json ...]   # markdown tables of a run
"""

import sys
from pathlib import Path

from snapkv.measure.published import tables, write

if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1]
    if sys.argv[1:2] == ["--tables"]:
        print(tables(root, tuple(sys.argv[2:])))
    else:
        print(f"wrote {write(root)}")
