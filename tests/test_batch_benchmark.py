"""The batch benchmark (scripts/benchmark.py --batch-size, bench.harness.run_batch_benchmark): HF greedy on
left-padded batches beside our batched decoder and both at batch 1, every row compared with HF greedy alone."""

import json

import pytest
import torch

from bench.harness import run_batch_benchmark
from bench.hf import run_hf_batch, until_stop
from bench.methods import DecoderMethod, HFBaseline, batch_methods, check_batch_methods, check_batch_sizes
from bench.report import batch_markdown_table
from runtime.engine.prompts import left_padded
from runtime.proposers import ProposerSpec
from runtime.target.model import load_target
from tests.conftest import tiny_model
from tests.script_runs import check_arguments, run_script, save_tiny_model

PROMPTS = ["one two one two", "abc abc abc abc abc", "x y", "the sea, the sea and the sea"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def write_prompts(path, texts=PROMPTS):
    path.write_text("\n".join(json.dumps({"prompt": text}) for text in texts))
    return path


def test_batch_benchmark_script_reports_every_method_at_every_batch_size(tiny_dir, tmp_path):
    out = tmp_path / "batch.json"
    printed = run_script("benchmark.py", "--target", tiny_dir, "--methods", "hf-greedy,none,ngram", "--batch-size",
                         "2,3", "--prompts", write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:3]),
                         "--max-new-tokens", "12", "--tree-size", "4", "--output", out, "--device", "cpu",
                         "--pass-costs").stdout
    results = json.loads(out.read_text())
    config, summary = results["config"], results["methods"]
    assert config["mode"] == "batch" and config["batch_sizes"] == [1, 2, 3] and config["dtype"] == "float32"
    assert config["n_prompts"] == 3 and "cpu" in config["machine"]
    assert list(config["pass_seconds"]) == ["1", "2", "3"]
    assert all(seconds > 0 for by_tree in config["pass_seconds"].values() for seconds in by_tree.values())
    assert list(summary) == ["1", "2", "3"]
    for size, methods in summary.items():
        assert list(methods) == ["hf-greedy", "none", "ngram"]
        for name, row in methods.items():
            if name != "hf-greedy" or size == "1":  # HF's own padded rows may differ from it alone; ours may not
                assert row["identical"] == 1.0, (size, name)
            if name != "hf-greedy":
                assert row["tau"] >= 1.0 and row["acceptance_monitor"]["expected"] is None
                assert row["tree_size"].startswith("fixed") or "4" in row["tree_size"]
            for key in ("tokens_per_s", "speedup", "batch_gain"):
                assert row[key] > 0, (size, name, key)
            assert row["tokens"] == summary["1"][name]["tokens"] or name == "hf-greedy"
        assert methods["hf-greedy"]["speedup"] == pytest.approx(1.0)
        assert methods["none"]["tau"] == 1.0
    assert summary["1"]["ngram"]["batch_gain"] == pytest.approx(1.0)
    for record in results["records"]:
        reference = record["outputs"]["1"]["hf-greedy"]
        assert reference["identical"] and 0 < reference["tokens"] <= 12
        for size in ("1", "2", "3"):
            for name in ("none", "ngram"):
                assert record["outputs"][size][name] == reference, (size, name)
    assert "| ngram | 3 |" in printed and "| method | batch | tokens/s |" in printed
    rescored = run_script("benchmark.py", "--rescore", out, check=False)
    assert rescored.returncode != 0 and "--rescore:" in rescored.stderr and "Traceback" not in rescored.stderr


def test_batch_benchmark_library_interleaves_chunks_and_counts_rows_to_their_stop(tiny_dir, tmp_path):
    target = load_target(str(tiny_dir), quiet=True)
    prompts = [{"id": index, "prompt": text} for index, text in enumerate(PROMPTS)]
    methods = {"ngram": DecoderMethod(ProposerSpec("ngram"), tree_size=3)}
    results = run_batch_benchmark(target, str(tiny_dir), methods, prompts, tmp_path / "r.json", batch_sizes=[3],
                                  max_new_tokens=10, chunk_size=2, progress=False)  # chunks of 3 prompts, then 1
    assert set(results["methods"]["3"]) == {"hf-greedy", "ngram"}  # the baseline is added
    assert results["config"]["chunk_size"] == 3 and len(results["records"]) == 4  # 2, rounded up to the batch
    assert results["methods"]["3"]["ngram"]["identical"] == results["methods"]["1"]["ngram"]["identical"] == 1.0
    assert json.loads((tmp_path / "r.json").read_text())["config"]["n_prompts"] == 4
    assert not target.model._forward_pre_hooks
    table = batch_markdown_table(results["methods"])
    assert table.splitlines()[0].startswith("| method | batch | tokens/s |") and "| ngram | 3 |" in table
    with pytest.raises(ValueError, match="hf-pld runs one prompt at a time"):
        run_batch_benchmark(target, str(tiny_dir), {"hf-pld": HFBaseline("hf-pld")}, prompts, tmp_path / "x.json",
                            batch_sizes=[2])
    with pytest.raises(ValueError, match="batch sizes must be >= 1"):
        check_batch_sizes([0, 4])
    assert check_batch_sizes([16, 4, 4]) == [1, 4, 16]


