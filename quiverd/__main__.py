import sys

from quiverd.cli.main import main

sys.exit(main())
