import sys

from hpcdl.applier.server import main

sys.exit(main())
