"""The command-line scripts end to end (run as a user runs them, in a subprocess), and the library they call
(bench: methods, HF baselines, harness, divergence reports, prompts; runtime.engine.prompts,
runtime.proposers.ProposerSpec), on a tiny random model that uses the default target's tokenizer."""

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from bench.divergence import first_divergence
from bench.hf import ForwardCounter, HFModels, run_hf
from bench.methods import DecoderMethod, HFBaseline, early_exit_layers, method_from_json, method_to_json
from runtime.proposers import NgramProposer, NoProposer, ProposerSpec, build_proposer
from runtime.target.model import load_target
from tests.conftest import tiny_model
from tests.script_runs import REPO, default_tokenizer, run_script, save_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 1-layer random model with SmolLM2's vocabulary and chat template, saved like any HF checkpoint."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


# --- the scripts, as subprocesses ---


def test_generate_script_writes_jsonl(tiny_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello there"}) + "\n" + json.dumps({"turns": ["hi", "x"]}) + "\n")
    out = tmp_path / "out.jsonl"
    run_script("generate.py", "--target", tiny_dir, "--proposer", "ngram", "--prompts", prompts,
               "--max-new-tokens", "12", "--tree-size", "6", "--output", out)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["prompt"] for line in lines] == ["hello there", "hi"]
    for line in lines:
        assert set(line) == {"id", "prompt", "output_ids", "text", "accept_lengths", "target_forwards", "seconds"}
        assert 0 < len(line["output_ids"]) <= 12
        assert line["target_forwards"] == len(line["accept_lengths"]) + 1


def test_generate_never_empties_or_replaces_an_output_before_the_run_succeeds(tiny_dir, tmp_path, monkeypatch):
    """--output: an existing file is refused without --force and left as it is; a prompt over the context is found
    before the first generation; a run that dies keeps the generations that finished (in OUTPUT.partial, each
    written as it finished) and leaves OUTPUT as it was; a run that succeeds replaces it, in input order."""
    import cli.generate
    from runtime.engine.decoder import SpeculativeDecoder

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"hello {i}"}) + "\n" for i in range(4)))
    out = tmp_path / "out.jsonl"
    out.write_text("an earlier run's line\n" * 4)
    common = ["--target", str(tiny_dir), "--proposer", "ngram", "--prompts", str(prompts), "--max-new-tokens", "6",
              "--output", str(out)]
    with pytest.raises(SystemExit, match="--output: .* exists; .*--force"):
        cli.generate.main(common)
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": "word " * 9000}) + "\n")
    with pytest.raises(SystemExit, match="prompt 1 of .* tokens .* exceeds the target's context"):
        cli.generate.main([*common[:5], str(long), *common[6:], "--force"])
    with pytest.raises(SystemExit, match="--max-new-tokens: .* leave no room"):
        cli.generate.main([*common[:7], "100000", *common[8:], "--force"])
    generate, calls = SpeculativeDecoder.generate, []

    def dies_at_the_third(self, *args, **kwargs):
        partial = out.with_name(out.name + ".partial")
        assert len(partial.read_text().splitlines()) == len(calls)  # each finished one is on disk already
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as a user's ^C (a kill -9 leaves the same files)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", dies_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        cli.generate.main([*common, "--force"])
    assert out.read_text() == "an earlier run's line\n" * 4
    assert [json.loads(line)["id"] for line in out.with_name(out.name + ".partial").read_text().splitlines()] == [0, 1]
    monkeypatch.setattr(SpeculativeDecoder, "generate", generate)
    cli.generate.main([*common, "--force", "--batch-size", "3"])
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [0, 1, 2, 3]
    assert not out.with_name(out.name + ".partial").exists()


def test_generate_refuses_a_device_this_build_lacks_before_loading():
    import cli.generate

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit):
        cli.generate.parse_args(["--device", "cuda"])


