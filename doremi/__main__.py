import sys

from doremi.commands.cli import main

sys.exit(main())
