"""Exports never destroy what is not an export, and a Medusa-2 head runs only on the target its adapters are merged
into (heads.io exports, runtime.proposers.load_head_proposer, scripts/export.py)."""

import copy
import json

import pytest
import torch

from heads.common import frozen_target_weights, target_signature
from heads.eagle import EagleConfig, EagleHead
from heads.export import EXPORT_MARKER, export_destination_problem, export_head
from heads.io import MERGED_ADAPTERS_KEY, adapter_fingerprint, save_head
from heads.medusa import MedusaConfig, MedusaHeads
from runtime.engine.decoder import SpeculativeDecoder
from runtime.proposers import ProposerSpec, build_proposer
from runtime.target.model import load_target
from tests.conftest import tiny_model, tiny_target
from tests.script_runs import check_arguments, default_tokenizer, run_script, save_tiny_model


def eagle_head(target):
    head = EagleHead(EagleConfig(), target.config)
    head.attach_target_weights(*frozen_target_weights(target.model))
    return head.eval()


def save_medusa2_head(target, directory):
    """A Medusa-2 head directory as training writes it: the heads, and LoRA adapters on the target in target_lora
    (random, so that merging them changes the target)."""
    from peft import LoraConfig, get_peft_model

    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1), target.config)

    def write_adapters(tmp):
        adapted = get_peft_model(copy.deepcopy(target.model), LoraConfig(
            r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        adapted.save_pretrained(str(tmp / "target_lora"))

    signature = target_signature(target.model, target.identity, target.tokenizer)
    return save_head(heads, directory, signature, tree={"acceptance": [0.5, 0.3]},
                     training={"target_lora": "target_lora"}, write_extra=write_adapters)


def a_run_directory(root, target):
    """A training run's output directory: head/, checkpoints/, curves and a summary."""
    save_head(eagle_head(target), root / "head", target_signature(target.model, target.identity, target.tokenizer))
    (root / "checkpoints" / "step-4").mkdir(parents=True)
    (root / "checkpoints" / "step-4" / "state.pt").write_bytes(b"state")
    (root / "curves.png").write_bytes(b"png")
    (root / "summary.json").write_text("{}")
    return root


def contents(directory):
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*"))


# --- the library ---


def test_export_replaces_only_missing_or_empty_directories_and_earlier_exports(tmp_path):
    target = tiny_target()
    head = eagle_head(target)
    run = a_run_directory(tmp_path / "run", target)
    before = contents(run)
    assert "is not an earlier export" in export_destination_problem(run)
    with pytest.raises(FileExistsError, match="exporting there would delete it. .*pass force=True"):
        export_head(head, run)
    assert contents(run) == before  # nothing of the run was touched
    out = export_head(head, tmp_path / "out")
    assert json.loads((out / EXPORT_MARKER).read_text()) == {"format": "headstart-export", "kind": "head",
                                                             "layout": "sglang",
                                                             "files": ["config.json", "model.safetensors"]}
    assert export_destination_problem(out) is None
    export_head(head, out)  # an earlier export is replaced
    (tmp_path / "empty").mkdir()
    export_head(head, tmp_path / "empty")
    (tmp_path / "file").write_text("notes")
    assert "is not a directory" in export_destination_problem(tmp_path / "file")
    with pytest.raises(FileExistsError):
        export_head(head, tmp_path / "file")
    assert (tmp_path / "file").read_text() == "notes"
    export_head(head, run, force=True)  # asked for: the run is replaced by the export
    assert (run / EXPORT_MARKER).is_file() and not (run / "checkpoints").exists()


def test_exporting_over_an_earlier_export_keeps_the_files_a_user_added(tmp_path):
    """Only what the earlier export wrote is replaced: a user's notes (and a folder of their own) survive a new
    export in another layout, also over an export written before markers listed their files."""
    target = tiny_target()
    head = eagle_head(target)
    out = export_head(head, tmp_path / "exp")
    (out / "NOTES.md").write_text("served on port 30000")
    (out / "extra").mkdir()
    (out / "extra" / "tokenizer.json").write_text("{}")
    export_head(head, out, fmt="reference")
    assert (out / "NOTES.md").read_text() == "served on port 30000"
    assert (out / "extra" / "tokenizer.json").is_file()
    assert not (out / "model.safetensors").exists() and (out / "pytorch_model.bin").is_file()  # ours: replaced
    assert "NOTES.md" not in json.loads((out / EXPORT_MARKER).read_text())["files"]
    legacy = json.loads((out / EXPORT_MARKER).read_text())
    del legacy["files"]  # as earlier versions wrote it
    (out / EXPORT_MARKER).write_text(json.dumps(legacy))
    export_head(head, out)
    assert (out / "NOTES.md").is_file() and not (out / "pytorch_model.bin").exists()


def test_written_weights_follow_the_umask(tmp_path):
    """Weight files are created as any other tool's files (safetensors alone would make them owner-only): a server
    running as another user can read an exported head, its feature shards and the head training saved."""
    import os
    import stat

    from heads.layouts import save_tensors

    target = tiny_target()
    old = os.umask(0o022)
    try:
        saved = save_head(eagle_head(target), tmp_path / "head",
                          target_signature(target.model, target.identity, target.tokenizer))
        exported = export_head(eagle_head(target), tmp_path / "exp")
        save_tensors({"x": torch.zeros(2)}, tmp_path / "shard.safetensors")
        for path in (saved / "model.safetensors", exported / "model.safetensors", tmp_path / "shard.safetensors"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
        assert stat.S_IMODE(exported.stat().st_mode) == 0o755
        os.umask(0o077)
        save_tensors({"x": torch.zeros(2)}, tmp_path / "private.safetensors")
        assert stat.S_IMODE((tmp_path / "private.safetensors").stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_a_medusa2_head_refuses_a_target_without_its_adapters_merged_in(tmp_path):
    target = tiny_target()
    head_dir = save_medusa2_head(target, tmp_path / "head")
    with pytest.raises(ValueError, match="trained with LoRA adapters on its target") as error:
        build_proposer(ProposerSpec("medusa", head=str(head_dir)), target)
    assert f"`python scripts/export.py {head_dir} EXPORT_DIR --merged-target MERGED_DIR`" in str(error.value)
    assert f"--target MERGED_DIR --head {head_dir}" in str(error.value)
    setattr(target.config, MERGED_ADAPTERS_KEY, "0123456789abcdef")  # a target with some other adapters merged in
    with pytest.raises(ValueError, match="it holds other adapters"):
        build_proposer(ProposerSpec("medusa", head=str(head_dir), lookup_first=True), target)
    setattr(target.config, MERGED_ADAPTERS_KEY, adapter_fingerprint(head_dir / "target_lora"))
    assert build_proposer(ProposerSpec("medusa", head=str(head_dir)), target).heads.num_heads == 2
    for path in (head_dir / "target_lora").iterdir():
        path.unlink()
    (head_dir / "target_lora").rmdir()
    with pytest.raises(FileNotFoundError, match="names target LoRA adapters in .*target_lora, which is missing"):
        build_proposer(ProposerSpec("medusa", head=str(head_dir)), target)


# --- scripts/export.py ---


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """(a tiny target directory, a training run directory with an EAGLE head for it, a Medusa-2 head for it)."""
    root = tmp_path_factory.mktemp("export")
    target_dir = save_tiny_model(root / "target")
    target = load_target(str(target_dir), quiet=True)
    return target_dir, a_run_directory(root / "run", target), save_medusa2_head(target, root / "medusa2" / "head")


def test_export_script_refuses_to_replace_what_is_not_an_export_before_loading_anything(tiny_run, tmp_path):
    _, run, medusa2 = tiny_run
    head = run / "head"
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    (tmp_path / "exported").mkdir()
    (tmp_path / "exported" / EXPORT_MARKER).write_text("{}")
    cases = [  # (arguments, a fragment of the message; None: fine, gets to loading the target)
        ([head, run], f"OUT: {run} holds the head directory {head}; replacing it would delete the head"),
        ([head, run, "--force"], "holds the head directory"),  # not even with --force
        ([head, head], "holds the head directory"),
        ([head, tmp_path / "notes"], f"OUT: {tmp_path / 'notes'} exists and is not an earlier export"),
        ([head, tmp_path / "notes"], "Choose a new or empty directory, or pass --force to replace it"),
        ([head, tmp_path / "out", "--merged-target", tmp_path / "m"], "has no target LoRA adapters"),
        ([medusa2, tmp_path / "out", "--merged-target", tmp_path / "notes"],
         "--merged-target: " + f"{tmp_path / 'notes'} exists and is not an earlier export"),
        ([medusa2, tmp_path / "out", "--merged-target", tmp_path / "out" / "target"], "overlap"),
        ([medusa2, tmp_path / "out", "--merged-target", tmp_path / "out"], "overlap"),
        ([head, tmp_path / "out", "--dtype", "float8"], "--dtype: unknown dtype 'float8'"),
        ([head, tmp_path / "notes", "--force"], None),
        ([head, tmp_path / "exported"], None),
        ([medusa2, tmp_path / "out", "--merged-target", tmp_path / "m"], None),
    ]
    for (argv, expected), got in zip(cases, check_arguments([("export", argv) for argv, _ in cases]), strict=True):
        if expected is None:
            assert got["outcome"] == "loads", (argv, got)
        else:
            assert got["outcome"] == "error" and expected in got["message"], (argv, expected, got)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    assert (run / "curves.png").is_file() and (run / "checkpoints" / "step-4" / "state.pt").is_file()


def test_export_script_replaces_its_own_exports_and_others_only_with_force(tiny_run, tmp_path):
    target_dir, run, _ = tiny_run
    out = tmp_path / "out"
    for _ in range(2):  # the second run replaces the first one's export
        run_script("export.py", run / "head", out, "--target", target_dir)
        assert json.loads((out / EXPORT_MARKER).read_text())["kind"] == "head"
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("old")
    refused = run_script("export.py", run / "head", tmp_path / "notes", check=False)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr and "--force" in refused.stderr
    run_script("export.py", run / "head", tmp_path / "notes", "--force")
    assert (tmp_path / "notes" / EXPORT_MARKER).is_file() and not (tmp_path / "notes" / "todo.txt").exists()


def test_a_medusa2_head_runs_on_the_target_export_merges_its_adapters_into(tiny_run, tmp_path):
    from peft import PeftModel

    target_dir, _, head_dir = tiny_run
    merged_dir = tmp_path / "merged"
    run_script("export.py", head_dir, tmp_path / "head", "--merged-target", merged_dir)
    assert json.loads((merged_dir / EXPORT_MARKER).read_text())["kind"] == "merged-target"
    base = load_target(str(target_dir), quiet=True)
    merged = load_target(str(merged_dir), quiet=True)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    adapted = PeftModel.from_pretrained(copy.deepcopy(base.model), str(head_dir / "target_lora")).eval()
    with torch.no_grad():
        expected = adapted(input_ids=ids).logits
        torch.testing.assert_close(merged.model(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(base.model(input_ids=ids).logits, expected, atol=1e-3)  # the adapters matter
    with pytest.warns(UserWarning, match="trained for"):  # the same shapes and tokenizer under another name
        proposer = build_proposer(ProposerSpec("medusa", head=str(head_dir)), merged)
    assert len(SpeculativeDecoder(merged, proposer, tree_size=3).generate(ids[0], 6).tokens) >= 1
    generate = ("generate.py", "--proposer", "medusa", "--head", head_dir, "--prompt", "hi", "--max-new-tokens", "4",
                "--tree-size", "3")
    refused = run_script(*generate, "--target", target_dir, check=False)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "--merged-target MERGED_DIR" in refused.stderr and "trained with LoRA adapters" in refused.stderr
    run_script(*generate, "--target", merged_dir)


def test_export_script_names_a_head_that_does_not_fit_its_target(tiny_run, tmp_path):
    """A head exported against another target (--target) is refused with generate.py's sentence, not a traceback."""
    _, run, _ = tiny_run
    other = tmp_path / "other"
    tokenizer = default_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer), num_hidden_layers=1, hidden_size=24,
               intermediate_size=32).save_pretrained(other)
    tokenizer.save_pretrained(other)
    refused = run_script("export.py", run / "head", tmp_path / "out", "--target", other, check=False)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "--target: the eagle head at" in refused.stderr and "hidden size" in refused.stderr
    assert not (tmp_path / "out").exists()
