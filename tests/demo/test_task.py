"""The embedded demo's arithmetic task: determinism, disjoint splits, verifiable targets, dataset compatibility."""

import json

import pytest

from megatron_pacs.demo import task as demo_task
from megatron_pacs.rewards.math_verify import math_verify_reward


def test_problems_are_deterministic_per_seed_and_distinct():
    a = demo_task.make_problems(50, seed=3, split="train")
    assert a == demo_task.make_problems(50, seed=3, split="train")
    assert a != demo_task.make_problems(50, seed=4, split="train")
    assert len({r["id"] for r in a}) == len({r["problem"] for r in a}) == 50
    assert set(a[0]) == {"id", "problem", "answer", "source"}
    ops = {r["problem"].split()[3] for r in a}
    assert ops == {op for _, op, _, _ in demo_task.OPERATIONS.values()}


def test_train_and_val_splits_are_disjoint():
    train = {r["problem"] for seed in range(3) for r in demo_task.make_problems(400, seed=seed, split="train")}
    val = {r["problem"] for seed in range(3) for r in demo_task.make_problems(100, seed=seed, split="val")}
    assert train and val and not train & val
    assert all(demo_task.problem_split(p) == "val" for p in val)


def test_sft_response_verifies_and_near_misses_do_not():
    rows = demo_task.make_problems(40, seed=0, split="val")
    for row in rows:
        response = demo_task.sft_response(row)
        assert response.endswith(f"The answer is \\boxed{{{row['answer']}}}.")
        assert math_verify_reward(response, row["answer"]) == 1.0
        assert int(row["answer"]) >= 0
    noisy = demo_task.sft_rows(rows, correct_prob=0.0, seed=1)
    assert all(math_verify_reward(r["response"], r["answer"]) == 0.0 for r in noisy)
    clean = demo_task.sft_rows(rows, correct_prob=1.0, seed=1)
    assert [r["response"] for r in clean] == [demo_task.sft_response(r) for r in rows]


def test_noisy_targets_follow_correct_prob():
    rows = demo_task.make_problems(600, seed=0, split="train")
    noisy = demo_task.sft_rows(rows, correct_prob=0.5, seed=0)
    correct = sum(r["response"] == demo_task.sft_response(r) for r in noisy) / len(noisy)
    assert 0.44 < correct < 0.56
    with pytest.raises(ValueError, match=r"correct_prob=1\.5"):
        demo_task.sft_rows(rows, correct_prob=1.5, seed=0)


def test_rows_read_back_as_prompt_rows(tmp_path):
    from megatron_pacs.data.formats import read_prompt_rows
    from megatron_pacs.data.prompts import INSTRUCTION

    rows = demo_task.make_problems(20, seed=0, split="train")
    path = tmp_path / "demo_train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    read, skipped = read_prompt_rows(path)
    assert skipped == 0 and [r.id for r in read] == [r["id"] for r in rows]
    assert read[0].ground_truth == rows[0]["answer"]
    assert read[0].prompt[0]["content"] == f"{rows[0]['problem']} {INSTRUCTION}"


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="split='test'"):
        demo_task.make_problems(1, seed=0, split="test")
    with pytest.raises(ValueError, match="lower n"):
        demo_task.make_problems(10**6, seed=0, split="val")
    with pytest.raises(ValueError, match="not a demo problem"):
        demo_task.sft_response({"problem": "What is love?"})


def test_tokenizer_corpus_trains_a_digit_level_tokenizer():
    from megatron_pacs.data.prompts import INSTRUCTION
    from megatron_pacs.demo.tiny import build_tokenizer

    corpus = demo_task.tokenizer_corpus(num_lines=600)
    assert INSTRUCTION in corpus
    tok = build_tokenizer(512, corpus=corpus, split_digits=True)
    text = demo_task.sft_response({"problem": "What is 64 + 6?"})
    pieces = tok.tokenize(text)
    assert "70" not in "".join(p for p in pieces if p.isdigit() and len(p) > 1)  # digits stay single tokens
    assert tok.decode(tok(text)["input_ids"]) == text
    assert len(tok(text)["input_ids"]) < 32
