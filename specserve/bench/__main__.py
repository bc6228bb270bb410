"""``python -m specserve.bench``: the same as ``specserve bench`` (:mod:`specserve.bench.cli`)."""

import sys

from specserve.bench.cli import main

sys.exit(main())