def test_generate_script_names_the_flag_of_a_mistake(tiny_dir):
    missing_draft = run_script("generate.py", "--proposer", "draft", "--prompt", "hi", check=False)
    assert missing_draft.returncode != 0 and "--proposer: draft needs --draft-model" in missing_draft.stderr
    assert "Traceback" not in missing_draft.stderr
    no_head = run_script("generate.py", "--target", tiny_dir, "--proposer", "eagle3", "--prompt", "hi", check=False)
    assert no_head.returncode != 0 and "Traceback" not in no_head.stderr
    assert "--proposer: eagle3 needs --head DIR" in no_head.stderr
    assert "no eagle3 head ships for target" in no_head.stderr


def test_generate_script_draws_independent_samples_and_reproduces_them(tiny_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text((json.dumps({"prompt": "tell me a story"}) + "\n") * 3)  # how users draw several samples
    runs = []
    for run in range(2):
        out = tmp_path / f"out{run}.jsonl"
        run_script("generate.py", "--target", tiny_dir, "--proposer", "ngram", "--prompts", prompts, "--temperature",
                   "1", "--seed", "7", "--samples", "2", "--max-new-tokens", "8", "--tree-size", "4", "--output", out)
        runs.append([json.loads(line) for line in out.read_text().splitlines()])
    first, second = runs
    assert [(line["id"], line["sample"]) for line in first] == [(i, s) for i in range(3) for s in range(2)]
    samples = [tuple(line["output_ids"]) for line in first]
    assert len(set(samples)) == len(samples)  # every line and every sample of it: its own draw
    assert [line["output_ids"] for line in second] == [line["output_ids"] for line in first]  # the same command


def test_prompt_seeds_differ_for_every_prompt_and_sample_and_repeat_for_the_same_run():
    from runtime.engine.prompts import prompt_seed

    seeds = [prompt_seed(7, prompt, sample) for prompt in range(200) for sample in range(5)]
    assert len(set(seeds)) == len(seeds) and all(0 <= seed < 2 ** 63 for seed in seeds)
    assert seeds == [prompt_seed(7, prompt, sample) for prompt in range(200) for sample in range(5)]
    assert prompt_seed(7, 1) != prompt_seed(8, 0)  # not seed + index: run 7's second prompt is not run 8's first
    assert prompt_seed(7, 0) == prompt_seed(7, 0, 0) != prompt_seed(0, 7)
    with pytest.raises(ValueError, match="prompt_index and sample_index must be >= 0"):
        prompt_seed(7, -1)


def test_generate_script_streams_the_text_and_stops_at_a_stop_string(tiny_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)

    def generate(name, *extra):
        out = tmp_path / name
        printed = run_script("generate.py", "--target", tiny_dir, "--proposer", "ngram", "--prompt", "hello there",
                             "--max-new-tokens", "24", "--tree-size", "4", "--output", out, *extra).stdout
        return json.loads(out.read_text()), printed

    full, printed = generate("full.jsonl")
    assert printed == full["text"] + "\n"  # streamed as accepted: the same text as the record's
    tokens = full["output_ids"]
    word = next(i for i in range(3, len(tokens)) if tokenizer.decode([tokens[i]]).strip())
    stop = tokenizer.decode([tokens[word]]).strip()
    ends = next(n for n in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:n]))
    stopped, _ = generate("stopped.jsonl", "--stop", "not in this output at all", "--stop", stop)
    assert stopped["output_ids"] == tokens[:ends] and ends < len(tokens)


def test_generate_script_stops_at_the_chat_templates_end_of_turn_token(tmp_path):
    """A Llama-3-like model: its EOS is <|endoftext|>, its chat template ends turns with <|im_end|>, which the model
    always predicts. Generation ends after that one token, not at the length limit."""
    tokenizer = default_tokenizer()
    end_of_turn, eos = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tokenizer.eos_token = "<|endoftext|>"
    model = tiny_model("llama", vocab_size=len(tokenizer), num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                       eos_token_id=eos)
    with torch.no_grad():  # the residual stream is the token's embedding, the same for every token
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[end_of_turn] = 1.0
    model.generation_config.eos_token_id = eos
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = tmp_path / "out.jsonl"
    run_script("generate.py", "--target", tmp_path / "model", "--proposer", "none", "--prompt", "hi",
               "--max-new-tokens", "6", "--tree-size", "1", "--output", out)
    assert json.loads(out.read_text())["output_ids"] == [end_of_turn]


