import sys

from stagetrace.cli import main

sys.exit(main())
