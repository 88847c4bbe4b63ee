"""Readers other than ours: economize loads our EAGLE-3 and Medusa exports into an unmodified transformers model,
drafts what our heads draft and decodes token-identically to greedy decoding; the peer decoders of the benchmark
(bench.peers) run. Needs the optional extra (``pip install -e ".[peers]"``): ``python -m pytest -m peers``."""

from __future__ import annotations

import copy

import pytest
import torch

from heads.common import frozen_target_weights
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.export import export_head
from heads.io import save_head
from heads.medusa import MedusaConfig, MedusaHeads
from bench.peers import PEERS_EXTRA, PeerDecoder, PeerMethod, missing_package
from runtime.target.model import target_from_model
from tests.conftest import tiny_model

LAYERS = 8
PROMPTS = [[5, 6, 7], list(range(10, 30)), [1, 2, 3, 1, 2, 3, 1, 2]]
NEW_TOKENS = 24


def model():
    return tiny_model("llama", num_hidden_layers=LAYERS, rope_parameters={"rope_type": "default",
                                                                         "rope_theta": 100000.0})


def trained(head, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2 + ("norm" in name))
    return head


def eagle3_head(target_model, layers=()):
    head = trained(Eagle3Head(Eagle3Config(list(layers)), target_model.config))
    head.attach_target_weights(*frozen_target_weights(target_model))
    return head.eval()


def medusa_head(target_model, shared=True):
    head = trained(MedusaHeads(MedusaConfig(num_heads=3, num_layers=1, shared_lm_head=shared), target_model.config))
    head.attach_target_weights(*frozen_target_weights(target_model))
    return head.eval()


def hf_greedy(hf_model, prompt):
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_a_missing_peer_package_names_the_extra(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert PEERS_EXTRA in missing_package("economize-eagle3") and "economize" in missing_package("economize-eagle3")
    with pytest.raises(ImportError, match="flashspec-ngram needs the flashspec package"):
        PeerDecoder(PeerMethod("flashspec-ngram"), None)
    with pytest.raises(ValueError, match="unknown peer 'economize-eagle'"):
        PeerMethod("economize-eagle")


peers = pytest.mark.peers


@peers
@pytest.mark.parametrize("fmt, layers", [("vllm", ()), ("vllm", (1, 3, 6)), ("reference", ()), ("sglang", ())])
def test_economize_drafts_what_our_eagle3_export_drafts_and_decodes_greedily(fmt, layers, tmp_path):
    import economize

    hf = model()
    head = eagle3_head(hf, layers)
    out = export_head(head, tmp_path / fmt, fmt=fmt)
    loaded = economize.load(copy.deepcopy(hf), out, check_teacher=False)
    technique = loaded.techniques["eagle3"]
    assert list(technique.aux_layers) == head.feature_layers
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        states = hf(ids, output_hidden_states=True).hidden_states
        theirs = technique.draft_logits(technique.rollout({i: states[i] for i in (0, *head.feature_layers)}, 1)[0])
        # our row t reads token t+1 and the fused features of t; economize's index t is the same draft
        features = torch.cat([states[i] for i in head.feature_layers], -1)
        ours = head(ids[:, 1:], features[:, :-1], torch.arange(ids.shape[1] - 1)[None])[1]
    torch.testing.assert_close(theirs[0, :-1], ours[0], rtol=1e-4, atol=1e-4)
    for prompt in PROMPTS:
        assert loaded.decode(torch.tensor(prompt), NEW_TOKENS).tokens.tolist() == hf_greedy(hf, prompt)


@peers
@pytest.mark.parametrize("shared", [True, False])
def test_economize_drafts_what_our_medusa_export_drafts_and_decodes_greedily(shared, tmp_path):
    import economize

    hf = model()
    head = medusa_head(hf, shared)
    out = export_head(head, tmp_path / "reference", fmt="reference")
    loaded = economize.load(copy.deepcopy(hf), out, check_teacher=False)
    technique = loaded.techniques["medusa"]
    captured = {}
    hook = hf.model.norm.register_forward_pre_hook(lambda module, args: captured.update(pre=args[0]))
    with torch.no_grad():
        post = hf(torch.tensor([PROMPTS[1]]), output_hidden_states=True).hidden_states[-1]
        hook.remove()
        theirs = technique.head_logits(captured["pre"])  # economize's own heads read the model's final norm
        ours = head(post)
    torch.testing.assert_close(theirs.movedim(-2, 0), ours, rtol=1e-4, atol=1e-4)
    for prompt in PROMPTS:
        assert loaded.decode(torch.tensor(prompt), NEW_TOKENS).tokens.tolist() == hf_greedy(hf, prompt)


@peers
def test_the_benchmarks_peer_decoders_decode_greedily(tmp_path):
    from heads.common import target_signature

    hf = model()
    target = target_from_model(hf, identity="tiny-peers")
    signature = target_signature(hf, target.identity, target.tokenizer)
    dirs = {"eagle3": save_head(eagle3_head(hf), tmp_path / "eagle3", signature),
            "medusa": save_head(medusa_head(hf), tmp_path / "medusa", signature)}
    expected = [hf_greedy(hf, prompt) for prompt in PROMPTS]
    for name, head in (("economize-eagle3", dirs["eagle3"]), ("economize-medusa", dirs["medusa"]),
                       ("flashspec-ngram", None)):
        decoder = PeerDecoder(PeerMethod(name, head=str(head) if head else None), target)
        for prompt, want in zip(PROMPTS, expected):
            tokens, seconds, forwards, details = decoder.generate(torch.tensor(prompt), NEW_TOKENS, [])
            assert tokens == want, name
            assert seconds > 0 and forwards >= 1 and sum(details.accept_lengths) >= len(tokens) - 1