def test_hf_batches_are_left_padded_and_rows_end_at_their_first_stop_token():
    model = tiny_model("llama", vocab_size=64)
    short, long = torch.tensor([5, 9, 2]), torch.tensor([7, 7, 1, 3, 5, 9])
    ids, mask = left_padded([short, long], pad=0)
    assert ids.tolist() == [[0, 0, 0, 5, 9, 2], [7, 7, 1, 3, 5, 9]]
    assert mask.tolist() == [[0, 0, 0, 1, 1, 1], [1] * 6]
    assert until_stop([4, 8, 2, 8, 2], {2}) == [4, 8, 2] and until_stop([4, 8], {2}) == [4, 8]

    def alone(prompt, eos):
        out = model.generate(prompt[None], max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
        return out[0, prompt.numel():].tolist()

    free = alone(short, [63])
    stop = next(index for index in range(1, len(free)) if free[index] not in free[:index])
    eos = [free[stop]]  # the short row stops there, padded while the long row decodes on
    rows, seconds = run_hf_batch(model, [short, long], 10, eos, pad=eos[0])
    assert rows[0] == alone(short, eos) == free[:stop + 1] and seconds > 0
    assert rows[1] == alone(long, eos)


def test_batch_benchmark_arguments_are_checked_before_loading(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl")
    outcomes = check_arguments([
        ("benchmark", ["--batch-size", "0"]),
        ("benchmark", ["--batch-size", "2", "--methods", "hf-greedy,hf-pld,ngram", "--prompts", prompts]),
        ("benchmark", ["--batch-size", "2", "--temperature", "0.7", "--prompts", prompts]),
        ("benchmark", ["--batch-size", "2", "--plot", tmp_path / "p.png", "--prompts", prompts]),
        ("benchmark", ["--batch-chunk", "4", "--prompts", prompts]),
        ("benchmark", ["--pass-costs", "--prompts", prompts]),
        ("benchmark", ["--batch-size", "4,0", "--prompts", prompts]),
        ("benchmark", ["--batch-size", "2", "--batch-chunk", "4", "--methods", "hf-greedy-bf16,ngram@4",
                       "--prompts", prompts, "--output", tmp_path / "r.json"]),
    ])
    messages = [outcome["message"] for outcome in outcomes]
    assert [outcome["outcome"] for outcome in outcomes] == ["error"] * 7 + ["loads"], messages
    assert "argument --batch-size: 0 is not a positive integer" in messages[0]
    assert "--methods: hf-pld: hf-pld runs one prompt at a time" in messages[1]
    assert "--temperature: the batch benchmark is greedy" in messages[2]
    assert "--plot:" in messages[3] and "--batch-chunk: is for the batch benchmark" in messages[4]
    assert "--pass-costs: is for the batch benchmark" in messages[5]
    assert "argument --batch-size: 0 is not a positive integer" in messages[6]


def test_default_batch_methods_keep_only_the_hf_baselines_that_batch():
    methods = {"hf-greedy": HFBaseline("hf-greedy"), "hf-pld": HFBaseline("hf-pld"),
               "hf-greedy-bf16": HFBaseline("hf-greedy", "bfloat16"), "ngram": DecoderMethod(ProposerSpec("ngram"))}
    kept = batch_methods(methods)
    assert list(kept) == ["hf-greedy", "hf-greedy-bf16", "ngram"]
    check_batch_methods(kept)


def test_hf_baselines_decode_plainly_whatever_the_models_generation_config_holds():
    """generate() fills unset settings from the model's generation_config: a repetition penalty there would make
    "HF greedy" another decoding than the runtime's. The baselines pin such settings; one with no neutral value to
    pin is refused before any work."""
    from bench.hf import ForwardCounter, plain_generation_settings, run_hf, run_hf_batch

    model = tiny_model("llama")
    prompt = torch.tensor([1, 2, 3, 1, 2, 3])
    plain = model.generate(prompt[None], max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 6:].tolist()
    model.generation_config.repetition_penalty = 1.3
    assert model.generate(prompt[None], max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 6:].tolist() != plain
    counter = ForwardCounter(model)
    assert run_hf(model, counter, prompt, HFBaseline("hf-greedy"), 12, [0])[0] == plain
    assert run_hf_batch(model, [prompt], 12, [63], 0)[0][0] == plain
    counter.remove()
    model.generation_config.forced_eos_token_id = 5
    with pytest.raises(ValueError, match="sets forced_eos_token_id"):
        plain_generation_settings(model)
