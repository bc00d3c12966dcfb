import sys

from quiverd.cli import main

sys.exit(main())
