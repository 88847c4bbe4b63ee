"""Short training runs on a tiny trained target: every head learns, features, checkpoints, resume, DeepSpeed ranks."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.tiny_training import build_tiny_target, tiny_overrides, write_conversations
from training.config import compose_config

ROOT = Path(__file__).resolve().parents[1]

# ZeRO-3 keeps parameters below DeepSpeed's persistence threshold (1e5 elements) whole on every rank: every parameter
# of a tiny head would be. Threshold 0 partitions them all, as a real target's head is partitioned.
PARTITION_EVERY_PARAMETER = "deepspeed.param_persistence_threshold=0"
PARTITION_ALL = ["deepspeed=zero3", PARTITION_EVERY_PARAMETER]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("tiny")
    target = build_tiny_target(base / "target")
    data = write_conversations(base / "data.jsonl", 120)
    return target, data


def run_config(tiny, output_dir, head, steps, extra=()):
    from training.recipe import train

    target, data = tiny
    return train(compose_config(tiny_overrides(target, data, output_dir, head, steps, list(extra))))


def head_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "head" / "model.safetensors"))


@pytest.mark.parametrize("head", ["eagle", "eagle3", "medusa"])
def test_bf16_training_takes_an_fp32_targets_online_features(tiny, tmp_path, head):
    """trainer.precision=bf16 on a CPU: the head trains in bf16 while the target (auto: fp32 on a CPU) computes its
    features online; they reach the head in its dtype."""
    summary = run_config(tiny, tmp_path / "run", head, 2, ["trainer.precision=bf16", "eval.every=2"])
    assert summary["steps"] == 2 and summary["final_eval"] is not None
    weights = head_weights(tmp_path / "run")
    assert all(torch.isfinite(w.float()).all() for w in weights.values())


@pytest.mark.parametrize("head", ["eagle", "eagle3", "medusa", "dflash"])
def test_short_run_lowers_loss_and_raises_acceptance(tiny, tmp_path, head):
    lr = {"eagle": "3e-3", "eagle3": "3e-3", "medusa": "1e-2", "dflash": "3e-3"}[head]
    summary = run_config(tiny, tmp_path / "run", head, 24, [f"trainer.lr={lr}", "eval.every=24"])
    history = json.loads((tmp_path / "run" / "summary.json").read_text())["final_eval"]
    assert history == summary["final_eval"]
    curves = (tmp_path / "run" / "curves.csv").read_text().splitlines()
    assert curves[0].startswith("step,tau,val_loss,acc@1")
    first, last = [line.split(",") for line in (curves[1], curves[-1])]
    assert int(first[0]) == 0 and int(last[0]) == 24
    assert float(last[2]) < float(first[2]), "held-out loss did not fall"
    assert float(last[3]) > float(first[3]), "acc@1 did not rise over the untrained head"
    assert curves[0].endswith(",tokens,decoding_tau") and int(first[-2]) == 0
    assert int(last[-2]) == summary["final_eval"]["tokens"] > 24 * 4  # every step's samples, padding excluded
    assert float(last[-1]) == pytest.approx(summary["final_eval"]["decoding_tau"], abs=1e-4)
    assert 1 <= summary["final_eval"]["decoding_tau"] <= 1 + len(summary["final_eval"]["acc"])
    if head == "eagle":  # the learning curve reads curves.csv back
        from training.tracking import plot_learning_curves, read_curves

        read = read_curves(tmp_path / "run" / "curves.csv")
        assert read[-1]["tokens"] == summary["final_eval"]["tokens"]
        assert read[-1]["acc"] == pytest.approx(summary["final_eval"]["acc"], abs=1e-4)
        assert read[-1]["decoding_tau"] == pytest.approx(summary["final_eval"]["decoding_tau"], abs=1e-4)
        with pytest.raises(ValueError, match="log axis"):  # only the untrained start: nothing a log axis can place
            plot_learning_curves({"run": (read[:1], 0)}, tmp_path / "curve.png")
        assert plot_learning_curves({"run": (read, 0)}, tmp_path / "curve.png").stat().st_size > 0  # from scratch
        assert plot_learning_curves({"run": (read, 1000)}, tmp_path / "curve.png").stat().st_size > 0
    assert (tmp_path / "run" / "curves.png").stat().st_size > 0
    saved = json.loads((tmp_path / "run" / "head" / "config.json").read_text())
    assert saved["tree"]["acceptance"] == summary["final_eval"]["acc"]  # runtime tree calibration
    assert saved["training"]["config"]["trainer"]["max_steps"] == 24  # how the head was trained
    check_held_out_acceptance(tiny, tmp_path / "run", summary["final_eval"], head)
    if head == "medusa":
        check_shipping(tmp_path / "run", tmp_path / "shipped", tiny[0])


def check_held_out_acceptance(tiny, run_dir: Path, final_eval: dict, head_type: str) -> None:
    """The trained head, loaded back and scored outside the trainer (as scripts/eval_head.py scores any head), gets
    the acceptance the run's final evaluation reported."""
    from heads.formats import load_any_head
    from runtime.target.model import load_target
    from training.evaluate import held_out_acceptance

    conf = compose_config(tiny_overrides(*tiny, run_dir, head_type))
    target = load_target(str(tiny[0]), dtype="float32")
    head, _ = load_any_head(run_dir / "head", target.model, identity=target.identity, tokenizer=target.tokenizer)
    result = held_out_acceptance(target, head.float().eval(), conf.head, conf.data, conf.eval)
    assert result["acc"] == pytest.approx(final_eval["acc"], abs=1e-5)
    assert result["tau"] == pytest.approx(final_eval["tau"], abs=1e-5) and result["conversations"] == 8
    if head_type == "medusa":
        check_decoding_tau_is_the_runtimes(target, head.float().eval(), conf)
    check_eval_head_script(tiny, run_dir, final_eval, head_type)


