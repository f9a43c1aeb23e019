"""Example shellrl plug-ins (see docs/plugins.md): `checks` (two check types), `rewards` (one
reward component), `tasks` (one task source). Nothing here imports shellrl at module level
except what the plug-in protocol needs."""
