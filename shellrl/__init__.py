"""shellrl: asynchronous RL for LLM agents on real Linux shell tasks.

The shared library every service imports. No torch import at module level here.
"""

__version__ = "0.1.0"