def check_decoding_tau_is_the_runtimes(target, head, conf) -> None:
    """The walk over teacher-forced ranks (``decoding_tau`` of ``tree_accepted``) gets the very tau the runtime gets
    decoding the same replies greedily with the same static tree: tokens, passes and where each pass drafts."""
    from runtime.engine.decoder import SpeculativeDecoder
    from runtime.proposers.medusa import MedusaProposer, closed_choices, tree_accepted
    from training.data import build_splits
    from training.evaluate import reply_samples, samples_acceptance
    from training.metrics import decoding_walk

    choices = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    decoder = SpeculativeDecoder(target, MedusaProposer(head, choices=choices), tree_size=1 + len(choices))
    prompts, replies, tokens, passes = [], [], 0, 0
    for conversation in build_splits(conf.data, target.tokenizer)["validation"].select(range(4)):
        mask = conversation["assistant_mask"]
        prompt = conversation["input_ids"][: mask.index(1)]
        result = decoder.generate(prompt, 40)
        tokens, passes = tokens + sum(result.accept_lengths), passes + len(result.accept_lengths)
        prompts.append(prompt)
        replies.append(result.tokens)
    samples = reply_samples(prompts, replies, max_length=1024)
    scored = samples_acceptance(target, head, conf.head, samples, dataclasses.replace(conf.eval, max_samples=4),
                                max_rank_paths=1)
    assert scored["positions"] == sum(map(len, replies))
    accepted = tree_accepted(closed_choices(choices), scored["ranks"])
    assert accepted.max() >= 2, "the head should get drafts accepted for this check to mean anything"
    assert decoding_walk(accepted, scored["run_lengths"], scored["reached"]) == (tokens, passes)


def check_eval_head_script(tiny, run_dir: Path, final_eval: dict, head_type: str) -> None:
    """scripts/eval_head.py scores every head type: on the run's held-out split (Medusa: as the run did), and on the
    target's own greedy replies to prompts, with a figure for each draft step."""
    from training.metrics import acceptance_rates

    target_dir, data = tiny
    common = ["--head", run_dir / "head", "--target", target_dir, "--depth", "3", "--threads", "1"]
    steps = 3  # eval.depth of the run, and its Medusa heads
    if head_type == "medusa":
        held_out = eval_head_report(common + ["--data", data, "--val-samples", "8", "--eval-samples", "8",
                                              "--max-length", "64"])
        assert held_out["acc"] == pytest.approx(final_eval["acc"], abs=1e-5) and held_out["conversations"] == 8
    prompts = run_dir / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"repeat {w} {n} times"}) + "\n"
                               for w, n in (("abc", 3), ("fed", 4), ("gh", 5))))
    report = eval_head_report(common + ["--prompts", prompts, "--stride", "2", "--max-new-tokens", "24",
                                        "--reply-batch", "2", "--max-length", "128", "--out",
                                        run_dir / "eval_prompts.json"])  # prompts 1 and 3
    assert report["head_type"] == head_type and report["conversations"] == 2 and len(report["acc"]) == steps
    if head_type == "medusa":  # the measured tree: its rank paths count the same matches as the chain's rates
        tree = json.loads((run_dir / "eval_prompts.json").read_text())["tree"]
        frequency = dict(zip(map(tuple, tree["rank_paths"]), tree["rank_path_frequencies"]))
        assert frequency[(0,)] == pytest.approx(report["acc"][0], abs=1e-9)
        assert frequency.get((0, 0), 0.0) == pytest.approx(report["acc"][0] * report["acc"][1], abs=1e-9)
        assert report["tree"]["tau_by_size"]["2"] == pytest.approx(1 + report["acc"][0], abs=1e-9)
        assert sorted(tree["rank_path_frequencies"], reverse=True) == tree["rank_path_frequencies"]
        best, estimated = tree["tau_by_size"], tree["tau_by_size_estimated_tree"]  # no tree beats the measured one
        assert estimated.keys() == best.keys() and all(estimated[n] <= best[n] + 1e-9 for n in best)
        for key in ("decoding_tau_by_size", "decoding_tau_by_size_estimated_tree"):  # as decoding gets them
            assert tree[key].keys() == best.keys() and all(1 <= tau <= 1 + steps for tau in tree[key].values())
    assert 1 <= report["decoding_tau"] <= 1 + steps
    assert 0 < report["reply_tokens"] <= 2 * 24 and report["positions"] == report["reply_tokens"]
    reached = [report["positions"]]
    for rate in report["acc"]:
        reached.append(reached[-1] * rate)
    assert report["tau"] == pytest.approx(acceptance_rates(torch.tensor(reached))[1], abs=1e-6)


def eval_head_report(args: list) -> dict:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval_head.py"), *map(str, args)], env=_env(),
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def check_shipping(run_dir: Path, into: Path, target_dir: Path) -> None:
    """scripts/ship_head.py stores the head in bf16 with its training record; it loads into a proposer."""
    from runtime.proposers import ProposerSpec, build_proposer
    from runtime.target.model import load_target

    data_command = "python scripts/prepare_data.py selfdistill --out sd.jsonl"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "ship_head.py"), str(run_dir), "tiny-medusa", "--into",
                    str(into), "--train-seconds", "12", "--data-command", data_command, "--data-seconds", "5",
                    "--tree-size", "3", "--tree-size", "bf16=5", "--rank-paths", str(run_dir / "eval_prompts.json")],
                   check=True, env=_env(), cwd=ROOT)
    shipped = into / "tiny-medusa"
    config = json.loads((shipped / "config.json").read_text())
    assert config["training"]["wall_seconds"] == 12 and config["training"]["command"].startswith("python training/")
    assert config["training"]["data_command"] == data_command and config["training"]["data_seconds"] == 5
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(shipped / "model.safetensors")).values())
    proposer = build_proposer(ProposerSpec("medusa", head=str(shipped)), load_target(str(target_dir)))
    assert proposer.head_accuracy == config["tree"]["acceptance"]
    assert config["tree"]["sizes"] == {"float32": 3, "bfloat16": 5} and proposer.tree_size == 3
    measured = json.loads((run_dir / "eval_prompts.json").read_text())["tree"]["rank_paths"]
    assert config["tree"]["rank_paths"] == measured and proposer.rank_paths == [tuple(p) for p in measured]
    assert proposer.tree_choices(3) == [tuple(p) for p in measured[:2]]  # the measured tree, not the calibrated one
    # the destination is replaced whole: a directory that is not a shipped head, the run's own included, is refused
    (into / "notes").mkdir()
    (into / "notes" / "mine.txt").write_text("keep")
    for parent, name in ((into, "notes"), (run_dir.parent, run_dir.name)):
        refused = subprocess.run([sys.executable, str(ROOT / "scripts" / "ship_head.py"), str(run_dir), name,
                                  "--into", str(parent)], env=_env(), cwd=ROOT, capture_output=True, text=True)
        assert refused.returncode != 0 and "ship to a new NAME" in refused.stderr, refused.stderr
    assert (into / "notes" / "mine.txt").read_text() == "keep" and (run_dir / "head" / "config.json").is_file()


