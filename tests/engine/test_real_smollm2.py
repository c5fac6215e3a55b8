"""The real SmolLM2-135M-Instruct (from its PyPI carrier) through our decoder vs transformers, float32."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve.engine.attention import AttentionMetadata
from specserve.engine.builder import load_model
from specserve.engine.config import ModelSpec
from specserve.engine.memory import module_bytes
from specserve.engine.models.arch import ArchConfig
from specserve.engine.models.factory import load_decoder
from specserve.engine.models.loader import resolve_model
from specserve.engine.tokenizer import Tokenizer
from specserve.engine.weight_size import estimate_weight_bytes


@pytest.fixture(scope="module")
def smollm2_f32():
    return resolve_model(None, dtype=torch.float32)


def test_logits_match_transformers(smollm2_f32):
    ours = load_decoder(smollm2_f32.directory, torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(smollm2_f32.directory, dtype=torch.float32).eval()
    tok = Tokenizer(smollm2_f32.directory)
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three primary colours."}])
    kv = ours.allocate_kv_cache(64 * 16, torch.float32, "cpu")
    n = len(ids)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]  # [n, vocab]
        meta = AttentionMetadata.build([n - 1], [n - 1], [list(range(8))], 16)
        prefill = ours.compute_logits(ours(torch.tensor(ids[:-1]), torch.arange(n - 1), kv, meta))
        meta = AttentionMetadata.build([1], [n], [list(range(8))], 16)
        decode = ours.compute_logits(ours(torch.tensor(ids[-1:]), torch.tensor([n - 1]), kv, meta))
    diff_prefill = (prefill - expected[:-1]).abs().max().item()
    diff_decode = (decode[0] - expected[-1]).abs().max().item()
    assert diff_prefill < 2e-4 and diff_decode < 2e-4, (diff_prefill, diff_decode)
    assert int(decode[0].argmax()) == int(expected[-1].argmax())


def test_smollm2_stop_tokens(smollm2_f32):
    tok = Tokenizer(smollm2_f32.directory)
    assert tok.hf.convert_tokens_to_ids("<|im_end|>") in tok.eos_token_ids


def test_preload_estimate_is_the_loaded_size(smollm2_f32):
    """The start-up memory check's estimate (config only, before loading) is exactly what the loaded
    embedded model holds, and the check lets it load under the default budget."""
    loaded = load_model(
        ModelSpec(model_path=None, quantization_encoding="float32"), None, memory_utilization=0.9
    )
    estimate = estimate_weight_bytes(ArchConfig.from_directory(smollm2_f32.directory), torch.float32)
    assert estimate == module_bytes(loaded.model)