def test_end_of_turn_tokens_are_the_chat_templates_markers_and_eos(tiny_dir):
    from runtime.engine.prompts import end_of_turn_token_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_token_ids(tokenizer) == {im_end} == {tokenizer.eos_token_id}  # SmolLM2: ChatML's marker is EOS
    tokenizer.add_tokens(["<|eot_id|>", "<end_of_turn>"], special_tokens=True)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}<|eot_id|>{% endfor %}"
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert end_of_turn_token_ids(tokenizer) == {im_end, eot}  # <end_of_turn> is in the vocabulary, not the template
    tokenizer.chat_template = None
    assert end_of_turn_token_ids(tokenizer) == {im_end}


def test_benchmark_script_reports_every_method(tiny_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["one two one two", "abc abc abc"]))
    out = tmp_path / "results.json"
    run_script("benchmark.py", "--target", tiny_dir, "--prompts", prompts, "--max-new-tokens", "16",
               "--tree-size", "6", "--output", out, "--device", "cpu")
    results = json.loads(out.read_text())
    assert set(results["methods"]) == {"hf-greedy", "hf-pld", "none", "ngram"}
    for name, row in results["methods"].items():
        assert row["identical"] == 1.0, name  # every method reproduces HF greedy
        assert row["tokens_per_s"] > 0 and row["tau"] >= 1.0
        assert 0.0 <= row["draft_share"] < 1.0
    assert results["methods"]["hf-greedy"]["draft_share"] == 0.0 < results["methods"]["ngram"]["draft_share"]
    assert out.with_suffix(".png").is_file()
    specs = {name: method_from_json(data) for name, data in results["config"]["method_specs"].items()}
    assert specs == {"hf-greedy": HFBaseline("hf-greedy"), "hf-pld": HFBaseline("hf-pld"),
                     "none": DecoderMethod(ProposerSpec("none")), "ngram": DecoderMethod(ProposerSpec("ngram"))}


def test_benchmark_runs_hf_greedy_in_bf16_beside_fp32(tiny_dir, tmp_path):
    from bench.divergence import rescore

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["one two one two", "abc abc abc"]))
    out = tmp_path / "results.json"
    run_script("benchmark.py", "--target", tiny_dir, "--methods", "hf-greedy,hf-greedy-bf16,ngram", "--prompts",
               prompts, "--max-new-tokens", "12", "--tree-size", "4", "--output", out)
    results = json.loads(out.read_text())
    methods = results["methods"]
    fastest = max(("hf-greedy", "hf-greedy-bf16"), key=lambda name: methods[name]["tokens_per_s"])
    assert methods[fastest]["speedup_vs_fastest_hf_greedy"] == pytest.approx(1.0)
    for row in methods.values():
        assert row["speedup_vs_fastest_hf_greedy"] == pytest.approx(
            row["tokens_per_s"] / methods[fastest]["tokens_per_s"])
    assert methods["ngram"]["identical"] == 1.0
    bf16 = [record["outputs"]["hf-greedy-bf16"] for record in results["records"]]
    assert all(0 < len(tokens) <= 12 for tokens in bf16)
    if methods["hf-greedy-bf16"]["identical"] < 1.0:  # bf16 rounding reordered a near-tie: the report says where
        assert results["divergences"]["hf-greedy-bf16"]["divergent"] >= 1
    # A results file from before the methods were recorded: the script reads the method names as --methods.
    results["divergences"] = {"stale": {}}
    del results["config"]["method_specs"]
    out.write_text(json.dumps(results))
    run_script("benchmark.py", "--rescore", out)  # recomputes the report from the stored outputs alone
    rescored = json.loads(out.read_text())
    assert rescored["records"] == results["records"] and "stale" not in rescored["divergences"]
    diverged = {name for name in methods if methods[name]["identical"] < 1.0}
    assert set(rescored["divergences"]) == diverged
    # the library rescores a file from the methods it records
    rescored["divergences"] = {"stale": {}}
    rescored["config"]["method_specs"] = {"hf-greedy": method_to_json(HFBaseline("hf-greedy")),
                                          "hf-greedy-bf16": method_to_json(HFBaseline("hf-greedy", "bfloat16")),
                                          "ngram": method_to_json(DecoderMethod(ProposerSpec("ngram"), 4))}
    out.write_text(json.dumps(rescored))
    assert set(rescore(out, device="cpu")) == diverged
    assert "stale" not in json.loads(out.read_text())["divergences"]


