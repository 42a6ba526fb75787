"""`python -m batchinfer` runs the CLI."""

from batchinfer.cli import main

main()
