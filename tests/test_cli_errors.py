"""Bad input is reported before anything loads, naming the problem and the fix: the scripts' flags and prompt files,
and head configs (read_head_config, and the proposer loading a head)."""

import importlib.util
import json
import time

import pytest

from bench.prompts import read_prompts
from heads.common import frozen_target_weights, target_signature
from heads.eagle import EagleConfig, EagleHead
from heads.io import read_head_config, save_head
from runtime.proposers import ProposerSpec, build_proposer
from tests.conftest import tiny_target
from tests.script_runs import check_arguments, run_script


@pytest.fixture
def prompt_files(tmp_path):
    """Prompt files by name: good, and each way a line can be wrong."""
    lines = {"good": {"prompt": "hi"}, "string": "just a string", "number_prompt": {"prompt": 5},
             "string_turns": {"turns": "hello"}, "empty_turns": {"turns": []}, "no_field": {"text": "hi"}}
    files = {}
    for name, record in lines.items():
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(record) + "\n")
    files["invalid"] = tmp_path / "invalid.jsonl"
    files["invalid"].write_text('{"prompt": "a"\n')
    files["empty"] = tmp_path / "empty.jsonl"
    files["empty"].write_text("\n")
    return files


def test_script_mistakes_are_reported_before_anything_loads(prompt_files, tmp_path):
    p = prompt_files
    missing_dir = tmp_path / "no-such-dir" / "out.jsonl"
    cases = [  # (script, arguments, a fragment of the message; None: the command is fine and gets to loading)
        ("generate", ["--prompt", "hi", "--max-new-tokens", "-5"], "argument --max-new-tokens: -5 is not a positive"),
        ("generate", ["--prompt", "hi", "--max-new-tokens", "0"], "argument --max-new-tokens: 0 is not a positive"),
        ("generate", ["--prompts", p["good"], "--limit", "0"], "argument --limit: 0 is not a positive integer"),
        ("generate", ["--prompt", "hi", "--temperature", "nan"], "argument --temperature: nan is not a finite number"),
        ("generate", ["--prompt", "hi", "--temperature", "-1"], "argument --temperature: -1 is not a finite number"),
        ("generate", ["--prompt", "hi", "--top-p", "0"], "argument --top-p: 0 is outside (0, 1]"),
        ("generate", ["--prompt", "hi", "--top-k", "0"], "argument --top-k: 0 is not a positive integer"),
        ("generate", ["--prompt", "hi", "--tree-size", "0"], "argument --tree-size: 0 is not a positive integer"),
        ("generate", ["--prompt", "hi", "--stop", ""], "argument --stop: an empty stop string"),
        ("generate", ["--prompts", p["string"]], f"--prompts: {p['string']}:2 is a JSON str, not an object"),
        ("generate", ["--prompts", p["number_prompt"]], f"{p['number_prompt']}:2: 'prompt' must be a string"),
        ("generate", ["--prompts", p["string_turns"]], f"{p['string_turns']}:2: 'turns' must be a non-empty list"),
        ("generate", ["--prompts", p["empty_turns"]], "'turns' must be a non-empty list of strings"),
        ("generate", ["--prompts", p["no_field"]], "has neither a 'prompt' nor a 'turns' field"),
        ("generate", ["--prompts", p["invalid"]], f"--prompts: {p['invalid']}:1 is not valid JSON"),
        ("generate", ["--prompts", p["empty"]], f"--prompts: {p['empty']} holds no prompt"),
        ("generate", ["--prompts", tmp_path / "nowhere.jsonl"], "--prompts: prompts file not found"),
        ("generate", ["--prompt", "hi", "--proposer", "ngram", "--head", "H"],
         "--proposer: a head directory is for medusa, eagle, eagle3, dflash, not 'ngram'"),
        ("generate", ["--prompt", "hi", "--proposer", "none", "--head", "H"], "a head directory is for medusa"),
        ("generate", ["--prompt", "hi", "--proposer", "ngram", "--draft-model", "d"],
         "--draft-model: is for --proposer draft, not 'ngram'"),
        ("generate", ["--prompt", "hi", "--output", missing_dir], f"--output: the directory of {missing_dir} does "
                                                                 "not exist; create it first"),
        ("generate", ["--prompt", "hi", "--output", tmp_path], f"--output: {tmp_path} is a directory"),
        ("generate", ["--prompt", "hi", "--samples", "3"], "--samples: 3 samples at --temperature 0"),
        ("generate", ["--prompt", "hi", "--samples", "0"], "argument --samples: 0 is not a positive integer"),
        ("generate", ["--prompts", p["good"], "--temperature", "1", "--samples", "2", "--stop", "x", "--output",
                      tmp_path / "out.jsonl"], None),
        ("benchmark", ["--limit", "0"], "argument --limit: 0 is not a positive integer"),
        ("benchmark", ["--stride", "0"], "argument --stride: 0 is not a positive integer"),
        ("benchmark", ["--max-new-tokens", "-1"], "argument --max-new-tokens: -1 is not a positive integer"),
        ("benchmark", ["--temperature", "inf"], "argument --temperature: inf is not a finite number"),
        ("benchmark", ["--prompts", p["string_turns"]], "--prompts: "),
        ("benchmark", ["--output", missing_dir], "--output: the directory of"),
        ("benchmark", ["--prompts", p["good"], "--stride", "5", "--limit", "1", "--output", tmp_path / "r.json"],
         None),
        ("export", [tmp_path / "not-a-head", tmp_path / "out"], "HEAD: "),
        ("generate", ["--prompt", "hi", "--proposer", "eagle3", "--head", tmp_path / "no-head"],
         f"--head: {tmp_path / 'no-head'}: no such head directory"),
        ("benchmark", ["--methods", f"hf-greedy,eagle3+ngram:{tmp_path / 'no-head'}"],
         f"--methods: {tmp_path / 'no-head'}: no such head directory"),
        # without the peers extra, the missing package is the first mistake named
        ("benchmark", ["--methods", "hf-greedy,flashspec-ngram", "--temperature", "0.7"],
         "run greedy only" if importlib.util.find_spec("flashspec") else "install the peers extra"),
        ("benchmark", ["--rescore", tmp_path / "missing.json"], "--rescore: "),
        ("generate", ["--prompt", "hi", "--cuda-graphs"], "--cuda-graphs: CUDA graphs are captured on a GPU, and "
                                                          "--device is cpu"),
        ("benchmark", ["--cuda-graphs", "--device", "cpu"], "--cuda-graphs: CUDA graphs are captured on a GPU"),
    ]
    results = check_arguments([(script, argv) for script, argv, _ in cases])
    for (script, argv, expected), got in zip(cases, results, strict=True):
        if expected is None:
            assert got["outcome"] == "loads", (script, argv, got)
        else:
            assert got["outcome"] == "error" and expected in got["message"], (script, argv, expected, got)
            assert "Traceback" not in got["message"]