def test_benchmark_compares_with_hf_assisted_generation(tiny_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "one two one two"}))
    out = tmp_path / "results.json"
    run_script("benchmark.py", "--target", tiny_dir, "--draft-model", tiny_dir, "--methods", "hf-assisted,draft@3",
               "--prompts", prompts, "--max-new-tokens", "12", "--tree-size", "4", "--output", out)
    methods = json.loads(out.read_text())["methods"]
    assert set(methods) == {"hf-greedy", "hf-assisted", "draft@3"}
    assert methods["hf-assisted"]["identical"] == 1.0 and methods["draft@3"]["identical"] == 1.0
    assert methods["draft@3"]["tree_size"].startswith("fixed at 3")


def test_benchmark_script_rejects_a_misspelt_method_before_loading_anything(tmp_path):
    result = run_script("benchmark.py", "--target", tmp_path / "no-such-model", "--methods", "hf-greedy,eagle3-bf16",
                        "--output", tmp_path / "results.json", check=False)
    assert result.returncode != 0 and "--methods: unknown proposer 'eagle3-bf16'" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "results.json").exists()


def test_eval_head_script_names_a_wrong_head_or_flag_before_loading_anything(tmp_path):
    cases = [(["--head", tmp_path / "no-head", "--prompts"], "--head " + str(tmp_path / "no-head")),
             (["--head", "heads/shipped/smollm2-135m-medusa", "--prompts", "--eval-samples", "3"],
              "--eval-samples applies to --data only"),
             (["--head", "heads/shipped/smollm2-135m-medusa", "--data", tmp_path / "none.jsonl", "--limit", "3"],
              "--limit applies to --prompts only"),
             (["--head", "heads/shipped/smollm2-135m-medusa", "--data", tmp_path / "none.jsonl", "--stride", "2"],
              "--stride applies to --prompts only")]
    for args, message in cases:
        result = run_script("eval_head.py", *args, check=False)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_prepare_data_writes_the_first_turns_of_the_conversations_asked_for(tmp_path):
    """Conversations are numbered as training numbers them (an unusable record is skipped, not counted); the first
    user turn of each asked for becomes a prompt that eval_head.py reads; an existing file is never written over."""
    data = tmp_path / "data.jsonl"
    records = [{"messages": [{"role": "user", "content": f"question {n}"}, {"role": "assistant", "content": "yes"}]}
               for n in range(5)]
    records.insert(2, {"messages": [{"role": "user", "content": "no reply"}]})
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    out = tmp_path / "prompts.jsonl"
    args = ["prompts", "--out", out, "--skip", "1", "--count", "3", "data.source=json", f"data.path={data}"]
    run_script("prepare_data.py", *args)
    from bench.prompts import read_prompts

    assert read_prompts(out) == [{"id": n, "prompt": f"question {n}"} for n in (1, 2, 3)]
    refused = run_script("prepare_data.py", *args, check=False)
    assert refused.returncode == 2 and "exists" in refused.stderr and len(read_prompts(out)) == 3


def test_vocab_projection_benchmark_prints_every_row_count():
    result = run_script("bench_vocab_projection.py", "--vocab", "64", "--hidden", "8", "--rows", "1", "3",
                        "--repeats", "2")
    rows = [line for line in result.stdout.splitlines() if line.startswith("| 64 |")]
    assert [line.split("|")[2].strip() for line in rows] == ["1", "3"]


