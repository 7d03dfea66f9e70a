"""`python -m saferun ...` (and `torchrun -m saferun run ...`) runs the saferun command."""

from .cli import main

main()