def test_a_bad_flag_exits_quickly_with_the_message_and_no_traceback():
    started = time.perf_counter()
    result = run_script("generate.py", "--prompt", "hi", "--temperature", "nan", check=False)
    assert result.returncode == 2 and "argument --temperature: nan is not a finite number" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.perf_counter() - started < 120  # no model was loaded (that takes far longer on a busy CPU)


def test_prompt_files_are_read_line_by_line_with_the_line_named(prompt_files):
    assert read_prompts(prompt_files["good"]) == [{"id": 0, "prompt": "fine"}, {"id": 1, "prompt": "hi"}]
    assert read_prompts(prompt_files["good"], limit=1) == [{"id": 0, "prompt": "fine"}]
    with pytest.raises(ValueError, match="limit must be >= 1"):
        read_prompts(prompt_files["good"], limit=0)
    with pytest.raises(ValueError, match=r"string_turns.jsonl:2: 'turns' must be a non-empty list of strings"):
        read_prompts(prompt_files["string_turns"])  # it used to give the prompt "h"
    with pytest.raises(ValueError, match=r"string.jsonl:2 is a JSON str, not an object; write one JSON object"):
        read_prompts(prompt_files["string"])


# --- head configs ---


@pytest.fixture
def saved_eagle(tmp_path):
    """(a saved EAGLE head's directory, the tiny target it was saved for)."""
    target = tiny_target()
    head = EagleHead(EagleConfig(), target.config)
    head.attach_target_weights(*frozen_target_weights(target.model))
    directory = save_head(head, tmp_path / "head", target_signature(target.model, target.identity), tree={"depth": 3})
    return directory, target


