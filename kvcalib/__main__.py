"""`python -m kvcalib ...`, as torchrun starts each rank: `torchrun ... -m kvcalib run ...`."""

from kvcalib.cli import main

main()
