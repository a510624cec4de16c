"""A trained checkpoint is whole: `chatgen convert --to hf` of it loads in transformers (tokenizer,
chat template, generation config) and reproduces what the trainer computes and what the engine
generates from the same checkpoint; `chatgen serve --model <checkpoint>` serves it with no other
flag; one without a tokenizer is refused before any engine starts, naming `tokenizer=`.

    python -m pytest tests/integration/test_trained_checkpoint.py
"""

import json
import shutil
import subprocess
import sys

import openai
import pytest
import torch
from helpers import wait_until_serving
from timeouts import scaled

pytestmark = pytest.mark.integration

PROMPT = "the cat"
MAX_NEW = 8
TOL = 1e-4  # fp32 log-probs, trainer against transformers
CHATGEN = [sys.executable, "-m", "chatgen.cli"]


@pytest.fixture(scope="module")
def trained(chat_model_dir, tmp_path_factory):
    """A checkpoint of the tiny chat Llama after two Adam steps (weights moved away from the HF
    source's), and the trainer that wrote it."""
    from megatron.core import parallel_state as ps

    from chatgen.training.megatron_module import MegatronModule

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    trainer = MegatronModule(dict(load=str(chat_model_dir), lr=1e-2, clip_grad=0.0)).start()
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        trainer.train_step({"input_ids": ids}, lambda lp, mb: (-lp.mean(), {}))
    path = trainer.save_checkpoint(tmp_path_factory.mktemp("run") / "policy_trainer")
    yield path, trainer
    trainer.shutdown()


SERVE_FLAGS = [
    "enforce_eager=true",
    "seq_length=128",
    "max_new_tokens=16",
    f"kv_cache_memory_bytes={64 << 20}",
]


def serve(model, port):
    return subprocess.Popen(
        [
            *CHATGEN,
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
            *SERVE_FLAGS,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )


def test_hf_export_of_a_trained_checkpoint_reproduces_trainer_and_engine(
    trained, chat_model_dir, tmp_path
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from chatgen.cli import main
    from chatgen.core.distributed import free_port

    checkpoint, trainer = trained
    hf = tmp_path / "hf"
    assert main(["convert", "--to", "hf", "--input", checkpoint, "--output", str(hf)]) == 0
    tokenizer = AutoTokenizer.from_pretrained(hf)
    source = AutoTokenizer.from_pretrained(chat_model_dir)
    messages = [{"role": "user", "content": PROMPT}]
    assert len(tokenizer) == len(source) > 1 and tokenizer.encode(PROMPT) == source.encode(PROMPT)
    template = tokenizer.apply_chat_template(messages, tokenize=False)
    assert template == source.apply_chat_template(messages, tokenize=False)
    greedy = dict(max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(prompt, **greedy)
        logits = model(out).logits[:, :-1]
    hf_logprobs = torch.log_softmax(logits, -1).gather(-1, out[:, 1:, None])[..., 0]
    trainer_logprobs = trainer.forward_tokens({"input_ids": out})  # the trainer's own weights
    assert (trainer_logprobs - hf_logprobs).abs().max() < TOL
    untrained = AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32)
    assert not torch.equal(out, untrained.generate(prompt, **greedy)), "training changed nothing"

    port = free_port()
    proc = serve(checkpoint, port)  # the checkpoint itself, no tokenizer= flag
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0
        )
        wait_until_serving(proc, f"http://127.0.0.1:{port}", scaled(300))
        r = client.completions.create(
            model=checkpoint,
            prompt=PROMPT,
            max_tokens=MAX_NEW,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        generated = out[0, prompt.shape[1] :]
        assert r.choices[0].token_ids == generated.tolist()  # the engine's greedy = the export's
        # the text endpoint: the checkpoint's own tokenizer was found (decoded after the prompt,
        # the text has a leading space)
        assert r.choices[0].text.strip() == tokenizer.decode(generated).strip() != ""
    finally:
        proc.terminate()
        assert proc.wait(timeout=scaled(60)) == 143


def test_a_checkpoint_without_tokenizer_is_refused_before_the_engine(trained, tmp_path, capfd):
    from chatgen.cli import main
    from chatgen.core.checkpoint_io import HF_SIDE_FILES

    checkpoint, _ = trained
    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare, ignore=lambda d, names: set(names) & set(HF_SIDE_FILES))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    # the commands' own code in this process (chatgen.cli.main, as the console script runs it):
    # a refusal before the engine is seconds of vLLM imports in a subprocess, and the exit code of
    # a refused command in its own process is test_cli's
    serve = main(["serve", "--model", str(bare), "--port", "0", *SERVE_FLAGS])
    err = capfd.readouterr().err
    assert serve == 2, err[-2000:]
    assert "tokenizer=DIR" in err and "Traceback" not in err, err[-2000:]
    assert "starting the engine" not in err  # refused before it
    out = tmp_path / "out.jsonl"
    generate = main(
        ["generate", "--model", str(bare), "--input", str(prompts), "--output", str(out)]
    )
    err = capfd.readouterr().err
    assert generate == 2 and "tokenizer=DIR" in err and "[rank0]" not in err, err[-2000:]
    assert "starting the engine" not in err and not out.exists()
