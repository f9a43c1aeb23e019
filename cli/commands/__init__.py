"""Subcommands of `shellrl` (see cli/main.py): one module per command."""
