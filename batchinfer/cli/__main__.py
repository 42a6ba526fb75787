"""`python -m batchinfer.cli` runs the CLI."""

from batchinfer.cli import main

main()