# The scripts' command-line spellings (cli/args.py), parsed in the interpreter the scripts run in.
PARSE = r"""
import dataclasses, json, sys
from cli.args import check_early_exit, parse_method, parse_proposer
from bench.methods import HFBaseline, method_to_json

out = []
for kind, text, kwargs in json.loads(sys.argv[1]):
    try:
        if kind == "method":
            out.append(method_to_json(parse_method(text, **kwargs)))
        elif kind == "proposer":
            out.append(dataclasses.asdict(parse_proposer(text, **kwargs)))
        else:
            check_early_exit({text: HFBaseline("hf-early-exit", early_exit_layers=kwargs["n"])}, kwargs["layers"])
            out.append("ok")
    except SystemExit as error:
        out.append({"error": str(error)})
print(json.dumps(out))
"""


def test_command_line_spellings_parse_into_typed_values():
    spec = dataclasses.asdict
    cases = [  # (kind, text, keyword arguments, the typed value or an error's fragment)
        ("method", "hf-greedy", {}, method_to_json(HFBaseline("hf-greedy"))),
        ("method", "hf-greedy-bf16", {}, method_to_json(HFBaseline("hf-greedy", "bfloat16"))),
        ("method", "hf-pld-fp32", {}, method_to_json(HFBaseline("hf-pld", "float32"))),
        ("method", "hf-early-exit", {}, method_to_json(HFBaseline("hf-early-exit"))),
        ("method", "hf-early-exit:2", {}, method_to_json(HFBaseline("hf-early-exit", early_exit_layers=2))),
        ("method", "hf-early-exit:x", {}, "--methods: hf-early-exit:x: N must be a layer count"),
        ("method", "hf-early-exit:0", {}, "--methods: hf-early-exit:0: N must be a layer count"),
        ("method", "hf-assisted", {"draft_model": "d"}, method_to_json(HFBaseline("hf-assisted", draft_model="d"))),
        ("method", "hf-assisted", {}, "--methods: hf-assisted needs --draft-model"),
        ("method", "hf-beam", {}, "--methods: unknown HF baseline 'hf-beam'"),
        ("method", "eagle3-bf16", {}, "--methods: unknown proposer 'eagle3-bf16'"),
        ("method", "ngram", {}, method_to_json(DecoderMethod(ProposerSpec("ngram")))),
        ("method", "eagle3+ngram@4", {}, method_to_json(DecoderMethod(ProposerSpec("eagle3", lookup_first=True), 4))),
        ("method", "eagle:/runs/x@3", {}, method_to_json(DecoderMethod(ProposerSpec("eagle", head="/runs/x"), 3))),
        ("method", "medusa+ngram:/runs/a@b/head", {},
         method_to_json(DecoderMethod(ProposerSpec("medusa", head="/runs/a@b/head", lookup_first=True)))),
        ("method", "draft@3", {"draft_model": "d"}, method_to_json(DecoderMethod(ProposerSpec("draft", draft_model="d"),
                                                                                 3))),
        ("method", "draft", {}, "--methods: draft needs --draft-model"),
        ("method", "ngram@0", {}, "--methods: ngram@0: the tree size after '@' must be a positive integer"),
        ("proposer", "eagle3+ngram", {}, spec(ProposerSpec("eagle3", lookup_first=True))),
        ("proposer", "eagle3:DIR", {}, spec(ProposerSpec("eagle3", head="DIR"))),
        ("proposer", "eagle3+ngram:DIR", {}, spec(ProposerSpec("eagle3", head="DIR", lookup_first=True))),
        ("proposer", "medusa", {"head": "H"}, spec(ProposerSpec("medusa", head="H"))),
        ("proposer", "ngram", {"draft_model": "d"}, spec(ProposerSpec("ngram"))),  # --draft-model is draft's only
        ("proposer", "eagle3:DIR", {"head": "OTHER"}, "--proposer: 'eagle3:DIR' names a head directory, and --head"),
        ("proposer", "ngram+ngram", {}, "--proposer: unknown proposer 'ngram+ngram'"),
        ("proposer", "ngram", {"head": "H"},
         "--proposer: a head directory is for medusa, eagle, eagle3, dflash, not 'ngram'"),
        ("proposer", "eagle3:", {}, "--proposer: 'eagle3:' names no head directory"),
        ("check", "hf-early-exit:3", {"n": 3, "layers": 4}, "ok"),
        ("check", "hf-early-exit:4", {"n": 4, "layers": 4}, "--methods: hf-early-exit:4: N must be a layer count "
                                                             "from 1 to 3 (the target has 4 layers)"),
    ]
    result = run_script("-c", PARSE, json.dumps([case[:3] for case in cases]), cwd=REPO / "scripts")
    for (kind, text, kwargs, expected), got in zip(cases, json.loads(result.stdout), strict=True):
        if isinstance(expected, str) and expected != "ok":
            assert expected in got.get("error", ""), (kind, text, kwargs, got)
        else:
            assert got == expected, (kind, text, kwargs)


