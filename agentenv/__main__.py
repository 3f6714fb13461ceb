"""`python -m agentenv` == the `agentenv` CLI."""

from agentenv.cli import main

main()
