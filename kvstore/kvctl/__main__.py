import sys

from kvstore.kvctl import main

sys.exit(main())