# --- the library the scripts call ---


def test_missing_local_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        load_target(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_target(str(tmp_path / "nope.gguf"))
    with pytest.raises(ValueError, match="unknown dtype"):
        load_target("smollm2-135m", dtype="float8")
    assert torch.get_num_threads() >= 1


def test_proposer_specs_are_checked_and_their_errors_name_the_field():
    assert ProposerSpec("eagle3", lookup_first=True).label == "eagle3+ngram" and ProposerSpec("ngram").label == "ngram"
    assert ProposerSpec("medusa", head=Path("/runs/head")).head == "/runs/head"
    with pytest.raises(dataclasses.FrozenInstanceError):
        ProposerSpec("ngram").name = "none"
    for kwargs, field in [({"name": "eagle4"}, "ProposerSpec.name"), ({"name": "draft"}, "ProposerSpec.draft_model"),
                          ({"name": "ngram", "draft_model": "d"}, "ProposerSpec.draft_model"),
                          ({"name": "ngram", "head": "h"}, "ProposerSpec.head"),
                          ({"name": "none", "lookup_first": True}, "ProposerSpec.lookup_first")]:
        with pytest.raises(ValueError, match=field) as error:
            ProposerSpec(**kwargs)
        assert "--" not in str(error.value)  # a library error names no command-line flag
    assert isinstance(build_proposer(ProposerSpec("none"), None), NoProposer)  # these two need no target
    assert isinstance(build_proposer(ProposerSpec("ngram"), None), NgramProposer)


def test_benchmark_methods_are_checked_and_round_trip_through_json():
    assert HFBaseline("hf-greedy", "bf16").dtype == "bfloat16"
    for kwargs, field in [({"method": "hf-beam"}, "HFBaseline.method"),
                          ({"method": "hf-assisted"}, "HFBaseline.draft_model"),
                          ({"method": "hf-greedy", "early_exit_layers": 2}, "HFBaseline.early_exit_layers"),
                          ({"method": "hf-early-exit", "early_exit_layers": 0}, "HFBaseline.early_exit_layers")]:
        with pytest.raises(ValueError, match=field):
            HFBaseline(**kwargs)
    with pytest.raises(ValueError, match="DecoderMethod.tree_size"):
        DecoderMethod(ProposerSpec("ngram"), 0)
    for method in (HFBaseline("hf-pld", "bfloat16"), HFBaseline("hf-early-exit", early_exit_layers=3),
                   HFBaseline("hf-assisted", draft_model="d"),
                   DecoderMethod(ProposerSpec("medusa", head="h", lookup_first=True), 4)):
        assert method_from_json(json.loads(json.dumps(method_to_json(method)))) == method


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_divergence_report_scores_the_first_differing_token(tiny_dir):
    from bench.divergence import divergence_report

    model = load_target(str(tiny_dir), attn_implementation="sdpa", quiet=True).model
    ids = torch.tensor([5, 6, 7])
    logits = model(ids[None]).logits[0, -1]
    best, other = logits.topk(2).indices.tolist()
    records = [{"id": 0, "outputs": {"hf-greedy": [best, 1], "x": [other, 1]}},
               {"id": 1, "outputs": {"hf-greedy": [best], "x": [best]}}]
    report = divergence_report(records, [ids, ids], {"x": model}, model, model)
    case = report["x"]["cases"][0]
    assert report["x"]["divergent"] == 1 and case["position"] == 0 and (case["ours"], case["hf"]) == (other, best)
    assert case["fp32_gap"] == pytest.approx(float(logits[best] - logits[other]), abs=1e-5)
    # every run float32: float32's own rounding, measured against a float64 copy, decides
    exact = copy.deepcopy(model).double()(ids[None]).logits[0, -1]
    error = max(abs(float(logits[t].double() - exact[t])) for t in (best, other))
    assert case["rounding_error"] == pytest.approx(error) and case["fp64_gap"] == pytest.approx(
        float(exact[best] - exact[other]))
    assert not case["near_tie"] and not case["fp64_picks_ours"] and report["x"]["unexplained"] == 1
    assert next(model.parameters()).dtype == torch.float32  # the model handed in is left as it was
    # two tokens whose logits are equal in any precision: a near-tie
    with torch.no_grad():
        model.get_output_embeddings().weight[other] = model.get_output_embeddings().weight[best]
    tie = divergence_report(records, [ids, ids], {"x": model}, model, model)["x"]
    assert tie["cases"][0]["near_tie"] and tie["near_ties"] == 1 and tie["unexplained"] == 0


def test_divergence_report_counts_the_bf16_baselines_rounding(tiny_dir):
    """A float32 method that differs from a bf16 HF greedy run: the baseline's rounding decides the near-tie."""
    from bench.divergence import divergence_report, rounding_step

    model = load_target(str(tiny_dir), attn_implementation="sdpa", quiet=True).model
    bf16 = load_target(str(tiny_dir), dtype="bfloat16", attn_implementation="sdpa", quiet=True).model
    ids = torch.tensor([5, 6, 7])
    low, high = bf16(ids[None]).logits[0, -1], model(ids[None]).logits[0, -1]
    best, other = low.float().topk(2).indices.tolist()
    records = [{"id": 0, "outputs": {"hf-greedy": [best], "x": [other]}}]
    case = divergence_report(records, [ids], {"x": model}, model, bf16)["x"]["cases"][0]
    error = max(abs(float(low[t].float() - high[t])) for t in (best, other))
    assert case["rounding_error"] == pytest.approx(error) and error > 0
    assert case["low_precision_gap"] == pytest.approx(abs(float(low[best].float() - low[other].float())))
    one_step = case["low_precision_gap"] <= rounding_step(low[best])
    assert case["near_tie"] == (case["fp32_gap"] <= 2 * error or one_step)


def test_hf_early_exit_reproduces_greedy_and_counts_only_full_target_passes():
    model = tiny_model("llama", num_hidden_layers=4).eval()
    assert early_exit_layers(None, 4) == 1 and early_exit_layers(3, 4) == 3
    for bad in (4, 0):
        with pytest.raises(ValueError, match="HFBaseline.early_exit_layers must be a layer count from 1 to 3"):
            early_exit_layers(bad, 4)
    counter = ForwardCounter(model)
    ids = torch.tensor([5, 9, 2, 7, 5, 9])
    greedy, _, greedy_passes, _ = run_hf(model, counter, ids, HFBaseline("hf-greedy"), 12, [0])
    drafted, _, passes, _ = run_hf(model, counter, ids, HFBaseline("hf-early-exit", early_exit_layers=2), 12, [0])
    assert drafted == greedy and greedy_passes == len(greedy)
    # A random model's early exit drafts are mostly rejected: about one full pass a token. Counting the draft's own
    # passes too would give several a token.
    assert 1 < passes <= len(drafted) + 1
    with pytest.raises(ValueError, match="from 1 to 3"):  # checked against the model it runs on
        run_hf(model, counter, ids, HFBaseline("hf-early-exit", early_exit_layers=4), 12, [0])
    counter.remove()
    assert not model._forward_pre_hooks


def test_hf_baselines_run_on_the_targets_own_model_and_load_other_dtypes_once(tiny_dir):
    target = load_target(str(tiny_dir), quiet=True)
    models = HFModels(target, str(tiny_dir))
    assert models.model() is target.model and models.model("float32") is target.model
    bf16 = models.model("bfloat16")
    assert bf16 is not target.model and bf16.dtype == torch.bfloat16 and models.model("bf16") is bf16
    assert models.counter("bfloat16") is models.counter(torch.bfloat16)
    models.counter()
    assert target.model._forward_pre_hooks
    models.close()
    assert not target.model._forward_pre_hooks  # the target's model is left as it was


def test_benchmark_output_keeps_the_finished_prompts_of_a_run_that_dies(tiny_dir, tmp_path, monkeypatch):
    import bench.harness as harness

    calls = []
    real_run_ours = harness.run_ours

    def dies_on_the_second_prompt(*args):
        calls.append(1)
        if len(calls) == 3:  # the warm-up, the first prompt, then the second prompt
            raise KeyboardInterrupt
        return real_run_ours(*args)

    monkeypatch.setattr(harness, "run_ours", dies_on_the_second_prompt)
    prompts = [{"id": index, "prompt": p} for index, p in enumerate(["one two one two", "abc abc abc", "x y"])]
    out = tmp_path / "results.json"
    target = load_target(str(tiny_dir), quiet=True)
    with pytest.raises(KeyboardInterrupt):
        harness.run_benchmark(target, str(tiny_dir), {"ngram": DecoderMethod(ProposerSpec("ngram"))}, prompts, out,
                              max_new_tokens=8, progress=False)
    results = json.loads(out.read_text())
    assert results["config"]["n_prompts_done"] == 1 and len(results["records"]) == 1
    assert set(results["methods"]) == {"hf-greedy", "ngram"}  # the baseline was added
    assert results["methods"]["ngram"]["identical"] == 1.0
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith("results")] == ["results.json"]
    assert not target.model._forward_pre_hooks


