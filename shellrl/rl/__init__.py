"""Pure RL math on arrays and tensors (DESIGN.md section 5). No I/O, no service state.

Modules: advantages (GRPO), staleness, batch (shift-by-one alignment), logprobs (float32 per
sequence, temperature-scaled), losses (decoupled PPO). Importing this package imports nothing;
`batch`, `logprobs` and `losses` import torch when they are imported themselves.
"""
