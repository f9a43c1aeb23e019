"""Reference log-probs with a plain transformers forward pass, in its own process.

`python -m tests.helpers.logprob_reference IN.json OUT.json` where IN is
`{"model": "tiny", "cases": [{"prompt": [...], "output": [...], "temperature": T, "weights_dir": DIR|null}]}`.
OUT is `[[logprob of output[i] given prompt + output[:i]] for each case]`: log_softmax(logits / T)
(T < 1e-6: raw log_softmax), float32, one unpadded sequence per forward. `weights_dir` (safetensors)
replaces the model's parameters first, as the learner's checkpoint would.
"""

from __future__ import annotations

import json
import sys

import torch

from shellrl.models import load_model
from shellrl.weights import disk as wtd


def main(argv: list[str]) -> None:
    spec = json.loads(open(argv[0]).read())
    torch.set_num_threads(1)
    with open(argv[1], "w") as out:
        json.dump(compute(spec), out)


def compute(spec: dict) -> list[list[float]]:
    """The reference log-probs for `spec` (see the module docstring)."""
    model = load_model(spec["model"], dtype=torch.float32)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    results = []
    for case in spec["cases"]:
        params = dict(model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, tensor in original.items():
                params[name].copy_(tensor)
            if case.get("weights_dir"):
                for name, tensor in wtd.load_safetensors_dir(case["weights_dir"]):
                    params[name].copy_(tensor)
        prompt, output = case["prompt"], case["output"]
        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        temperature = case["temperature"]
        logprobs = torch.log_softmax(logits / (temperature if temperature >= 1e-6 else 1.0), dim=-1)
        results.append(logprobs.gather(1, torch.tensor(output)[:, None]).squeeze(1).tolist())
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