def test_shipping_takes_a_measured_tree_only_from_an_eval_head_report_for_a_medusa_head(tmp_path):
    """training.ship refuses a report that is not scripts/eval_head.py's, a static tree for a head type without one
    and paths the runtime would not load, each with a ValueError naming the report (scripts/ship_head.py prints it
    after --rank-paths)."""
    from training.ship import rank_paths_tree

    report = tmp_path / "report.json"
    report.write_text(json.dumps({"tree": {"rank_paths": [[0], [0, 0], [1]], "rank_path_frequencies": [0.5, 0.2, 0.1]},
                                  "positions": 8, "scored_on": "replies"}))
    medusa = {"head_type": "medusa", "head_config": {"num_heads": 2}}
    tree = rank_paths_tree(report, medusa)
    assert tree["rank_paths"] == [[0], [0, 0], [1]] and tree["rank_path_frequencies"] == [0.5, 0.2, 0.1]
    assert tree["rank_paths_measured_on"] == {"scored_on": "replies", "prompts": None, "positions": 8, "head": None}
    with pytest.raises(ValueError, match=re.escape(f"{report}: the head is eagle3, and only a Medusa head has")):
        rank_paths_tree(report, {"head_type": "eagle3", "head_config": {}})
    with pytest.raises(ValueError, match=re.escape(f"{report}: Medusa rank path 1 [0, 0] is empty or longer")):
        rank_paths_tree(report, {"head_type": "medusa", "head_config": {"num_heads": 1}})
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="other.json: not a Medusa report of scripts/eval_head.py --out"):
        rank_paths_tree(tmp_path / "other.json", medusa)


def test_offline_features_match_online(tiny, tmp_path):
    from training.data import collate, load_splits
    from training.features import OfflineFeatures, extract_offline, target_features, write_manifest
    from runtime.target.model import load_target

    target_dir, data = tiny
    conf = compose_config(tiny_overrides(target_dir, data, tmp_path / "run", "eagle3"))
    target = load_target(str(target_dir))
    split = load_splits(conf.data, target.tokenizer, True)["train"]
    store = tmp_path / "store"
    extract_offline(target, split, store, [0, 1, 1], 4, "float32", 8, 1, progress=False)
    write_manifest(store, len(split), {})
    offline = OfflineFeatures(store, len(split))
    indices = [3, 70, 0]
    batch = collate([split[i] for i in indices], 1)
    online = target_features(target, batch["input_ids"], [0, 1, 1], 4)
    stored = offline.batch(indices, batch["input_ids"].shape[1], "cpu", torch.float32)
    for name in ("hidden", "layer_hidden", "topk_logprobs"):
        real = batch["assistant_mask"] | (torch.arange(batch["input_ids"].shape[1]) < batch["lengths"][:, None])
        torch.testing.assert_close(stored[name][real], online[name][real], atol=1e-5, rtol=1e-5)
    assert torch.equal(stored["topk_ids"][:, :5], online["topk_ids"][:, :5])


def test_offline_run_trains(tiny, tmp_path):
    summary = run_config(tiny, tmp_path / "run", "eagle", 4,
                         ["features.mode=offline", f"features.dir={tmp_path / 'store'}", "eval.at_start=false",
                          "tracker=wandb"])
    assert summary["features"] == "offline" and summary["final_eval"]["step"] == 4
    assert (tmp_path / "store" / "manifest.json").is_file()
    offline_runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert offline_runs and list(offline_runs[0].glob("*.wandb")), "no offline W&B run in the run directory"


