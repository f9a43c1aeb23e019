"""Subcommands of `shellrl` (see shellrl/cli.py): one module per command."""
