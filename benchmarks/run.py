"""Run every GeoFP8 benchmark and print the tables: ``python benchmarks/run.py [options]``.

The same as ``geofp8 bench`` / ``make bench``; the options are those of ``geofp8 bench --help``
(e.g. ``--parts 1,2`` or ``--markdown docs/performance.md``).
"""

import sys

from geofp8.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
