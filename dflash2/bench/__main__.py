import sys

from dflash2.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
