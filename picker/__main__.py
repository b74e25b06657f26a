import sys

from picker.cli import main

sys.exit(main())
