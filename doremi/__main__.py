import sys

from doremi.cli import main

sys.exit(main())
