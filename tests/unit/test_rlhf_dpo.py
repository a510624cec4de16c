"""Unit tests of DPO's and Online DPO's driver-side parts: preference pairs tokenized into trainer rows, and the
config checks of both (no Ray, vLLM or Megatron starts). The loss math is in test_rlhf_losses.py.

    pytest tests/unit/test_rlhf_dpo.py
"""

import json
from pathlib import Path

import pytest

from chatgen import tasks
from chatgen.config import ConfigError
from chatgen.core.jsonl import read_prompt_records
from chatgen.rlhf import registry
from chatgen.rlhf.algorithms.dpo import pair_batch
from chatgen.rlhf.checks import check_run
from chatgen.rlhf.config import load_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def data(tmp_path):
    tasks.write_task_data(str(tmp_path), n_train=64, n_eval=8)
    return tmp_path


def load(name, data, *overrides):
    prefix = "preference_" if name == "dpo_tiny.yaml" else ""
    return load_config(
        REPO / "configs" / name,
        [
            f"runtime.data_path={data}/{prefix}train.jsonl",
            f"runtime.eval_data_path={data}/{prefix}eval.jsonl",
            *overrides,
        ],
    )


def errors_of(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        check_run(cfg, registry.load(cfg.runtime.algorithm.name))
    return str(e.value)


@pytest.mark.parametrize("name", ["dpo_tiny.yaml", "online_dpo_tiny.yaml"])
def test_shipped_configs_pass(name, data):
    cfg = load(name, data)
    check_run(cfg, registry.load(cfg.runtime.algorithm.name))


def test_pairs_tokenize_into_aligned_rows(tiny_llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    records = [
        {"prompt": "sort: 3 1 2 =", "chosen": " 1 2 3", "rejected": " 3 2 1"},
        {"prompt": "sort: 9 0 =", "chosen": " 0 9", "rejected": " 9 0 0"},
    ]
    batch = pair_batch(tokenizer, records)
    assert len(batch) == 4 and batch.prompt_index.tolist() == [0, 0, 1, 1]
    for row, (record, key) in enumerate((r, k) for r in records for k in ("chosen", "rejected")):
        ids = batch.input_ids[row, : int(batch.attention_mask[row].sum())].tolist()
        prompt = tokenizer.encode(record["prompt"])
        assert ids[0] == tokenizer.bos_token_id and ids[: len(prompt)] == prompt
        # entry t of loss_mask says "train on token t + 1": exactly the response tokens and the final EOS
        trained = [ids[t + 1] for t in batch.loss_mask[row].nonzero().flatten().tolist()]
        assert trained == ids[len(prompt) :] and trained[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(trained[:-1]).strip() == record[key].strip()


def test_pair_rules(data):
    msg = errors_of(
        load(
            "dpo_tiny.yaml",
            data,
            "runtime.train_micro_batch_size=3",
            "runtime.train_global_batch_size=6",
            "runtime.sample_per_episode=12",
        )
    )
    assert (
        "runtime.train_micro_batch_size: 3 would split a (chosen, rejected) pair across micro-batches"
        in msg
    )
    msg = errors_of(
        load(
            "online_dpo_tiny.yaml",
            data,
            "runtime.train_micro_batch_size=3",
            "runtime.train_global_batch_size=6",
            "runtime.sample_per_episode=24",
        )
    )
    assert "train_micro_batch_size: 3 would split" in msg


def test_online_dpo_batches_count_trainer_rows(data):
    # 256 samples / n=8 = 32 prompts -> 64 trainer rows per episode: a global batch of 128 does not fit
    msg = errors_of(load("online_dpo_tiny.yaml", data, "runtime.train_global_batch_size=128"))
    assert (
        "runtime.sample_per_episode: 256 gives 64 trainer rows per episode (online_dpo), which is not a multiple "
        "of runtime.train_global_batch_size=128"
    ) in msg
    msg = errors_of(
        load(
            "online_dpo_tiny.yaml",
            data,
            "policy.n=1",
            "runtime.sample_per_episode=32",
            "runtime.train_global_batch_size=32",
            "runtime.train_micro_batch_size=32",
        )
    )
    assert (
        "models.policy.n: Online DPO pairs the best and worst of a prompt's n responses; set n >= 2"
        in msg
    )
    # n=3: 48 samples -> 16 prompts -> 32 rows, one global batch of 32 (which 48 samples would not be whole of)
    check_run(
        load(
            "online_dpo_tiny.yaml",
            data,
            "policy.n=3",
            "runtime.sample_per_episode=48",
            "runtime.train_global_batch_size=32",
            "runtime.train_micro_batch_size=32",
        ),
        registry.load("online_dpo"),
    )


def test_dpo_data_must_be_preference_records(data):
    msg = errors_of(load("dpo_tiny.yaml", data, f"runtime.data_path={data}/train.jsonl"))
    assert (
        f"runtime.data_path: {data}/train.jsonl:1: needs string fields 'chosen', 'rejected'; a DPO record is "
        '{"prompt": ..., "chosen": ..., "rejected": ...}'
    ) in msg
    assert "eval_data_path" not in msg  # the preference eval file is fine
    msg = errors_of(load("dpo_tiny.yaml", data, "policy_trainer.load=null", "reference.load=null"))
    assert (
        "runtime.algorithm.tokenizer: the pairs need a tokenizer and policy_trainer has no `load`"
        in msg
    )
    check_run(
        load(
            "dpo_tiny.yaml",
            data,
            "policy_trainer.load=null",
            "runtime.algorithm.tokenizer=somewhere",
        ),
        registry.load("dpo"),
    )
    assert "beta: must be > 0" in str(
        pytest.raises(ConfigError, load, "dpo_tiny.yaml", data, "runtime.algorithm.beta=0").value
    )


def test_sort_digits_preferences(data):
    for split in ("train", "eval"):
        records = read_prompt_records(data / f"{split}.jsonl")
        pairs = [
            json.loads(line)
            for line in (data / f"preference_{split}.jsonl").read_text().splitlines()
        ]
        by_prompt = {r["prompt"]: r["answer"] for r in records}
        # all-equal digits left out
        assert len(pairs) == sum(len(set(r["answer"].split())) > 1 for r in records)
        for p in pairs:
            assert p["chosen"] == by_prompt[p["prompt"]]  # the right answer
            wrong = p["rejected"].split()
            # same digits, wrong order
            assert sorted(wrong) == p["chosen"].split() and wrong != p["chosen"].split()
    train = {
        json.loads(line)["prompt"]
        for line in (data / "preference_train.jsonl").read_text().splitlines()
    }
    held_out = {
        json.loads(line)["prompt"]
        for line in (data / "preference_eval.jsonl").read_text().splitlines()
    }
    assert not train & held_out
    kinds = {
        "descending"
        if p["rejected"].split() == sorted(p["rejected"].split(), reverse=True)
        else "near miss"
        for p in tasks.sort_digits.preferences(tasks.sort_digits.records(200, seed=3), seed=0)
    }
    assert kinds == {"descending", "near miss"}
