import sys

from picker.runtime.cli import main

sys.exit(main())
