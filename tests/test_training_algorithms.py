"""Pure tensor algorithms of training on hand-built cases: chain masks, shifts, draft vocabulary, losses, metrics;
and the two exactness properties built on them (EAGLE-3 training-time test = sequential drafting; greedy branches =
greedy decoding)."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from heads.eagle3 import Eagle3Config, Eagle3Head
from training.draft_vocab import build_draft_vocab, count_tokens, draft_to_target_ids, target_to_draft_ids
from training.losses import (decay_weights, feature_regression_loss, hard_cross_entropy, soft_cross_entropy,
                             sparse_soft_cross_entropy)
from training.masks import ChainCache, chain_attention_mask, next_token_mask, reply_ends, run_lengths, shift_left
from training.metrics import acceptance_counts, acceptance_rates, decoding_tau, decoding_walk


def test_chain_mask_by_hand():
    T, F_ = True, False
    step0 = chain_attention_mask(3, 0)[0, 0]
    assert step0.tolist() == [[T, F_, F_], [T, T, F_], [T, T, T]]
    step2 = chain_attention_mask(3, 2)[0, 0]
    assert step2.shape == (3, 9)
    assert step2.tolist() == [
        [T, F_, F_, T, F_, F_, T, F_, F_],
        [T, T, F_, F_, T, F_, F_, T, F_],
        [T, T, T, F_, F_, T, F_, F_, T],
    ]


def test_shift_and_next_token_mask():
    values = torch.tensor([[1, 2, 3, 4]])
    assert shift_left(values, 1, 0).tolist() == [[2, 3, 4, 0]]
    assert shift_left(values, 3, -1).tolist() == [[4, -1, -1, -1]]
    assert shift_left(values, 5, 9).tolist() == [[9, 9, 9, 9]]
    assistant = torch.tensor([[0, 0, 1, 1]], dtype=torch.bool)
    assert next_token_mask(assistant).tolist() == [[False, True, True, False]]


def test_draft_vocab_by_hand():
    counts = torch.tensor([5, 0, 3, 3, 1, 0])
    d2t, t2d = build_draft_vocab(counts, 3)
    assert t2d.tolist() == [True, False, True, True, False, False]
    assert draft_to_target_ids(d2t).tolist() == [0, 2, 3]
    assert d2t.tolist() == [0, 1, 1]  # target = draft + offset
    assert target_to_draft_ids(d2t, 6).tolist() == [0, -1, 1, 2, -1, -1]
    d2t, t2d = build_draft_vocab(counts, 5)  # ties and unseen tokens: lowest ids first
    assert draft_to_target_ids(d2t).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="draft vocabulary size"):
        build_draft_vocab(counts, 7)
    counts = count_tokens([[1, 2, 2, 5]], [[False, True, True, True]], 6)
    assert counts.tolist() == [0, 0, 2, 0, 0, 1]


def test_losses_by_hand():
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    one_hot = torch.log(torch.tensor([[1e-30, 1.0, 1e-30]]))
    assert torch.allclose(soft_cross_entropy(logits, one_hot), F.cross_entropy(logits, torch.tensor([1])))
    target = torch.log_softmax(torch.tensor([[0.5, 1.0, -2.0]]), -1)
    top_values, top_ids = target.topk(3)
    assert torch.allclose(sparse_soft_cross_entropy(logits, top_values, top_ids), soft_cross_entropy(logits, target))
    # an id outside the draft vocabulary (-inf) drops out and the rest renormalises
    masked = sparse_soft_cross_entropy(logits, torch.tensor([[0.0, float("-inf")]]), torch.tensor([[0, -1]]))
    assert torch.allclose(masked, -F.log_softmax(logits, -1)[:, 0])
    # a row whose every top-k id is outside the draft vocabulary counts 0, and its gradient too (not NaN)
    both = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]], requires_grad=True)
    loss = sparse_soft_cross_entropy(both, torch.tensor([[0.0, float("-inf")], [float("-inf"), float("-inf")]]),
                                     torch.tensor([[0, -1], [-1, -1]]))
    assert loss[1] == 0 and torch.allclose(loss[0], masked[0])
    loss.sum().backward()
    assert torch.isfinite(both.grad).all() and not both.grad[1].any()
    assert feature_regression_loss(torch.tensor([[0.0, 3.0]]), torch.tensor([[0.5, 0.0]])).item() == \
        pytest.approx((0.5 * 0.25 + 2.5) / 2)
    assert decay_weights(3, 0.8) == pytest.approx([1.0, 0.8, 0.64])
    # hard targets: the greedy token's CE; a token outside the draft vocabulary (-1) contributes nothing
    two = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    torch.testing.assert_close(hard_cross_entropy(two, torch.tensor([2, -1])),
                               torch.stack([F.cross_entropy(two[:1], torch.tensor([2])), torch.tensor(0.0)]))


def test_acceptance_metrics_by_hand():
    matches = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    reached, accepted = acceptance_counts(matches)
    assert reached.tolist() == [4, 3, 2, 1]
    assert accepted.tolist() == [2, 1, 0, 3]
    acc, tau = acceptance_rates(reached)
    assert acc == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert tau == pytest.approx(1 + 6 / 4)


def test_decoding_tau_walks_each_reply_from_its_start():
    """Position n predicts reply token n; the prefill emits token 0. The first pass drafts at position 0, where two
    drafts are accepted: it emits tokens 1-3 and drafts next at 3 (positions 1 and 2 are skipped), where it emits
    token 4, the reply's last (its end of turn), and decoding stops: 4 tokens in 2 passes, where the average over
    every position gives 1 + 5 / 5. A reply boundary restarts the walk."""
    accepted = torch.tensor([2, 0, 1, 2, 0])
    assert decoding_walk(accepted, [5]) == (4, 2) and decoding_tau(accepted, [5]) == pytest.approx(2.0)
    assert acceptance_rates(torch.tensor([5, 3, 2]))[1] == pytest.approx(2.0)  # the same positions, every one
    assert decoding_walk(accepted, [2, 3]) == (3, 2)  # (0) | (0) -> 2, the end
    assert decoding_walk(torch.tensor([3, 0, 0]), [3]) == (2, 1)  # drafts past the end of turn emit nothing
    assert decoding_walk(torch.zeros(4, dtype=torch.long), [1, 3]) == (2, 2)  # a one-token reply: the prefill's
    assert decoding_tau(torch.zeros(1, dtype=torch.long), [1]) == 1.0  # no pass at all: as plain decoding
    # a template's newline after the end of turn is in the reply mask, but decoding stops at the end of turn
    run = torch.tensor([1, 0, 0, 0])  # positions predicting c1, <end>, "\n" and past it
    assert decoding_walk(run, [4]) == (3, 2) and decoding_walk(run, [4], reached=[3]) == (2, 1)
    with pytest.raises(ValueError, match="sum"):
        decoding_tau(accepted, [4])


def test_reply_ends_stop_each_run_at_its_first_end_of_turn():
    """Position j of a run at column c predicts the token at c + j + 1: a run is reached up to the position that
    predicts the end of turn (9 here), the whole run where none comes (a reply cut short)."""
    ids = torch.tensor([[1, 5, 6, 9, 4, 1, 7, 9, 4], [1, 5, 6, 7, 8, 0, 0, 0, 0]])
    predict = torch.tensor([[1, 1, 1, 1, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert run_lengths(predict) == [4, 3, 4]
    assert reply_ends(ids, predict, {9}) == [3, 2, 4]  # 5 6 9 (then 4) | 7 9 (then 4) | no end: all of 5 6 7 8
    assert reply_ends(ids, predict, {9, 5}) == [1, 2, 1]  # the first end of turn counts


def test_run_lengths_are_the_runs_nonzero_lists_in_order():
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 1, 0, 0]], dtype=torch.bool)
    assert run_lengths(mask) == [2, 1, 5, 1, 1]
    rows, cols = mask.nonzero(as_tuple=True)
    starts = torch.tensor([0, 2, 3, 8, 9])  # each run's first entry in nonzero's order: one row, consecutive columns
    for start, length in zip(starts.tolist(), run_lengths(mask)):
        assert len(set(rows[start:start + length].tolist())) == 1
        assert cols[start:start + length].tolist() == list(range(int(cols[start]), int(cols[start]) + length))


def tiny_llama(layers=4, vocab=48, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return LlamaForCausalLM(config).eval()


def test_training_time_test_equals_sequential_drafting():
    """Step k of the batched chain (one forward per step, chain mask) gives, for every row t, exactly what a
    drafter computes when it runs the chain from context t alone with a real cache."""
    model = tiny_llama()
    head = Eagle3Head(Eagle3Config(feature_layers=[1, 2, 3]), model.config).eval()
    head.attach_target_weights(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    torch.manual_seed(1)
    length, steps = 6, 3
    ids = torch.randint(0, 48, (1, length))
    chain_tokens = torch.randint(0, 48, (1, length, steps))  # token fed at step k>0 of row t
    features = torch.randn(1, length, 96)
    with torch.no_grad():
        cache, hidden, batched = ChainCache(), features, []
        for step in range(steps):
            tokens = ids if step == 0 else chain_tokens[..., step - 1]
            positions = (torch.arange(length) + step)[None]
            hidden = head.hidden_states(tokens, hidden, positions, chain_attention_mask(length, step), cache)
            batched.append(hidden)
        for row in range(length):
            cache = ChainCache()
            hidden = head.hidden_states(ids[:, : row + 1], features[:, : row + 1], torch.arange(row + 1)[None],
                                        None, cache)
            torch.testing.assert_close(hidden[:, row], batched[0][:, row], atol=1e-5, rtol=1e-5)
            last = hidden[:, row: row + 1]
            for step in range(1, steps):
                mask = torch.ones(1, 1, 1, row + 1 + step, dtype=torch.bool)
                last = head.hidden_states(chain_tokens[:, row: row + 1, step - 1], last,
                                          torch.tensor([[row + step]]), mask, cache)
                torch.testing.assert_close(last[:, 0], batched[step][:, row], atol=1e-5, rtol=1e-5)


def test_greedy_branches_equal_greedy_decoding():
    from runtime.target.model import target_from_model
    from training.evaluate import greedy_branches

    model = tiny_llama(layers=2, seed=3)
    target = target_from_model(model)
    ids = torch.randint(0, 48, (2, 7))
    branches = greedy_branches(target, ids, 4)
    for row in range(2):
        for t in (0, 3, 6):
            sequence = ids[row: row + 1, : t + 1]
            expected = []
            for _ in range(4):
                with torch.no_grad():
                    token = model(input_ids=sequence).logits[0, -1].argmax()
                expected.append(int(token))
                sequence = torch.cat((sequence, token.view(1, 1)), dim=1)
            assert branches[row, t].tolist() == expected


def test_target_distribution_table_equals_direct_computation():
    from training.objectives import TargetDistribution

    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 8)
    weight = torch.randn(12, 8)
    positions = torch.tensor([[0, 1, 1, 0, 1], [1, 0, 0, 1, 0]], dtype=torch.bool)
    draft_ids = torch.tensor([1, 4, 5, 9])
    target = TargetDistribution({"hidden": hidden}, positions, weight, None, draft_ids=draft_ids)
    rows, cols = torch.tensor([0, 1, 0]), torch.tensor([4, 3, 1])
    direct = hidden[rows, cols] @ weight.T
    assert torch.equal(target.greedy(rows, cols), direct.argmax(-1))
    draft_logits = torch.randn(3, 4)
    expected = soft_cross_entropy(draft_logits, torch.log_softmax(direct[:, draft_ids], -1))
    torch.testing.assert_close(target.cross_entropy(draft_logits, rows, cols), expected)
    with pytest.raises(IndexError, match="outside the positions"):
        target.greedy(torch.tensor([0]), torch.tensor([0]))
    # hard: the CE of the target's greedy token, mapped into the draft vocabulary (outside it: nothing)
    hard = TargetDistribution({"hidden": hidden}, positions, weight, None, draft_ids=draft_ids, hard=True)
    to_draft = torch.full((12,), -1)
    to_draft[draft_ids] = torch.arange(4)
    greedy = to_draft[direct.argmax(-1)]
    log_q = torch.log_softmax(draft_logits, -1).gather(-1, greedy.clamp_min(0)[:, None])[:, 0]
    expected = torch.where(greedy >= 0, -log_q, torch.zeros(3))
    torch.testing.assert_close(hard.cross_entropy(draft_logits, rows, cols, to_draft), expected)


@pytest.mark.parametrize("head_type", ["eagle", "eagle3", "medusa"])
def test_evaluation_calls_the_head_only_inside_the_objectives_forward(head_type):
    """ZeRO-3 partitions the head's parameters and gathers them for the module calls it sees inside the engine
    module's forward: an evaluation must call every head module from there, as training does."""
    from runtime.target.model import target_from_model
    from training.config import EvalConf
    from training.evaluate import evaluate_acceptance, prepare_batch
    from training.objectives import Eagle3HeadConf, EagleHeadConf, MedusaHeadConf, build_objective
    from training.recipe import training_head

    target = target_from_model(tiny_llama(layers=2, seed=3))
    head_conf = {"eagle": EagleHeadConf(), "eagle3": Eagle3HeadConf(feature_layers=[0, 1, 1], draft_vocab_size=0,
                                                                     ttt_steps=2),
                 "medusa": MedusaHeadConf(num_heads=2)}[head_type]
    head = training_head(head_conf, target, None)
    objective = build_objective(head, head_conf, target.lm_head.weight, target.softcap)
    torch.manual_seed(0)
    ids = torch.randint(0, 48, (2, 10))
    mask = torch.arange(10)[None].expand(2, -1) >= 4
    batch = prepare_batch(target, {"input_ids": ids, "assistant_mask": mask}, head_conf, EvalConf(depth=2),
                          head.feature_layers)
    inside, outside = [], []

    def leave(module, args, output):  # returns None: the output stays the forward's
        inside.pop()

    objective.register_forward_pre_hook(lambda module, args: inside.append(module))
    objective.register_forward_hook(leave)
    for name, module in head.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.register_forward_pre_hook(lambda module, args, name=name: None if inside else outside.append(name))
    result = evaluate_acceptance(objective, [batch], 2, 0, 1)
    assert outside == [], f"head modules called outside the objective's forward: {sorted(set(outside))}"
    rows = mask if head_type == "medusa" else mask[:, 1:]  # EAGLE drafts after the next token: one row less
    assert result["reached"][0] == int(rows.sum())


