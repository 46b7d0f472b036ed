"""lm-evaluation-harness tasks on local JSON (tests/test_eval_clients.py; README, "Evaluation with
lm-eval"): verses_mc.json, 16 multiple-choice items (a held-out verse's opening, its true ending among
three endings of other held-out verses) and verses_rolling.json, 6 held-out passages scored whole
(loglikelihood_rolling), both from checkpoints/jaxinfer-tiny-llama/heldout.txt, which the bundled model
never trained on. Loaded here, never from a hub."""
import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _load(name: str) -> datasets.DatasetDict:
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(json.loads((HERE / name).read_text()))})


def verses_mc(**_) -> datasets.DatasetDict:
    return _load("verses_mc.json")


def verses_rolling(**_) -> datasets.DatasetDict:
    return _load("verses_rolling.json")
