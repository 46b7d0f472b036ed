"""`jaxinfer convert` and `jaxinfer generate` end to end (in-process; argparse and all)."""
from __future__ import annotations

import json

import numpy as np
import torch

from jaxinfer.cli import main
from tests.hf_models import build_hf_model


def test_convert_then_generate_matches_hf(hf_model_dir, tmp_path, capsys):
    src = hf_model_dir("mistral-window")
    out = tmp_path / "native"
    assert main(["convert", src, str(out), "--dtype", "float32"]) == 0
    assert json.loads((out / "config.json").read_text())["format"] == "jaxinfer"
    ids = [5, 17, 42, 8, 99, 3, 61]
    assert main(["generate", "--model", str(out), "--dtype", "float32", "--ids", ",".join(map(str, ids)),
                 "--max-tokens", "12", "--ignore-eos", "--json"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with torch.no_grad():
        ref = build_hf_model("mistral-window").generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                                        eos_token_id=None, pad_token_id=0)[0, len(ids):]
    assert line["token_ids"] == ref.tolist()
    assert line["finish_reason"] == "length"