# --- prompt batches ---


def test_prompt_batches_are_left_padded_and_left_truncated_without_changing_the_tokenizer(tiny_dir):
    from runtime.engine.prompts import batch_pad_token_id, encode_prompt_batch

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    short, long = "the sea", " ".join(["a long question about the sea"] * 8) + " assistant:"
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in (short, long)]
    width = len(ids[0]) + 3
    assert len(ids[1]) > width
    for pad_token in (tokenizer.pad_token, None):  # with a pad token, and without one (padding with end-of-sequence)
        tokenizer.pad_token = pad_token
        tokenizer.padding_side, tokenizer.truncation_side = "right", "right"
        before = (tokenizer.padding_side, tokenizer.truncation_side, tokenizer.pad_token, tokenizer.pad_token_id)
        encoded = encode_prompt_batch(tokenizer, [short, long], max_length=width)
        assert (tokenizer.padding_side, tokenizer.truncation_side, tokenizer.pad_token,
                tokenizer.pad_token_id) == before
        assert isinstance(encoded, dict) and set(encoded) == {"input_ids", "attention_mask"}
        assert encoded["input_ids"].shape == encoded["attention_mask"].shape == (2, width)
        assert encoded["input_ids"][1].tolist() == ids[1][-width:]  # truncated at the start: the end stays
        assert encoded["input_ids"][0, 3:].tolist() == ids[0]  # padded on the left
        pad = tokenizer.eos_token_id if pad_token is None else tokenizer.pad_token_id
        assert batch_pad_token_id(tokenizer) == pad and encoded["input_ids"][0, :3].tolist() == [pad] * 3
        assert encoded["attention_mask"][0].tolist() == [0] * 3 + [1] * len(ids[0])
        assert encoded["attention_mask"][1].tolist() == [1] * width
    narrow = encode_prompt_batch(tokenizer, [short], max_length=100)
    assert narrow["input_ids"][0].tolist() == ids[0]  # no longer than the longest prompt
