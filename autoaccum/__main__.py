import sys

from autoaccum.cli import main

sys.exit(main())