def test_medusa_is_scored_on_the_rows_the_runtime_drafts_from():
    """The runtime drafts from the hidden state before the root (the root: an assistant token), so held-out rows
    are those whose next token is the assistant's: the last prompt position counts, the reply's last does not."""
    from training.objectives import medusa_matches

    class Heads:  # head i answers with the row's position plus 10 i, as a token id
        num_heads = 2

        def head_logits(self, index, selected):
            return F.one_hot(selected[:, 0].long() + 10 * index, 64).float()

    hidden = torch.arange(6, dtype=torch.float)[None, :, None]  # [1, T = 6, 1]: each row holds its position
    assistant = torch.tensor([[0, 0, 1, 1, 1, 0]])  # the reply is positions 2 .. 4
    branches = torch.zeros(1, 6, 3, dtype=torch.long)
    branches[0, :, 1] = torch.arange(6)  # head 0 right everywhere
    branches[0, 3, 2] = 13  # head 1 right at position 3 only
    matches = medusa_matches(Heads(), {"assistant_mask": assistant, "branches": branches}, hidden)
    assert matches.tolist() == [[True, False], [True, False], [True, True]]  # positions 1, 2, 3


def test_norm_scale_is_the_weight_for_llama_norms_and_one_plus_it_for_gemma():
    """An EAGLE-3 head's Llama-style output norm starts as the target's final norm: Gemma's norm scales by
    1 + weight, so copying its weight would start the head far from the target."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from training.objectives import norm_scale

    weight = torch.tensor([0.5, -0.25, 2.0])
    llama, gemma = LlamaRMSNorm(3), GemmaRMSNorm(3)
    with torch.no_grad():
        llama.weight.copy_(weight)
        gemma.weight.copy_(weight)
    torch.testing.assert_close(norm_scale(llama), weight, atol=1e-5, rtol=0)
    torch.testing.assert_close(norm_scale(gemma), 1 + weight, atol=1e-5, rtol=0)


def test_held_out_conversations_never_take_a_trained_one_as_the_store_grows():
    from training.recorded import held_out_conversations

    sizes = (40, 100, 400, 1000)
    chosen = [held_out_conversations(list(range(size)), 8, seed=0) for size in sizes]
    for size, smaller, larger in zip(sizes, chosen, chosen[1:]):
        assert len(larger) == 8
        trained = set(range(size)) - smaller  # what a run on the smaller store trained on ...
        assert not larger & trained  # ... never becomes held out in the grown store
    assert chosen[-1] != chosen[0]  # and it does change: newer conversations can rank lower
    assert held_out_conversations(list(range(1000)), 8, seed=1) != chosen[-1]
    assert held_out_conversations(list(reversed(range(1000))), 8, seed=0) == chosen[-1]


def test_screened_argmax_finds_the_fp32_argmax_where_bf16_rounding_ties_or_flips():
    """The bf16 product cannot order tokens whose logits differ below its rounding; the fp32 recomputation of its
    top candidates can."""
    from training.vocab_argmax import screened_argmax

    torch.manual_seed(0)
    hidden = torch.randn(64, 48) * 8
    weight = torch.randn(3000, 48)
    # rows 1 and 2 of the vocabulary are row 0 nudged below bf16's resolution: bf16 cannot order the three, fp32 can
    weight[1] = weight[0]
    weight[1, 0] += 1e-4 * torch.sign(weight[0, 0])
    weight[2] = weight[0]
    weight[2, 1] += 2e-4 * torch.sign(weight[0, 1])
    hidden[:8] = weight[0] * 3  # these rows' best token is one of the three
    hidden[:8, :2] = weight[0, :2].abs() * torch.sign(weight[0, :2]) * 5
    exact = (hidden @ weight.T).argmax(-1)
    approx = (hidden.bfloat16() @ weight.bfloat16().T).float().argmax(-1)
    assert not torch.equal(approx[:8], exact[:8])  # the case is hard: bf16 alone picks wrong tokens
    found = screened_argmax(hidden, weight, weight.bfloat16())
    assert torch.equal(found, exact)
    assert screened_argmax(hidden[:0], weight, weight.bfloat16()).shape == (0,)


def test_target_distribution_with_the_vocab_screen_equals_the_full_product():
    from training.objectives import TargetDistribution, VocabScreen

    torch.manual_seed(1)
    hidden = torch.randn(3, 40, 32) * 4
    weight = torch.randn(2000, 32)
    positions = torch.rand(3, 40) < 0.7
    draft_ids = torch.randperm(2000)[:300].sort().values
    full = TargetDistribution({"hidden": hidden}, positions, weight, 30.0, draft_ids=draft_ids)
    screened = TargetDistribution({"hidden": hidden}, positions, weight, 30.0, draft_ids=draft_ids,
                                  screen=VocabScreen.of(weight, draft_ids))
    assert torch.equal(screened.greedy_table, full.greedy_table)
    torch.testing.assert_close(screened.logprob_table, full.logprob_table)


@pytest.mark.parametrize("hard", [False, True])
def test_eagle3_loss_is_the_same_with_the_vocab_screen(monkeypatch, hard):
    """Where the bf16 screen pays (CPUs with bf16 matrix instructions) an EAGLE-3 objective with a draft vocabulary
    uses it; its loss and statistics are those of the full fp32 product, on any CPU."""
    import training.objectives.base as objective_base
    from runtime.target.model import target_from_model
    from training.objectives import Eagle3HeadConf, build_objective
    from training.recipe import training_head

    target = target_from_model(tiny_llama(layers=2, seed=5))
    torch.manual_seed(0)
    ids = torch.randint(0, 48, (3, 12))
    mask = torch.arange(12)[None].expand(3, -1) >= 3
    head_conf = Eagle3HeadConf(feature_layers=[0, 1, 1], draft_vocab_size=20, ttt_steps=2,
                               targets="hard" if hard else "soft")
    head = training_head(head_conf, target, {"input_ids": ids, "assistant_mask": mask})
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    batch = {"input_ids": ids, "assistant_mask": mask, "hidden": out.hidden_states[-1],
             "layer_hidden": torch.cat([out.hidden_states[i] for i in (0, 1, 1)], dim=-1)}
    results = {}
    for screened in (False, True):
        monkeypatch.setattr(objective_base, "bf16_screening_pays", lambda device, screened=screened: screened)
        objective = build_objective(head, head_conf, target.lm_head.weight, target.softcap)
        assert (objective._vocab_screen(head.draft_to_target) is not None) == screened
        results[screened] = objective(batch)
    torch.testing.assert_close(results[True][0], results[False][0])
    assert results[True][1]["acc"] == results[False][1]["acc"]


def test_a_recorded_sample_keeps_the_last_token_no_pass_ran_on():
    """A reply whose last token (here the end of the turn) came as a pass's bonus has no feature row of its own,
    but the row before it holds the distribution that predicts it: the sample keeps the token, so that row is a
    training target; the readers pad the missing row, which no loss reads."""
    from training.masks import next_token_mask
    from training.recorded import recorded_sample

    prompt, reply = torch.tensor([5, 6, 7, 8]), [20, 21, 22, 2]
    for rows in (7, 8):  # the last token came as a bonus, or a pass ran on it
        sample = recorded_sample(prompt, reply, {"hidden": torch.randn(rows, 4)}, torch.float32)
        assert sample["input_ids"].tolist() == [5, 6, 7, 8, 20, 21, 22, 2]
        assert sample["hidden"].shape[0] == rows
        predicting = next_token_mask(sample["assistant_mask"][None])[0].nonzero().flatten().tolist()
        assert predicting == [3, 4, 5, 6]  # row 6 predicts the end of the turn


def test_reply_samples_are_the_generated_tokens_with_only_the_reply_scored():
    """The prompt's ids as the decoder was given them, then the reply's as generated: a reply ending in the end of
    turn keeps it, a reply cut by the length limit gets none added; a cut at max_length keeps the start."""
    from training.evaluate import reply_samples

    prompts, replies = [[5, 6, 7], torch.tensor([[8, 9]])], [[20, 21, 2], torch.tensor([30, 31, 32])]
    samples = reply_samples(prompts, replies, max_length=64)
    assert samples[0] == {"input_ids": [5, 6, 7, 20, 21, 2], "assistant_mask": [False] * 3 + [True] * 3}
    assert samples[1] == {"input_ids": [8, 9, 30, 31, 32], "assistant_mask": [False] * 2 + [True] * 3}
    predicting = next_token_mask(torch.tensor(samples[0]["assistant_mask"])[None])[0].nonzero().flatten().tolist()
    assert predicting == [2, 3, 4]  # one row per reply token: the prompt's last predicts the first
    cut = reply_samples(prompts[:1], replies[:1], max_length=4)[0]
    assert cut == {"input_ids": [5, 6, 7, 20], "assistant_mask": [False, False, False, True]}
    with pytest.raises(ValueError, match="one reply for every prompt"):
        reply_samples(prompts[:1], replies, max_length=64)
