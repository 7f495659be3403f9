import sys

from nnxtron.cli import main

sys.exit(main())
