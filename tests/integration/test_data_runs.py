"""Bring your own data: a GRPO run (hf or vllm policy, Megatron trainer, one process) on parquet
training data and an arrow held-out set with their own column names, evaluated with eval_n samples
(pass@k, mean@k) plus greedy, tracked in MLflow; and chat records rendered with the real
tokenizer's chat template.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/integration/test_data_runs.py
"""

import json
from pathlib import Path

import datasets
import pytest
import torch

from chatgen.rlhf.rewards import RuleReward

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


class ColumnReward(RuleReward):
    """Rewards a response of even length (a coin the tiny model flips, so that pass@k grows with
    k); fails the run unless every column of the data rows reached it."""

    def score(self, data: dict) -> torch.Tensor:
        if data["difficulty"] != [f"level-{int(answer) % 3}" for answer in data["answer"]]:
            raise AssertionError(f"the rows' columns did not reach the reward: {sorted(data)}")
        return torch.tensor([float(len(text) % 2 == 0) for text in data["texts"]])


def rows(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    digits = torch.randint(0, 10, (n, 4), generator=g).tolist()
    return [
        {
            "question": "sort: " + " ".join(map(str, d)) + " =",
            "solution": int("".join(map(str, sorted(d)))),
            "difficulty": f"level-{int(''.join(map(str, sorted(d)))) % 3}",
        }
        for d in digits
    ]


@pytest.mark.parametrize(
    "config", ["grpo_tiny_hf.yaml", "grpo_tiny.yaml"]
)  # the hf and the vllm policy
def test_grpo_on_parquet_and_arrow_with_pass_at_k_greedy_and_mlflow(
    tiny_llama_dir, tmp_path, monkeypatch, config
):
    from mlflow.tracking import MlflowClient

    from chatgen.rlhf.algorithms import grpo
    from chatgen.rlhf.config import load_config

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    datasets.Dataset.from_list(rows(32, 0)).to_parquet(str(tmp_path / "train.parquet"))
    datasets.Dataset.from_list(rows(6, 1)).save_to_disk(str(tmp_path / "held_out"))
    overrides = {
        "runtime.data_path": tmp_path / "train.parquet",
        "runtime.eval_data_path": tmp_path / "held_out",
        "runtime.prompt_key": "question",
        "runtime.answer_key": "solution",
        "runtime.loggers": "[jsonl,mlflow]",
        "runtime.eval_greedy": "true",
        "runtime.output_dir": out,
        "runtime.num_episode": 1,
        "runtime.sample_per_episode": 16,
        "runtime.train_micro_batch_size": 16,
        "runtime.train_global_batch_size": 16,
        "runtime.eval_episode_interval": 1,
        "runtime.save_episode_interval": "null",
        "models.reward.model_class": "test_data_runs:ColumnReward",
        "policy.load": tiny_llama_dir,
        "policy.n": 4,
        "policy.eval_n": 4,
        "policy.eval_temperature": 1.0,
        "policy_trainer.load": tiny_llama_dir,
    }
    cfg = load_config(REPO / "configs" / config, [f"{k}={v}" for k, v in overrides.items()])
    grpo.train(cfg, log=lambda *_: None)
    metrics = {
        r["episode"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    }
    assert sorted(metrics) == [0, 1]
    for m in metrics.values():
        # the estimator at k=1 is the solved share
        assert m["eval/pass@1"] == pytest.approx(m["eval/solved"])
        assert m["eval/pass@1"] <= m["eval/pass@2"] <= m["eval/pass@4"] <= 1
        assert m["eval/mean@4"] == pytest.approx(m["eval/reward"])
        # one greedy response per prompt: no @k
        assert {"eval/greedy/reward", "eval/greedy/solved"} < set(m)
        assert not [k for k in m if k.startswith("eval/greedy/") and "@" in k]
    assert 0 < metrics[1]["eval/pass@4"]  # 24 coin flips: not all tails
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    logged = {m.step: m.value for m in client.get_metric_history(run_id, "eval/pass_at_4")}
    assert logged == pytest.approx({e: m["eval/pass@4"] for e, m in metrics.items()})
    assert client.get_run(run_id).data.params["runtime.prompt_key"] == "question"


def test_chat_records_render_with_the_tokenizers_chat_template(chat_model_dir, tiny_llama_dir):
    from transformers import AutoTokenizer

    from chatgen.generation.hf.module import HFGeneration

    chat = [{"role": "system", "content": "Sort the digits."}, {"role": "user", "content": "3 1 2"}]
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    module = HFGeneration(
        {
            "load": str(chat_model_dir),
            "seq_length": 256,
            "new_token_limit": True,
            "max_new_tokens": 8,
        }
    ).start()
    try:
        items = module.build_dataset([chat, "sort: 3 1 2 ="])
    finally:
        module.shutdown()
    want = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert (
        "prompt_cut" not in items[0]
        and items[0]["input_ids"] == list(want)
        and items[0]["prompt"].endswith("<|im_start|>assistant\n")
    )
    # a text prompt as before
    assert items[1]["input_ids"] == tokenizer("sort: 3 1 2 =")["input_ids"]
    plain = HFGeneration(
        {
            "load": str(tiny_llama_dir),
            "seq_length": 256,
            "new_token_limit": True,
            "max_new_tokens": 8,
        }
    ).start()
    try:
        with pytest.raises(
            ValueError, match="the prompts are chats .* tokenizer has no chat template"
        ):
            plain.build_dataset([chat])
    finally:
        plain.shutdown()
