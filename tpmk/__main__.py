import sys

from tpmk.cli import main

if __name__ == "__main__":  # guarded: spawned worker processes re-import this module
    sys.exit(main())
