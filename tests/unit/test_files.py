"""Files a user hands to another program (shellrl/files.py): 0644 files and 0755 directories
whatever the writer chose (safetensors: 0600), symbolic links left alone; offline."""

from __future__ import annotations

import os
import stat

import torch
from safetensors.torch import save_file

from shellrl.files import share_readable


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_safetensors_file_is_written_0600_and_shared_0644(tmp_path):
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True, mode=0o700)
    save_file({"w": torch.zeros(2)}, str(model / "model.safetensors"))
    assert _mode(model / "model.safetensors") == 0o600  # why share_readable exists
    (model / "sub" / "tokenizer.json").write_text("{}")
    os.chmod(model / "sub" / "tokenizer.json", 0o600)
    secret = tmp_path / "api_token"
    secret.write_text("s3cret\n")
    os.chmod(secret, 0o600)
    os.symlink(secret, model / "link")
    share_readable(model)
    assert _mode(model) == _mode(model / "sub") == 0o755
    assert _mode(model / "model.safetensors") == _mode(model / "sub" / "tokenizer.json") == 0o644
    assert _mode(secret) == 0o600  # a link is not followed: the secret outside stays 0600
    assert stat.S_ISLNK(os.lstat(model / "link").st_mode)
