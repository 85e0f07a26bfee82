import sys

from gateway.ctl.cli import main

sys.exit(main())
