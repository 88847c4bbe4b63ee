"""Loading a target refuses what would decode garbage: a file that is not the GGUF it claims to be, a cached copy of
another file, weights that do not match the config."""

from __future__ import annotations

import json

import pytest

from runtime.target import _float_cache_for_gguf, load_target
from tests.conftest import tiny_model


def test_a_file_that_is_not_gguf_is_refused_before_loading(tmp_path):
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"\x00" * 4096)
    with pytest.raises(ValueError, match="is not a GGUF file"):
        load_target(str(fake))


def test_the_dequantized_cache_is_keyed_on_content_not_name_and_size(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path / "cache"))
    first, second = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for path, filler in ((first, b"\x01"), (second, b"\x02")):
        path.parent.mkdir()
        path.write_bytes(b"GGUF" + filler * 1000)  # same name, same size, other bytes
    assert _float_cache_for_gguf(first) != _float_cache_for_gguf(second)
    assert _float_cache_for_gguf(first) == _float_cache_for_gguf(first)


def test_weights_that_do_not_match_the_config_are_refused(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] += 1  # one layer the weights do not have
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"lack \d+ tensors .*num_hidden_layers"):
        load_target(str(tmp_path))