def edit_config(directory, edit):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["tree"].update(depth=-1), "tree.depth must be a positive integer (the draft depth), got -1"),
    (lambda c: c["tree"].update(top_k=0), "tree.top_k must be a positive integer"),
    (lambda c: c["tree"].update(size=2.5), "tree.size must be a positive integer"),
    (lambda c: c["tree"].update(depth=True), "tree.depth must be a positive integer"),
    (lambda c: c["tree"].update(acceptance=[0.5, 1.5]), "tree.acceptance must be a list of acceptance rates"),
    (lambda c: c["tree"].update(size_dtype=32), "tree.size_dtype must be a dtype name"),
    (lambda c: c["tree"].update(sizes={"float32": 0}), "tree.sizes must map a target dtype name to the verified"),
    (lambda c: c["tree"].update(sizes=[4]), "tree.sizes must map a target dtype name"),
    (lambda c: c["tree"].update(rank_paths=[[0], []]), "tree.rank_paths must be a list of rank paths"),
    (lambda c: c["tree"].update(rank_paths=[[0], [-1]]), "tree.rank_paths must be a list of rank paths"),
    (lambda c: c.update(tree=[3]), "tree must be an object, got list"),
    (lambda c: c.pop("head_config"), "head_config is missing; a head directory written by training has it"),
    (lambda c: c.pop("target"), "target is missing"),
    (lambda c: c.update(target="llama"), "target is a str, not an object"),
    (lambda c: c["head_config"].update(num_layers="2"), "head_config does not describe a head of type eagle"),
    (lambda c: c["head_config"].update(depth=3), "of type eagle (unknown eagle head config keys ['depth']"),
    (lambda c: c.update(training={"target_lora": 5}), "training.target_lora must name the adapter directory"),
])
def test_a_broken_head_config_names_the_file_and_the_key(saved_eagle, edit, message):
    directory, target = saved_eagle
    edit_config(directory, edit)
    for load in (lambda: read_head_config(directory),
                 lambda: build_proposer(ProposerSpec("eagle", head=str(directory)), target)):
        with pytest.raises(ValueError) as error:
            load()
        assert str(directory / "config.json") in str(error.value) and message in str(error.value)


def test_a_head_config_with_an_unknown_tree_dtype_or_invalid_json_names_the_file(saved_eagle):
    directory, target = saved_eagle
    edit_config(directory, lambda c: c["tree"].update(size=3, size_dtype="float8"))
    with pytest.raises(ValueError, match=r"config.json: tree.size_dtype: unknown dtype 'float8'"):
        build_proposer(ProposerSpec("eagle", head=str(directory)), target)
    edit_config(directory, lambda c: c["tree"].update(sizes={"float8": 3}))
    with pytest.raises(ValueError, match=r"config.json: tree.sizes: unknown dtype 'float8'"):
        build_proposer(ProposerSpec("eagle", head=str(directory)), target)
    (directory / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        read_head_config(directory)


def test_a_valid_head_config_still_loads(saved_eagle):
    directory, target = saved_eagle
    edit_config(directory, lambda c: c["tree"].update(acceptance=[0.6, 0.4], top_k=4, size=3))
    proposer = build_proposer(ProposerSpec("eagle", head=str(directory)), target)
    assert proposer.depth == 3 and proposer.top_k == 4 and proposer.tree_size == 3
    # sizes measured per dtype: the target's dtype picks its own; a dtype without one gets the cost model's (None)
    edit_config(directory, lambda c: c["tree"].update(sizes={"bfloat16": 6, "float32": 5}))
    assert build_proposer(ProposerSpec("eagle", head=str(directory)), target).tree_size == 5
    edit_config(directory, lambda c: c["tree"].update(sizes={"bfloat16": 6}))
    assert build_proposer(ProposerSpec("eagle", head=str(directory)), target).tree_size is None


def test_the_levers_script_names_a_bad_group_lever_or_store_before_training(tmp_path):
    results = tmp_path / "levers.json"
    for argv, expected in [
        (["--store", tmp_path, "--groups", "eagle4"], "error: --groups: 'eagle4': choose from eagle3, medusa"),
        (["--store", tmp_path, "--groups", "medusa", "--only", "ttt-2"], "error: --only: ttt-2: choose from"),
        (["--store", tmp_path], f"error: --store: features.dir={tmp_path} is not a recorded store"),
        (["--store", tmp_path, "--steps", "0"], "argument --steps: 0 is not a positive integer"),
    ]:
        result = run_script("levers.py", *argv, "--results", results, check=False)
        assert result.returncode != 0 and expected in result.stderr, (argv, result.stderr)
        assert "Traceback" not in result.stderr and not results.exists()
