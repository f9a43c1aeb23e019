"""Per-token log-probs of a causal LM, in float32, one sequence at a time over the vocabulary.

logprob(token) = log_softmax(logits / T)[token] with T the temperature the engine sampled that
token with, exactly as the engine computes the behavior log-probs (SGLang returns log-probs of
softmax(logits / T) before top-p/top-k; known_pitfalls.md C07: a temperature on one side only
biases every ratio). T <= 1e-6 (greedy) is scored as T = 1, as SGLang does.

Memory: the decoder runs on a micro-batch ([b, L, H] hidden states, gradient checkpointing on
its layers); the LM head then runs per sequence, only at the scored positions and at most
`chunk_tokens` positions at a time, in float32, under activation checkpointing when gradients are
on. So the float32 logits alive at once are [chunk_tokens, V], never [B, L, V].

Shared prefix (`share_prefix_min_tokens` > 0): rows of a micro-batch that begin with the same
tokens (a GRPO group shares its whole prompt; every task shares the system prompt and the worked
examples) run that prefix through the decoder ONCE, at batch 1, keeping its KV cache with
gradients; the cache is repeated to the batch and each row's own tokens run on top of it. The
prefix activations then receive the summed gradient of every row, so log-probs and gradients equal
the full forward up to float rounding (tests/unit/test_rl_logprobs.py), at a fraction of the compute
when the prompt dominates the sequence (the scratch GRPO run of ../shared/reference/feasibility.md
did the same). It needs the KV cache, so it is skipped while the model trains with activation
checkpointing (the learner's default; the main job turns checkpointing off).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from shellrl.rl.batch import TrainBatch

GREEDY_TEMPERATURE = 1e-6


def enable_gradient_checkpointing(model) -> None:
    """Turn on HF activation (gradient) checkpointing, non-reentrant, for every decoder layer; no KV cache."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target_ids: torch.Tensor,
    temperatures: torch.Tensor,
) -> torch.Tensor:
    """log_softmax((hidden @ weight.T + bias) / T)[target] in float32.

    hidden: [n, H]; weight: [V, H]; bias: [V] or None; target_ids: [n] int64; temperatures: [n]
    float32 (> 0). Returns [n] float32. Uses logits[target] - logsumexp(logits), which equals
    log_softmax at the target without a second [n, V] tensor. Always float32, also when the
    decoder ran under autocast (autocast is off here).
    """
    with torch.autocast(hidden.device.type, enabled=False):
        logits = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
        logits = logits / temperatures.unsqueeze(-1)
        target = logits.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
        return target - torch.logsumexp(logits, dim=-1)


def shared_prefix_length(batch: TrainBatch) -> int:
    """Longest P such that every row has the same first P tokens, attends to all of them and numbers
    them 0..P-1, capped so that every row keeps at least one token of its own (P <= min length - 1).
    0 for a single row."""
    ids = batch.input_ids
    if ids.shape[0] < 2 or ids.shape[1] == 0:
        return 0
    arange = torch.arange(ids.shape[1], device=ids.device)
    same = (
        (ids == ids[:1]).all(0)
        & (batch.attention_mask > 0).all(0)
        & (batch.position_ids == arange).all(0)
    )
    differs = (~same).nonzero()
    length = int(differs[0, 0]) if differs.numel() else int(ids.shape[1])
    return max(0, min(length, int(batch.lengths.min()) - 1))


def decoder_hidden(
    model, batch: TrainBatch, share_prefix_min_tokens: int = 0, unpadded_rows: bool = False
) -> torch.Tensor:
    """Last hidden states [b, L, H] of `model`'s decoder; with share_prefix_min_tokens > 0 a shared
    prefix of at least that many tokens runs once (see the module docstring). unpadded_rows: after
    a shared prefix, each row's own tokens run on their own (batch 1, its length, no padding),
    each on the prefix's KV cache; the hidden states past a row's length are then 0 (no column
    there is scored). A GRPO group's own tokens differ in length (the main job's: ~45-160), so
    the padded batch computes up to a third more positions than the rows hold."""
    decoder = model.get_decoder()
    prefix = shared_prefix_length(batch) if share_prefix_min_tokens > 0 else 0
    # checkpointed layers in training mode may drop the KV cache (they do in some transformers versions)
    if prefix < max(1, share_prefix_min_tokens) or (_checkpointing(model) and model.training):
        return decoder(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        ).last_hidden_state
    b, cache = batch.size, DynamicCache(config=model.config)
    key = (
        "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
    )  # 5.24 renamed it
    head = decoder(
        input_ids=batch.input_ids[:1, :prefix],
        attention_mask=batch.attention_mask[:1, :prefix],
        position_ids=batch.position_ids[:1, :prefix],
        use_cache=True,
        **{key: cache},
    )
    if unpadded_rows:
        return torch.cat(
            [
                head.last_hidden_state.expand(b, -1, -1),
                _unpadded_tails(model, batch, prefix, cache, key),
            ],
            dim=1,
        )
    cache.batch_repeat_interleave(
        b
    )  # repeat_interleave is differentiable: the rows' gradients sum into the prefix
    tail = decoder(
        input_ids=batch.input_ids[:, prefix:],
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids[:, prefix:],
        use_cache=True,
        **{key: cache},
    )
    return torch.cat([head.last_hidden_state.expand(b, -1, -1), tail.last_hidden_state], dim=1)


