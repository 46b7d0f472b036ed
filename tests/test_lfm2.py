"""LFM2's short-convolution layers through the paged engine: each sequence's conv state (its last L - 1
conv inputs) carried across chunked prefill, mixed steps and multi-step decoding in a state slot of
its own, and what the engine refuses for such a model. The reference is transformers' Lfm2ForCausalLM
(tests/hf_models.py "lfm2": conv, attention, conv, attention)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxinfer import Generator
from jaxinfer.config import ConfigError
from tests.hf_models import build_hf_model
from tests.state_engine import ENGINE, check_state_engine, hf_greedy

@pytest.fixture(scope="module")
def lfm2(hf_model_dir):
    rng = np.random.RandomState(5)
    prompts = [rng.randint(3, 113, n).tolist() for n in (5, 45, 17, 30, 9)]
    hf = build_hf_model("lfm2")
    return hf_model_dir("lfm2"), hf, prompts, [hf_greedy(hf, p) for p in prompts]


def test_state_across_chunks_rows_slot_reuse_preemption_and_prompt_logprobs(lfm2):
    """tests/state_engine.py's check: greedy continuations through two slots, preemption and n = 2,
    then prompt logprobs across chunk boundaries, against transformers."""
    check_state_engine(*lfm2)


def test_what_a_conv_state_cannot_carry_is_refused(lfm2, tmp_path):
    """Speculative decoding (rejected proposals would stay in the state), tensor and pipeline
    parallelism (before any loading) and the host KV tier are refused by name; LoRA names the supported
    families; jaxinfer quantize points to load-time quantization."""
    from jaxinfer.config import EngineConfig
    from jaxinfer.config.resolve import resolve_config
    from jaxinfer.lora.adapter import LORA_FAMILIES
    from jaxinfer.models.hf_configs import model_config_from_hf
    from jaxinfer.quantize import QuantizeSettings, quantize_model
    from jaxinfer.weights import load_model
    folder = lfm2[0]
    cfg = model_config_from_hf(folder)
    for name, kw in (("speculative_method", dict(speculative_method="ngram", num_speculative_tokens=2)),
                     ("tensor_parallel", dict(tensor_parallel=2)), ("pipeline_parallel", dict(pipeline_parallel=2))):
        with pytest.raises(ConfigError, match=rf"{name} is not available for Lfm2ForCausalLM, whose conv layers"):
            Generator.from_pretrained(folder, **kw)   # (refused before any loading)
    with pytest.raises(ConfigError, match="kv_offload_gb is not available"):
        resolve_config(EngineConfig(num_blocks=16, kv_offload_bytes=1 << 20), cfg, backend="cpu")
    assert "Lfm2ForCausalLM" not in LORA_FAMILIES
    model, _ = load_model(folder, "float32")
    with pytest.raises(ValueError, match="state layers .* --quantize int8"):
        quantize_model(model, QuantizeSettings(method="rtn", bits=4))


def test_lfm2_moe_experts_in_transformers_own_layout(tmp_path):
    """LFM2-MoE's uploads store each expert's w1 / w3 / w2 (tests/test_hf_parity.py reads those); the
    state dict of transformers' own model holds a layer's experts fused, gate_up_proj [E, 2F, d] and
    down_proj [E, d, F]: a folder of that gives transformers' logits too."""
    import json

    from safetensors.torch import save_file
    from tests.hf_models import save_hf_model
    hf = build_hf_model("lfm2-moe")
    folder = tmp_path / "fused"
    save_hf_model("lfm2-moe", tmp_path / "upload")
    folder.mkdir()
    (folder / "config.json").write_text((tmp_path / "upload" / "config.json").read_text())
    tensors = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}   # (tied)
    assert "model.layers.1.feed_forward.experts.gate_up_proj" in tensors
    save_file(tensors, str(folder / "model.safetensors"))
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Lfm2MoeForCausalLM"]
    ids = [3, 17, 42, 9, 100, 5, 77, 12, 8, 60, 33, 1, 7, 19]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    gen = Generator.from_pretrained(folder, max_num_seqs=2, num_blocks=16, **ENGINE)
    assert np.abs(gen.logits(ids) - ref).max() <= 1e-4 * np.abs(ref).max()


def test_state_slots_follow_the_blocks():
    """BlockManager's state slots: a request takes one with its first blocks (all or nothing: a request
    that cannot get its blocks takes no slot), keeps it as its table grows, gives it back with its
    blocks; the freed slot is the next one handed out; slot 0 never is."""
    from jaxinfer.host.block_manager import BlockManager
    bm = BlockManager(num_blocks=6, block_size=4, state_slots=2)
    assert bm.allocate("a", 8) and bm.allocate("b", 4) and bm.state_of == {"a": 1, "b": 2}
    assert bm.allocate("a", 12) and bm.state_of["a"] == 1          # a longer table, the same slot
    assert not bm.allocate("c", 8) and "c" not in bm.state_of      # one block free, two wanted: nothing taken
    bm.free("a")
    assert bm.allocate("c", 8) and bm.state_of == {"b": 2, "c": 1}
    bm.free("b")
    bm.free("c")
    assert bm.state_of == {} and sorted(bm.state_free) == [1, 2] and bm.num_free == 5