def test_medusa2_lora_keeps_base_weights_and_merges(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    target_dir, _ = tiny
    base_before = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(target_dir).state_dict().items()}
    run_config(tiny, tmp_path / "run", "medusa", 6, ["head.lora.enabled=true", "trainer.lr=1e-2",
                                                      "eval.at_start=false"])
    adapter = tmp_path / "run" / "head" / "target_lora"
    assert (adapter / "adapter_model.safetensors").is_file()
    lora_weights = load_file(str(adapter / "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in lora_weights.items()), "adapters did not train"
    base = AutoModelForCausalLM.from_pretrained(target_dir)
    for name, value in base.state_dict().items():  # the target on disk (the base weights) is unchanged
        assert torch.equal(value, base_before[name]), name
    with_adapter = PeftModel.from_pretrained(base, str(adapter)).eval()
    ids = torch.randint(4, 40, (2, 12))
    expected = with_adapter(input_ids=ids).logits
    merged = with_adapter.merge_and_unload()
    torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
    from runtime.target.model import target_from_model

    wrapped = target_from_model(merged)
    positions = torch.arange(12)[None].expand(2, -1)
    output = wrapped.forward(ids, positions, wrapped.new_cache(2, 16), None)
    torch.testing.assert_close(output.logits, expected, atol=1e-4, rtol=1e-4)


def _train_command(tiny, output_dir, steps, extra, as_module=False, head="eagle"):
    """``python training/train.py ...``, or with ``as_module`` ``python -m training.train ...`` (no evaluation of
    the untrained head unless ``extra`` sets eval.at_start)."""
    target, data = tiny
    entry = ["-m", "training.train"] if as_module else [str(ROOT / "training" / "train.py")]
    at_start = [] if any(o.startswith("eval.at_start=") for o in extra) else ["eval.at_start=false"]
    return [sys.executable, *entry, *tiny_overrides(target, data, output_dir, head, steps, [*at_start, *extra])]


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    return env


def test_resume_after_kill_continues_exactly(tiny, tmp_path):
    extra = ["checkpoint.every=2", "trainer.lr=3e-3"]
    reference = tmp_path / "reference"  # trained with `python -m training.train`, the others with the script
    subprocess.run(_train_command(tiny, reference, 8, extra, as_module=True), check=True, env=_env(), cwd=ROOT,
                   capture_output=True)
    killed = tmp_path / "killed"
    # Slow the killed run's steps down (eval every step) so it is reliably killed mid-run, after a checkpoint.
    process = subprocess.Popen(_train_command(tiny, killed, 8, extra + ["eval.every=1"]), env=_env(), cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = killed / "checkpoints" / "latest.json"
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if latest.is_file() and json.loads(latest.read_text())["step"] >= 2:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    step = json.loads(latest.read_text())["step"]
    assert 2 <= step < 8, f"kill came too late (checkpoint at step {step})"
    # resume=true continues from the saved step (the eval cadence does not touch the weights)
    subprocess.run(_train_command(tiny, killed, 8, extra + ["resume=true"]), check=True, env=_env(), cwd=ROOT,
                   capture_output=True)
    resumed, expected = head_weights(killed), head_weights(reference)
    for name in expected:
        torch.testing.assert_close(resumed[name], expected[name], atol=0, rtol=0, msg=name)


class RunsCode:
    """Pickles as a call of ``exec``: unpickling it writes ``marker`` (what a crafted checkpoint could do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"import pathlib; pathlib.Path({str(self.marker)!r}).write_text('ran')",)


def test_resume_refuses_a_checkpoint_that_would_run_code(tiny, tmp_path):
    from training.checkpoints import UnsafeCheckpoint, weights_only_load

    extra = ["eval.at_start=false", "checkpoint.every=1"]
    run_config(tiny, tmp_path / "run", "eagle", 2, extra)
    marker = tmp_path / "ran"
    crafted = tmp_path / "run" / "checkpoints" / "step-00000002" / "mp_rank_00_model_states.pt"
    torch.save(RunsCode(marker), crafted)
    torch.load(crafted, weights_only=False)  # the threat: an unrestricted load runs it
    assert marker.read_text() == "ran"
    marker.unlink()
    with pytest.raises(pickle.UnpicklingError):  # the loader DeepSpeed is given refuses it on its own too
        weights_only_load(crafted)
    # refused outright, not skipped for the intact step-1 checkpoint: someone wrote it
    with pytest.raises(UnsafeCheckpoint, match=r"would import builtins\.exec.*Delete .*step-00000002"):
        run_config(tiny, tmp_path / "run", "eagle", 3, extra + ["resume=true"])
    assert not marker.exists()


def test_resume_falls_back_past_a_damaged_checkpoint(tiny, tmp_path):
    from training.checkpoints import CheckpointError

    extra = ["eval.at_start=false", "checkpoint.every=2", "trainer.lr=3e-3", *PARTITION_ALL]  # ZeRO-3's files
    run = tmp_path / "run"
    run_config(tiny, run, "eagle", 4, extra)
    expected = head_weights(run)
    states = "zero_pp_rank_0_mp_rank_00_model_states.pt"
    newest = run / "checkpoints" / "step-00000004" / states
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # half-written
    with pytest.warns(UserWarning, match=f"step-00000004: {states} is truncated.*resuming from the older "
                                         f"step-00000002"):
        summary = run_config(tiny, run, "eagle", 4, extra + ["resume=true"])
    assert summary["steps"] == 4
    for name, tensor in head_weights(run).items():  # steps 3 and 4 again: the same head
        torch.testing.assert_close(tensor, expected[name], atol=0, rtol=0, msg=name)
    (run / "checkpoints" / "latest.json").write_text('{"tag": "step-')  # a damaged pointer: the newest complete
    with pytest.warns(UserWarning, match="latest.json is unreadable"):
        assert run_config(tiny, run, "eagle", 4, extra + ["resume=true"])["steps"] == 4
    for tag in ("step-00000002", "step-00000004"):
        path = run / "checkpoints" / tag / states
        damaged = bytearray(path.read_bytes())
        damaged[len(damaged) // 2] ^= 0xFF  # one flipped byte
        path.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match=r"(?s)no intact checkpoint.*step-00000004: .*(corrupt|truncated)"):
        with pytest.warns(UserWarning, match="latest.json is unreadable"):  # still: the last run resumed at its end
            run_config(tiny, run, "eagle", 4, extra + ["resume=true"])


def test_resume_says_what_it_continues(tiny, tmp_path):
    from training.checkpoints import CheckpointError

    run = tmp_path / "run"
    with pytest.warns(UserWarning, match="holds no complete checkpoint: training starts at step 0"):
        run_config(tiny, run, "eagle", 1, ["eval.at_start=false", "resume=true"])
    with pytest.raises(CheckpointError, match="head.num_layers: 1 in the checkpoint, 2 in this run"):
        run_config(tiny, run, "eagle", 2, ["eval.at_start=false", "resume=true", "head.num_layers=2"])


def test_offline_store_refuses_features_of_other_settings(tiny, tmp_path):
    from runtime.target.model import load_target
    from training.data import load_splits
    from training.engine import Dist
    from training.features import prepare_offline_store

    target_dir, data = tiny
    target = load_target(str(target_dir))
    store = tmp_path / "store"

    def prepare(head, extra=()):
        conf = compose_config(tiny_overrides(target_dir, data, tmp_path / "run", head, 1,
                                             [f"features.dir={store}", "data.max_samples=20", *extra]))
        split = load_splits(conf.data, target.tokenizer, True)["train"]
        layers = [0, 1, 1] if head == "eagle3" else []
        return prepare_offline_store(conf, target, split, layers, 1, Dist(0, 1, 0, torch.device("cpu")))

    assert prepare("eagle") == store
    assert prepare("medusa") == store  # reads the same features: shares the store
    with pytest.raises(ValueError, match="data.seed: 0 in the store, 1 in this run"):
        prepare("eagle", ["data.seed=1"])  # another shuffle: other conversations in the training split
    with pytest.raises(ValueError, match=r"(?s)extracted for head=eagle\b.*feature_layers: \[\] in the store"):
        prepare("eagle3")
    (store / "manifest.json").unlink()  # a partly extracted store is checked by the record extraction started with
    with pytest.raises(ValueError, match="data.max_length: 64 in the store, 48 in this run"):
        prepare("eagle", ["data.max_length=48"])
    (store / "extraction.json").unlink()
    with pytest.raises(ValueError, match="holds shards but no manifest.json"):
        prepare("eagle")


@pytest.mark.slow
def test_a_plain_install_trains_from_any_directory(tiny, tmp_path):
    """`pip install .` (not editable) ships the configs inside the package: `python -m training.train` and the
    headstart-train entry point train from outside the checkout, reading the installed copy."""
    source, site, elsewhere = tmp_path / "source", tmp_path / "site", tmp_path / "elsewhere"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                                               "runs", "outputs", "wandb", "tests", "scripts"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(source)], check=True, capture_output=True)
    assert (site / "training" / "conf" / "head" / "eagle3.yaml").is_file()
    elsewhere.mkdir()
    env = dict(_env(), PYTHONPATH=str(site))
    found = subprocess.run([sys.executable, "-c", "from training.config import CONFIG_DIR; print(CONFIG_DIR)"],
                           env=env, cwd=elsewhere, check=True, capture_output=True, text=True)
    assert Path(found.stdout.strip()) == site / "training" / "conf"
    target, data = tiny
    overrides = tiny_overrides(target, data, elsewhere / "run", "eagle", 1, ["eval.at_start=false"])
    subprocess.run([sys.executable, "-m", "training.train", *overrides], env=env, cwd=elsewhere, check=True,
                   capture_output=True)
    assert (elsewhere / "run" / "head" / "model.safetensors").is_file()
    composed = subprocess.run([str(site / "bin" / "headstart-train"), "head=eagle3", "--cfg", "job"], env=env,
                              cwd=elsewhere, check=True, capture_output=True, text=True)
    assert "head_type: eagle3" in composed.stdout


def test_existing_run_needs_resume(tiny, tmp_path):
    run_config(tiny, tmp_path / "run", "eagle", 1, ["eval.at_start=false"])
    with pytest.raises(ValueError, match="resume=true"):
        run_config(tiny, tmp_path / "run", "eagle", 2, ["eval.at_start=false"])
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # freeing space: the trained head stays, and a new run keeps off it
    with pytest.raises(ValueError, match="already holds a trained run"):
        run_config(tiny, tmp_path / "run", "eagle", 2, ["eval.at_start=false"])


def test_a_refused_command_changes_nothing_in_the_run_directory(tiny, tmp_path):
    """The run's .hydra files describe the run that happened: a later command refused (the directory holds a run and
    resume is not asked for, an unknown key, a bad value) rewrites none of them and adds no log file. A key the typed
    config lacks is refused with '+' as without it, and the refusal never suggests '+'."""
    run = tmp_path / "run"
    subprocess.run(_train_command(tiny, run, 1, []), check=True, env=_env(), cwd=ROOT, capture_output=True)
    recorded = {path: path.read_bytes() for path in (run / ".hydra").iterdir()}
    assert set(path.name for path in recorded) == {"config.yaml", "overrides.yaml", "hydra.yaml"}
    before = sorted(str(path.relative_to(run)) for path in run.rglob("*"))
    for extra, said in ((["trainer.max_steps=2"], "resume=true"), (["trainer.max_step=2"], "did you mean"),
                        (["+trainer.max_step=2"], "did you mean trainer.max_steps"),
                        (["trainer.micro_batch_size=0"], "must be >= 1")):
        refused = subprocess.run(_train_command(tiny, run, 1, extra), env=_env(), cwd=ROOT, capture_output=True,
                                 text=True)
        assert refused.returncode != 0 and said in refused.stderr, refused.stderr[-2000:]
        assert "Traceback" not in refused.stderr and "+trainer" not in refused.stderr.replace("'+'", "")
        assert {path: path.read_bytes() for path in (run / ".hydra").iterdir()} == recorded, extra
        assert sorted(str(path.relative_to(run)) for path in run.rglob("*")) == before, extra


def curves(run_dir: Path) -> list[list[float]]:
    """curves.csv as numbers: one row per evaluation (step, tau, val_loss, acc@1..K, tokens, decoding_tau)."""
    return [[float(x) for x in line.split(",")] for line in (run_dir / "curves.csv").read_text().splitlines()[1:]]


@pytest.mark.parametrize("head", ["eagle", "eagle3", "medusa", "dflash"])
def test_every_head_trains_and_evaluates_alike_under_zero1_zero2_and_partitioned_zero3(tiny, tmp_path, head):
    """Evaluation calls the head's modules outside the engine's forward (drafting chains, LM heads): under ZeRO-3
    with every parameter partitioned it must see the whole weights, and evaluate and train exactly as ZeRO-2, and
    ZeRO-1 as well: every head type under every stage."""
    extra = ["eval.every=1", "trainer.lr=3e-3"]
    run_config(tiny, tmp_path / "zero2", head, 2, extra)
    run_config(tiny, tmp_path / "zero3", head, 2, extra + PARTITION_ALL)
    run_config(tiny, tmp_path / "zero1", head, 2, extra + ["deepspeed=zero1"])
    expected = curves(tmp_path / "zero2")
    want_weights = head_weights(tmp_path / "zero2")
    for stage in ("zero3", "zero1"):
        actual = curves(tmp_path / stage)
        assert [row[0] for row in actual] == [0, 1, 2]
        for want, got in zip(expected, actual):
            assert got == pytest.approx(want, abs=1e-4), stage
        for name, tensor in head_weights(tmp_path / stage).items():
            torch.testing.assert_close(tensor, want_weights[name], atol=1e-5, rtol=1e-4, msg=f"{stage} {name}")


@pytest.mark.parametrize("zero, head", [("zero1", "medusa"), ("zero2", "eagle"), ("zero3", "eagle3")])
def test_two_process_torchrun_matches_one_process(tiny, tmp_path, zero, head):
    """Two processes (torchrun) train and evaluate the same head as one process accumulating both micro-batches;
    each ZeRO stage with another head type, ZeRO-3 with every parameter partitioned."""
    common = [f"deepspeed={zero}", "trainer.lr=3e-3", "trainer.micro_batch_size=2", "eval.at_start=true",
              *([PARTITION_EVERY_PARAMETER] if zero == "zero3" else [])]
    two = tmp_path / "two"
    command = _train_command(tiny, two, 3, common, head=head)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *command[1:]]
    result = subprocess.run(torchrun, env=_env(), cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    one = tmp_path / "one"
    subprocess.run(_train_command(tiny, one, 3, common + ["trainer.grad_accum=2"], head=head), check=True,
                   env=_env(), cwd=ROOT, capture_output=True)
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert len(set(summary["rank_digests"])) == 1, "ranks diverged"
    expected, actual = head_weights(one), head_weights(two)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=1e-5, rtol=1e-4, msg=name)
    for want, got in zip(curves(one), curves(two)):  # held-out batches split over ranks, summed: same numbers
        assert got == pytest.approx(want, abs=1e-4)


def test_self_distillation_regenerates_replies_and_resumes(tiny, tmp_path):
    from training.data import normalize_conversation, read_records
    from training.selfdistill import DistillSettings, self_distill

    target, data = tiny
    out = tmp_path / "sd.jsonl"
    conf = compose_config(["target=hf", f"target.name={target}", "data=json", f"data.path={data}",
                           "data.max_samples=4", "data.val_samples=1"])
    settings = DistillSettings(max_new_tokens=16, batch_size=2, chunk=2)
    stats = self_distill(conf, out, settings)
    assert stats.conversations == 5 and stats.tokens > 0 and stats.tokens_per_s > 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == [0, 1, 2, 3, 4]
    originals = [json.loads(line) for line in Path(data).read_text().splitlines()[:5]]
    for record, original in zip(records, originals):
        messages = normalize_conversation(record)
        assert messages[0]["content"] == original["conversations"][0]["value"]  # the prompt is kept
        assert messages[-1]["role"] == "assistant"
    lines_before = out.read_text()
    self_distill(conf, out, settings)  # everything is done: nothing is appended
    assert out.read_text() == lines_before
    assert len(list(read_records("json", str(out), "train", None))) == 5
    # killed while writing: a partial last line is dropped and its conversation generated again
    out.write_text(lines_before[: len(lines_before) - 20])
    with pytest.warns(UserWarning, match="partly written line"):
        self_distill(conf, out, settings)
    assert out.read_text() == lines_before
    out.write_text(lines_before[:-1])  # a whole last record without its newline is kept
    self_distill(conf, out, settings)
    assert out.read_text() == lines_before
    lines = lines_before.splitlines(keepends=True)
    out.write_text(lines[0] + "{not json\n" + "".join(lines[2:]))
    with pytest.raises(ValueError, match="sd.jsonl:2 is not a self-distilled record"):
        self_distill(conf, out, settings)


def test_self_distillation_never_mixes_records_made_two_ways(tiny, tmp_path):
    """A rerun into the same file with another data file (even one of the same size and time), temperature, proposer
    or reply length is refused before anything is generated, naming what differs; more conversations of the same
    kind are appended."""
    import os

    from runtime.proposers import ProposerSpec
    from training.selfdistill import MADE_BY, DistillSettings, self_distill

    target, data = tiny
    other = tmp_path / "other.jsonl"
    text = Path(data).read_text()
    other.write_text(text.replace("a", "e", 1))  # same size, another conversation
    os.utime(other, ns=(Path(data).stat().st_atime_ns, Path(data).stat().st_mtime_ns))

    def conf(path, samples=3):
        return compose_config(["target=hf", f"target.name={target}", "data=json", f"data.path={path}",
                               f"data.max_samples={samples}", "data.val_samples=1"])

    out = tmp_path / "sd.jsonl"
    settings = DistillSettings(max_new_tokens=8, batch_size=2, chunk=2)
    self_distill(conf(data), out, settings)
    written = out.read_text()
    assert (tmp_path / f"sd.jsonl{MADE_BY}").is_file()
    for changed, said in ((conf(other), "data.content"), (conf(data), "generation.temperature"),
                          (conf(data), "generation.proposer"), (conf(data), "generation.max_new_tokens")):
        variant = {"generation.temperature": DistillSettings(max_new_tokens=8, temperature=0.7),
                   "generation.proposer": DistillSettings(max_new_tokens=8, proposer=ProposerSpec("ngram")),
                   "generation.max_new_tokens": DistillSettings(max_new_tokens=9)}.get(said, settings)
        with pytest.raises(ValueError, match=f"made otherwise .*{said}"):
            self_distill(changed, out, variant)
        assert out.read_text() == written
    assert self_distill(conf(data, samples=4), out, settings).conversations == 1  # the next conversation, appended
    (tmp_path / f"sd.jsonl{MADE_BY}").unlink()
    with pytest.raises(ValueError, match="no sd.jsonl.made.json saying what made them"):
        self_distill(conf(data, samples=5), out, settings)


def test_self_distillation_prompts_keep_their_end(tiny):
    from runtime.target.model import load_target
    from training.selfdistill import prompt_ids

    tokenizer = load_target(str(tiny[0])).tokenizer
    short = [{"role": "user", "content": "the sea"}]
    long = [{"role": "user", "content": " ".join(["a long question about the sea"] * 8)}]
    full = prompt_ids(tokenizer, None, long, max_length=10_000).tolist()
    width = len(prompt_ids(tokenizer, None, short, max_length=10_000)) + 3
    assert len(full) > width
    assert prompt_ids(tokenizer, None, long, max_length=width).tolist() == full[-width:]  # the generation prompt stays


@pytest.mark.parametrize("proposer, temperature", [(None, 0.0), ("ngram", 0.0), ("ngram", 0.8)])
def test_self_distilled_replies_are_the_targets_own_at_any_batch_size(tiny, tmp_path, proposer, temperature):
    """Greedy replies are the target's greedy replies (HF generate alone); sampled ones come from each
    conversation's own seed, so the batch size (which conversations share a pass) changes nothing."""
    from runtime.proposers import ProposerSpec
    from runtime.target.model import load_target
    from training.selfdistill import DistillSettings, prompt_ids, self_distill

    target_dir, data = tiny
    conf = compose_config(["target=hf", f"target.name={target_dir}", "data=json", f"data.path={data}",
                           "data.max_samples=4", "data.val_samples=1"])
    spec = ProposerSpec(proposer) if proposer else None
    outputs = []
    for batch_size in (1, 3):
        out = tmp_path / f"sd{batch_size}.jsonl"
        self_distill(conf, out, DistillSettings(max_new_tokens=12, batch_size=batch_size, proposer=spec,
                                                temperature=temperature, seed=7))
        outputs.append(out.read_text())
    assert outputs[0] == outputs[1]
    if temperature:
        return
    target = load_target(str(target_dir))
    tokenizer = target.tokenizer
    for line in outputs[0].splitlines():
        messages = json.loads(line)["messages"]
        ids = prompt_ids(tokenizer, None, messages[:-1], conf.data.max_length)
        generated = target.model.generate(ids[None], max_new_tokens=12, do_sample=False,
                                          eos_token_id=sorted(target.eos_token_ids),
                                          pad_token_id=sorted(target.eos_token_ids)[0])
        reply = tokenizer.decode(generated[0, ids.numel():], skip_special_tokens=True).strip()
        assert messages[-1] == {"role": "assistant", "content": reply}


def test_init_from_continues_a_trained_head(tiny, tmp_path):
    first = run_config(tiny, tmp_path / "first", "eagle3", 8, ["trainer.lr=3e-3"])
    again = run_config(tiny, tmp_path / "again", "eagle3", 1, [f"init_from={tmp_path / 'first' / 'head'}",
                                                               "eval.at_start=true"])
    start = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert first["final_eval"]["acc"] == pytest.approx(
        [float(x) for x in (tmp_path / "again" / "curves.csv").read_text().splitlines()[1].split(",")[3:-2]],
        abs=1e-4), "the continued run did not start from the saved head"
    assert start["steps"] == 1 and again["final_eval"]["step"] == 1
    # shipped, the continued head says how its start was made, though that start is a run's head/, not a shipped one
    subprocess.run([sys.executable, str(ROOT / "scripts" / "ship_head.py"), str(tmp_path / "again"), "tiny-eagle3",
                    "--into", str(tmp_path / "shipped")], check=True, env=_env(), cwd=ROOT)
    training = json.loads((tmp_path / "shipped" / "tiny-eagle3" / "config.json").read_text())["training"]
    assert training["final_eval"] == again["final_eval"]
    assert training["continued_from"]["final_eval"] == first["final_eval"]
    assert training["continued_from"]["tokens_per_s_median"] == first["tokens_per_s_median"]
    assert "continued_from" not in training["continued_from"]  # the first run started from scratch
    with pytest.raises(ValueError, match="init_from=.* holds a eagle3 head"):
        run_config(tiny, tmp_path / "wrong", "eagle", 1, [f"init_from={tmp_path / 'first' / 'head'}"])


def test_stop_after_keeps_the_schedule_and_a_killed_run_finishes_with_an_evaluation(tiny, tmp_path):
    extra = ["trainer.lr=3e-3", "checkpoint.every=2", "eval.at_start=false"]
    whole = run_config(tiny, tmp_path / "whole", "eagle", 8, extra + ["trainer.stop_after=4"])
    assert whole["steps"] == 4 and whole["final_eval"]["step"] == 4
    # Two time-boxed parts of the same 8-step schedule end with the same weights as one part.
    run_config(tiny, tmp_path / "parts", "eagle", 8, extra + ["trainer.stop_after=2"])
    parts = run_config(tiny, tmp_path / "parts", "eagle", 8, extra + ["trainer.stop_after=4", "resume=true"])
    assert parts["final_eval"]["step"] == 4
    expected = head_weights(tmp_path / "whole")
    for name, tensor in head_weights(tmp_path / "parts").items():
        torch.testing.assert_close(tensor, expected[name], atol=0, rtol=0, msg=name)
    # A run killed right after its step-2 checkpoint (before any evaluation), finished with stop_after=2: the final
    # weights are evaluated and written as the head.
    checkpoints = tmp_path / "whole" / "checkpoints"
    (checkpoints / "latest.json").write_text(json.dumps({"tag": "step-00000002", "step": 2}))
    finished = run_config(tiny, tmp_path / "whole", "eagle", 8, extra + ["trainer.stop_after=2", "resume=true"])
    assert finished["final_eval"]["step"] == 2
    assert json.loads((tmp_path / "whole" / "head" / "config.json").read_text())["training"]["step"] == 2
    with pytest.raises(ValueError, match="stop_after"):
        run_config(tiny, tmp_path / "bad", "eagle", 4, ["trainer.stop_after=5"])


def test_features_recorded_while_self_distilling_train_a_head(tiny, tmp_path):
    """Self-distillation records each reply's sample (prompt + reply ids as generated) with the target's features
    from the passes that generated it; they equal a fresh target forward; a resumed run adds no sample twice; a
    training run reads them as its data and features (no target pass); other settings are refused."""
    from runtime.proposers import ProposerSpec
    from runtime.target.model import load_target
    from training.features import target_features
    from training.recorded import RecordedStore
    from training.selfdistill import DistillSettings, prompt_ids, self_distill

    target_dir, data = tiny
    overrides = tiny_overrides(target_dir, data, tmp_path / "unused", "eagle3", extra=["data.max_samples=6",
                                                                                        "data.val_samples=2"])
    conf = compose_config(overrides)
    out, store_dir = tmp_path / "sd.jsonl", tmp_path / "store"
    settings = DistillSettings(max_new_tokens=16, batch_size=3, chunk=4, proposer=ProposerSpec("ngram"),
                               features_dir=str(store_dir))
    self_distill(conf, out, settings)
    records = {json.loads(line)["id"]: json.loads(line)["messages"] for line in out.read_text().splitlines()}
    store = RecordedStore(store_dir, max_length=10_000)
    assert store.keys == [f"c{i}.t0" for i in range(8)] and sorted(records) == list(range(8))
    assert store.description["feature_layers"] == [0, 1, 1]
    target = load_target(str(target_dir))
    tokenizer = target.tokenizer
    cut = 0
    for conversation, messages in records.items():
        key = f"c{conversation}.t0"
        sample = store.tokens(key)
        ids = torch.tensor(sample["input_ids"])
        prompt = prompt_ids(tokenizer, None, messages[:-1], conf.data.max_length)
        assert ids[:prompt.numel()].tolist() == prompt.tolist() and not any(sample["assistant_mask"][:prompt.numel()])
        assert all(sample["assistant_mask"][prompt.numel():])
        reply = tokenizer.decode(ids[prompt.numel():], skip_special_tokens=True).strip()
        assert messages[-1]["content"].startswith(reply) and len(reply) > 0
        expected = target_features(target, ids[None], [0, 1, 1])
        for name, value in store.features(key).items():
            # every row but a last token's that came as a bonus (no pass ran on it; the token itself is kept)
            assert value.shape[0] in (ids.numel(), ids.numel() - 1)
            torch.testing.assert_close(value.float(), expected[name][0, :value.shape[0]], atol=2e-2, rtol=2e-2)
        cut += store.features(key)["hidden"].shape[0] < ids.numel()
    assert cut  # some replies end in a bonus token, which their sample keeps
    shards = sorted(p.name for p in store_dir.glob("shard-*"))
    assert shards == ["shard-0000000.safetensors", "shard-0000004.safetensors"]
    # killed after the second chunk's shard, before its replies reached the JSONL: it is generated again and its
    # shard rewritten, not added
    out.write_text("".join(line + "\n" for line in out.read_text().splitlines()[:4]))
    self_distill(conf, out, settings)
    assert RecordedStore(store_dir, max_length=10_000).keys == store.keys
    assert sorted(p.name for p in store_dir.glob("shard-*")) == shards
    with pytest.raises(ValueError, match="max_new_tokens"):  # what the features are of must not change mid-store
        self_distill(conf, tmp_path / "other.jsonl", dataclasses.replace(settings, max_new_tokens=8))

    summary = run_config(tiny, tmp_path / "run", "eagle3", 4, ["features.mode=recorded",
                                                               f"features.dir={store_dir}", "data.val_samples=2",
                                                               "eval.at_start=false", "trainer.lr=3e-3"])
    assert summary["features"] == "recorded" and summary["final_eval"]["step"] == 4
    # a grown store's new part: only conversations 3.. train and are held out
    splits, keys = store.splits(2, None, 0, 2, first_conversation=3)
    assert keys and all(int(key[1:].split(".")[0]) >= 3 for key in keys)
    assert len(splits["train"]) + len(splits["validation"]) <= 5
    with pytest.raises(ValueError, match="features.first_conversation"):
        store.splits(2, None, 0, 2, first_conversation=6)
    medusa = run_config(tiny, tmp_path / "medusa", "medusa", 2, ["features.mode=recorded",
                                                                 f"features.dir={store_dir}", "data.val_samples=2"])
    assert medusa["steps"] == 2  # a store recorded for EAGLE-3 holds the last hidden state every head reads
    with pytest.raises(ValueError, match="feature_layers"):
        run_config(tiny, tmp_path / "layers", "eagle3", 1, ["features.mode=recorded", f"features.dir={store_dir}",
                                                            "data.val_samples=2", "head.feature_layers=[1,1,1]"])
    with pytest.raises(FileNotFoundError, match="not a recorded store"):
        run_config(tiny, tmp_path / "none", "eagle3", 1, ["features.mode=recorded",
                                                          f"features.dir={tmp_path / 'nothing'}"])


def test_hard_targets_and_eagle3_feature_noise_reach_training(tiny, tmp_path):
    """The levers head.targets=hard and (EAGLE-3) head.noise_std reach the objective (their losses are tested by
    hand in test_training_algorithms.py); the noise changes what four steps learn; a bad value is a configuration
    error."""
    from training.objectives import build_objective

    common = ["eval.at_start=false", "trainer.lr=3e-3"]
    run_config(tiny, tmp_path / "plain", "eagle3", 4, common)
    run_config(tiny, tmp_path / "noise", "eagle3", 4, common + ["head.noise_std=0.5"])
    plain, noisy = head_weights(tmp_path / "plain"), head_weights(tmp_path / "noise")
    assert any(not torch.equal(plain[k], noisy[k]) for k in plain)
    target, data = tiny
    conf = compose_config(tiny_overrides(target, data, tmp_path / "hard", "medusa", extra=["head.targets=hard"]))
    head = torch.nn.Module()
    head.head_type = "medusa"
    assert build_objective(head, conf.head, torch.zeros(2, 2), None).hard
    with pytest.raises(ValueError, match="head.targets='greedy'"):
        run_config(tiny, tmp_path / "bad", "eagle3", 1, ["head.targets=greedy"])