def _unpadded_tails(model, batch: TrainBatch, prefix: int, cache, key: str) -> torch.Tensor:
    """[b, L - prefix, H]: each row's tokens after the prefix through the decoder alone, on a
    cache holding the prefix's keys and values (the same tensors for every row: a row's forward
    concatenates onto them, never writes into them, so each row's gradient sums into the prefix);
    zeros past the row's length."""
    prefix_kv = [(layer.keys, layer.values) for layer in cache.layers]
    decoder, width = model.get_decoder(), batch.input_ids.shape[1]
    rows = []
    for i in range(batch.size):
        n = int(batch.lengths[i])
        own = decoder(
            input_ids=batch.input_ids[i : i + 1, prefix:n],
            attention_mask=batch.attention_mask[i : i + 1, :n],
            position_ids=batch.position_ids[i : i + 1, prefix:n],
            use_cache=True,
            **{key: DynamicCache(ddp_cache_data=prefix_kv, config=model.config)},
        ).last_hidden_state[0]
        rows.append(F.pad(own, (0, 0, 0, width - n)))
    return torch.stack(rows)


def _checkpointing(model) -> bool:
    flag = getattr(type(model), "is_activation_checkpointing", None)  # transformers >= 5.2x
    return bool(
        model.is_activation_checkpointing
        if flag is not None
        else getattr(model, "is_gradient_checkpointing", False)
    )


def token_logprobs(
    model,
    batch: TrainBatch,
    *,
    positions: torch.Tensor | None = None,
    chunk_tokens: int = 1024,
    share_prefix_min_tokens: int = 0,
    unpadded_rows: bool = False,
) -> torch.Tensor:
    """Log-probs of `batch.target_ids` under `model`, at the scored positions.

    model: a HF causal LM (`get_decoder()`, `get_output_embeddings()`). positions: [b, L-1] mask of
    the columns to score (default: `batch.loss_mask > 0`). share_prefix_min_tokens: run a prefix
    common to all rows once when it has at least this many tokens (0: never); unpadded_rows: then
    each row's own tokens without padding (`decoder_hidden`). Returns [b, L-1]
    float32 with 0 in the columns not scored; differentiable when grad is enabled. Raises
    ValueError when chunk_tokens < 1.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1; got {chunk_tokens}")
    positions = batch.loss_mask > 0 if positions is None else positions.bool()
    hidden = decoder_hidden(model, batch, share_prefix_min_tokens, unpadded_rows)[
        :, :-1
    ]  # [b, L-1, H]: column j scores target j
    head = model.get_output_embeddings()
    temperatures = torch.where(
        batch.temperatures > GREEDY_TEMPERATURE,
        batch.temperatures,
        torch.ones_like(batch.temperatures),
    )
    use_checkpoint = torch.is_grad_enabled()
    rows, cols, values = [], [], []
    for i in range(hidden.shape[0]):
        idx = positions[i].nonzero().squeeze(-1)
        for start in range(0, idx.numel(), chunk_tokens):
            part = idx[start : start + chunk_tokens]
            args = (
                hidden[i, part],
                head.weight,
                head.bias,
                batch.target_ids[i, part],
                temperatures[i, part],
            )
            lp = (
                checkpoint(head_logprobs, *args, use_reentrant=False)
                if use_checkpoint
                else head_logprobs(*args)
            )
            rows.append(torch.full_like(part, i))
            cols.append(part)
            values.append(lp)
    out = torch.zeros(positions.shape, dtype=torch.float32, device=hidden.device)
    if not values:  # nothing scored: a constant (callers skip such micro-batches)
        return out
    return out.index_put((torch.cat(rows), torch.cat(cols)), torch.cat(values))
