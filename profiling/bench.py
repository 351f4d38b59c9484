"""gpt2numba against transformers, side by side, with this machine's floors (see --help)."""

import sys

from gpt2numba.bench import main

if __name__ == "__main__":
    sys.exit(main())
