"""`python -m peagle.cli ...` (torchrun's -m too): the `peagle` command."""
import sys

from . import main

sys.exit(main())
