"""`python -m bench`: `make bench`'s table (bench.run)."""

import sys

from bench.run import main

sys.exit(main())
