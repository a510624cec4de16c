"""Helpers shared by several test modules. A test module never imports another
(tests/unit/test_architecture.py checks it): what two of them share lives here or, as a fixture, in
a conftest.py.

    from helpers import make_spec, listening_sockets   # tests/ is on sys.path (tests/conftest.py)

Sections: shipped configs; sockets a process tree listens on; model specs and HF states
(conversion); a trainer (megatron-core); a vLLM engine on random weights and its greedy outputs
(sync); weights a test lists, a perturbed HF model and log-prob agreement with it (vLLM generation);
a quick SFT warm start. Heavy libraries (vLLM, megatron-core, transformers) are imported inside the
helpers that need them.
"""

import contextlib
import ipaddress
import threading
import time
from pathlib import Path

import torch

from chatgen import models
from chatgen.models import layout

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-4  # fp32: two implementations' log-probs of the same weights agree within this
TASK_N_EVAL = 8  # held-out records of the `data_dir` fixture (tests/integration/conftest.py)

# ---- shipped configs


def load(name, *overrides):
    """configs/<name> loaded with `key=value` overrides."""
    from chatgen.rlhf.config import load_config

    return load_config(REPO / "configs" / name, list(overrides))


# ---- sockets


def listeners(root) -> list:
    """(process name, address, port) of every listening TCP socket of `root` and its descendants."""
    import psutil  # (imported here: the GPU machine's tier imports this module and may lack it)

    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            out += [
                (p.name(), c.laddr.ip, c.laddr.port)
                for c in p.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN
            ]
        except psutil.NoSuchProcess:
            pass
    return out


@contextlib.contextmanager
def listening_sockets(interval: float = 0.5):
    """Yields a set that collects, while the block runs, every listening socket of this process tree
    (`listeners`), sampled every `interval` seconds."""
    import psutil

    seen, done = set(), threading.Event()

    def sample():
        while not done.wait(interval):
            seen.update(listeners(psutil.Process()))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        yield seen
    finally:
        done.set()
        sampler.join()


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return (
        address.is_loopback
        or getattr(address, "ipv4_mapped", None) is not None
        and address.ipv4_mapped.is_loopback
    )


# ---- model specs (conversion)

MOE_CONFIG = {  # the mixture-of-experts keys of each MoE family's config.json, as transformers 5 writes them
    "qwen3_moe": dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),  # experts intermediate_size wide
}


def make_spec(
    family="llama", heads=4, groups=2, layers=4, vocab=250, tied=False, head_dim=8, hidden=None
):
    cfg = dict(
        model_type=family,
        num_hidden_layers=layers,
        hidden_size=hidden or heads * head_dim,
        intermediate_size=48,
        num_attention_heads=heads,
        num_key_value_heads=groups,
        head_dim=head_dim,
        vocab_size=vocab,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        **MOE_CONFIG.get(family, {}),
    )
    return models.spec_from_hf_config(cfg)


def random_hf_state(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = layout.hf_param_shapes(spec)
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


# ---- a trainer (megatron-core)


def batch(vocab=500, b=2, t=12, seed=0):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def masked_batch(vocab=500, rows=4, left_padded=False):
    """A trainer batch of `rows` 16-token samples whose last 10 positions are the loss's
    (loss_mask (rows, 15)); left_padded: the first row's first 3 tokens are padding."""
    ids = torch.randint(4, vocab, (rows, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(rows, 15)
    mask[:, 6:] = 1
    attention = torch.ones(rows, 16, dtype=torch.long)
    if left_padded:
        attention[0, :3] = 0
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": mask}


def masked_nll(logprobs, micro_batch):
    """The token-mean NLL over a micro-batch's loss_mask (a train_step loss_fn)."""
    mask = micro_batch["loss_mask"]
    return -(logprobs * mask).sum() / mask.sum(), {"tokens": mask.sum()}


def fsdp_train_steps(model_dir, steps: int, weights_file, config=None, rows: int = 4) -> list:
    """`steps` train_steps of an FSDPModule (lr 1e-3 and 2 rows a micro-batch unless `config` says
    otherwise) on this rank's share of masked_batch(rows=rows, left_padded=True): the metrics of each
    step; rank 0 writes the weights (merged, for LoRA) to `weights_file` (tensors do not cross a
    process boundary whole). Run it in one process and under run_distributed to compare DP sizes."""
    from safetensors.torch import save_file

    from chatgen.training.fsdp_module import FSDPModule

    config = {"load": str(model_dir), "lr": 1e-3, "micro_batch_size": 2, **(config or {})}
    trainer = FSDPModule(config).start()
    share = rows // trainer.dp
    mine = slice(trainer.dp_rank * share, (trainer.dp_rank + 1) * share)
    part = {k: v[mine] for k, v in masked_batch(rows=rows, left_padded=True).items()}
    metrics = [trainer.train_step(part, masked_nll) for _ in range(steps)]
    weights = trainer.hf_state_dict()
    if trainer.dp_rank == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(weights_file))
    trainer.shutdown()
    return metrics


def nll_loss(logprobs, micro_batch):
    loss = -logprobs.mean()
    return loss, {"nll": loss.detach()}


def optimizer_state(trainer) -> list:
    """This rank's fp32 main weights and Adam moments, in the optimizer's order, copied to the host (for
    comparing; a GPU trainer's too)."""
    out = []
    for chained in trainer.optimizer.chained_optimizers:
        inner = chained.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                out += [p.detach().cpu().clone()] + [
                    inner.state[p][k].detach().cpu().clone()
                    for k in ("exp_avg", "exp_avg_sq")
                    if k in inner.state[p]
                ]
    return out


def build(model_dir, **kw):
    from chatgen.training.megatron_module import MegatronModule, release_parallel_state

    release_parallel_state()  # the previous trainer's groups (a test need not shut it down)
    return MegatronModule(dict(load=str(model_dir), **kw)).start()


# ---- a vLLM engine on random weights and its greedy outputs (weight sync)

SYNC_PROMPTS = [[5, 17, 99, 200], [1, 2, 3, 4, 5, 6, 7]]
SYNC_NEW_TOKENS = 6


def engine(model_dir, tensor_parallel_size=1):
    """A VLLMModule on random weights (load_format dummy): only a sync can make it agree with the trainer."""
    from chatgen.generation.vllm.module import VLLMModule

    return VLLMModule(
        dict(
            load=str(model_dir),
            load_format="dummy",
            enforce_eager=True,
            dtype="float32",
            seed=0,
            kv_cache_memory_bytes=32 << 20,
            temperature=0.0,
            new_token_limit=True,
            max_new_tokens=SYNC_NEW_TOKENS,
            logprobs_mode="raw",
            tensor_parallel_size=tensor_parallel_size,
        )
    ).start()


def adapter_engine(model_dir, **engine_kwargs):
    """A bare vLLM engine (adapter.build_llm) on the model at `model_dir` with the tests' common
    settings (fp32, eager, seed 0, 128 tokens in blocks of 32, raw log-probs); `engine_kwargs` add
    the cache size and limits a test needs. Shut it down with adapter.shutdown."""
    from chatgen.generation.vllm import adapter

    settings = dict(
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=128,
        block_size=32,
        logprobs_mode="raw_logprobs",
    )
    return adapter.build_llm(str(model_dir), **{**settings, **engine_kwargs})


def generate(llm, prompts=SYNC_PROMPTS):
    """[(output ids, vLLM log-probs of them)] for greedy decoding."""
    from chatgen.generation.batching import sample_logprobs

    outs = llm.finished([{"input_ids": p} for p in prompts], greedy=True)
    return [(list(o.outputs[0].token_ids), sample_logprobs(o.outputs[0])) for o in outs]


def worst_abs_diff(diffs) -> float:
    """Largest |diff| over all samples; NaN stays NaN (Python's max(0.0, nan) would say 0.0) and fails `< TOL`."""
    return torch.cat([d.abs().flatten() for d in diffs]).max().item()


def generated_diff_vs_hf(model_dir, generated, prompts=SYNC_PROMPTS) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    diffs = []
    for prompt, (ids, vllm_lp) in zip(prompts, generated):
        full = torch.tensor([prompt + ids])
        with torch.no_grad():
            lp = torch.log_softmax(hf(full).logits[0, len(prompt) - 1 : -1].float(), -1)
        diffs.append(lp.gather(-1, full[0, len(prompt) :, None])[:, 0] - torch.tensor(vllm_lp))
    return worst_abs_diff(diffs)


# ---- listed weights, a perturbed HF model, agreement with it (vLLM generation)


class ListedWeights:
    """A weight source (chatgen.param_sync.weight_source's protocol) over fp32 buckets the test lists,
    [[(HF name, tensor)]], whose header claims every tensor finite; subclasses bend one part of it."""

    def __init__(self, buckets: list):
        self.listed, self.dtype = buckets, torch.float32
        self.plan = [[(n, tuple(t.shape)) for n, t in bucket] for bucket in buckets]

    def hf_weights(self, bucket_bytes):
        return self

    def nonfinite(self):
        return []

    def buckets(self):
        yield from self.listed


def perturbed(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def max_diff_vs_hf(model, prompt_ids, completion_ids, logprobs) -> float:
    worst = 0.0
    for prompt, completion, lps in zip(prompt_ids, completion_ids, logprobs):
        full = torch.tensor([prompt + completion])
        with torch.no_grad():
            hf = torch.log_softmax(model(full).logits[0, len(prompt) - 1 : -1], -1)
        diff = (
            (hf.gather(-1, full[0, len(prompt) :, None])[:, 0] - torch.tensor(lps))
            .abs()
            .max()
            .item()
        )
        worst = max(worst, diff) if diff == diff else float("nan")  # NaN must fail `< TOL`
    return worst


def assert_same_generation(after, before, tol=1e-5) -> None:
    """Two (prompt ids, completion ids, log-probs) results of one engine's greedy generate agree: the same
    tokens, log-probs at float noise (requests that arrive apart under load are batched otherwise, and a
    batch of other shapes sums in another order), far below what any weight change moves."""
    assert after[:2] == before[:2]
    assert max(abs(a - b) for x, y in zip(after[2], before[2]) for a, b in zip(x, y)) < tol


def right_padded(rows, pad=0):
    """NeMo RL's token batch of `rows` (lists of ids): input_ids right-padded with `pad`, input_lengths."""
    ids = torch.full((len(rows), max(map(len, rows))), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    return {"input_ids": ids, "input_lengths": torch.tensor(list(map(len, rows)))}


def completions(out):
    """(prompt ids, completion ids, completion log-probs) of each row of a `generate` output (NeMo RL's keys)."""
    rows = []
    for i, end in enumerate(out["unpadded_sequence_lengths"].tolist()):
        start = end - int(out["generation_lengths"][i])
        ids = out["output_ids"][i].tolist()
        rows.append((ids[:start], ids[start:end], out["logprobs"][i, start:end].tolist()))
    return rows


# ---- a quick SFT warm start


def quick_warm_start(model_dir, sft_records, out, steps=20):
    """A few plain-torch SFT steps so that the tiny model writes digits: its rewards then vary within a group
    and GRPO's updates are not zero (a random model scores 0 everywhere). Written to `out`; made once per
    machine for each model, records and steps (several test files ask for the same one) and cached beside
    the model."""
    import hashlib
    import inspect
    import json
    import os
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.sft_warm_start import sft_batch

    key = hashlib.sha256(f"{Path(model_dir).name} {steps} {json.dumps(sft_records)}".encode())
    key.update(inspect.getsource(quick_warm_start).encode() + inspect.getsource(sft_batch).encode())
    cached = Path(model_dir).parent / f"{Path(model_dir).name}-quick-sft-{key.hexdigest()[:12]}"
    if not (cached / "config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        torch.manual_seed(0)
        for step in range(steps):
            b = sft_batch(
                tokenizer, [sft_records[(step * 32 + i) % len(sft_records)] for i in range(32)]
            )
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            logprobs = torch.log_softmax(logits[:, :-1], -1)
            logprobs = logprobs.gather(-1, b["input_ids"][:, 1:, None])[..., 0]
            loss = -(logprobs * b["loss_mask"]).sum() / b["loss_mask"].sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        tmp = tempfile.mkdtemp(dir=cached.parent, prefix=".quick-sft-")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, cached)  # atomic: a directory is there whole or not at all
        except OSError:  # another test process won the race: its directory is complete
            shutil.rmtree(tmp, ignore_errors=True)
            if not (cached / "config.json").exists():
                raise
    shutil.copytree(cached, out)
    return out


def shipped_warm_start(model_dir) -> Path:
    """examples/sft_warm_start.py as examples/prepare_tiny.sh runs it for the shipped GRPO job (300 steps of
    64 on the sort-digits task's sft.jsonl: it sorts, mostly the wrong way), of `model_dir`; made once per
    machine (~30 s on 2 cores) and cached beside the tiny models, keyed by the model and the script."""
    import hashlib
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    from chatgen import tasks

    cache = Path(model_dir).parent
    key = hashlib.sha256(Path(model_dir).name.encode())
    for source in (REPO / "examples" / "sft_warm_start.py", Path(tasks.__file__)):
        key.update(source.read_bytes())
    out = cache / f"{Path(model_dir).name}-sft-{key.hexdigest()[:12]}"
    if (out / "chatgen_sft.json").exists():
        return out
    with tempfile.TemporaryDirectory(dir=cache, prefix=".sft-") as tmp:
        tasks.write_task_data(str(Path(tmp) / "data"))
        subprocess.run(
            [sys.executable, str(REPO / "examples" / "sft_warm_start.py"), "--load", str(model_dir)]
            + ["--data", f"{tmp}/data/sft.jsonl", "--output", f"{tmp}/model", "--steps", "300"],
            check=True,
            env={
                **os.environ,
                "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            },
        )
        try:
            os.rename(f"{tmp}/model", out)  # atomic: a directory is there whole or not at all
        except OSError:  # another test process won the race: its directory is complete
            if not (out / "chatgen_sft.json").exists():
                raise
            shutil.rmtree(f"{tmp}/model", ignore_errors=True)
    return out


def selected_tests(request, test_file) -> set:
    """The names of `test_file`'s tests this session runs (a fixture starts their slow work early)."""
    return {i.originalname for i in request.session.items if i.path == Path(test_file)}


def fresh_interpreters(request, test_file, codes: dict, **popen):
    """Fixture body (`yield from`): test name -> a fresh `python -c CODE` process, started at once for
    the tests of `test_file` this session runs (each is seconds of imports, mostly on one core, so
    CI's two cores work at once). codes: test name -> the code, or a callable making it (to build
    only what a selected test needs). A process a failed test left running is killed at the end."""
    import subprocess
    import sys

    selected = selected_tests(request, test_file)
    started = {
        name: subprocess.Popen(
            [sys.executable, "-c", code() if callable(code) else code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **popen,
        )
        for name, code in codes.items()
        if name in selected
    }
    yield started
    for proc in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def chatgen_serve(model, port: int, *args, env=None):
    """`chatgen serve --model MODEL --port PORT ARGS...` in its own process, vLLM's logging quiet and
    its stderr dropped (wait for it with `wait_until_serving`)."""
    import os
    import subprocess
    import sys

    argv = [
        sys.executable,
        "-m",
        "chatgen.cli",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
    ]
    return subprocess.Popen(
        [*argv, *map(str, args)],
        env=dict(env if env is not None else os.environ, VLLM_LOGGING_LEVEL="ERROR"),
        stderr=subprocess.DEVNULL,
    )


def wait_until_serving(proc, url: str, seconds: float, key: str | None = None) -> None:
    """Poll a server's `url`/health (with the API key, if it has one) until it answers 200; fail
    if its process `proc` exits first (with its stderr, where piped) or after `seconds`."""
    import requests

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    deadline = time.time() + seconds
    while True:
        if proc.poll() is not None:
            said = proc.stderr.read()[-3000:] if proc.stderr else "(stderr not piped)"
            raise AssertionError(f"the server exited with {proc.returncode}: {said}")
        assert time.time() < deadline, f"the server did not come up within {seconds:.0f} s"
        try:
            if requests.get(f"{url}/health", headers=headers, timeout=5).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)


# ---- the policy loss on plain tensors


def policy_loss(logprobs, old, advantages, mask, ref_logprobs=None, is_weights=None, **knobs):
    """chatgen.rlhf.losses.policy_loss with the batch's tensors given one by one and its options as
    keywords, the YAML's names for the registered ones (ratio_level, loss_aggregation,
    policy_loss)."""
    from chatgen.core.train_batch import TrainBatch
    from chatgen.rlhf import losses, recipe

    if "ratio_level" in knobs:
        knobs["log_ratio"] = recipe.ratio.get(knobs.pop("ratio_level"))
    if "policy_loss" in knobs:
        knobs["surrogate"] = recipe.policy_loss.get(knobs.pop("policy_loss"))
    if "loss_aggregation" in knobs:
        knobs["aggregation"] = recipe.aggregation.get(knobs.pop("loss_aggregation"))
    batch = TrainBatch(
        input_ids=torch.zeros(old.shape[0], old.shape[1] + 1, dtype=torch.long),
        loss_mask=mask,
        old_logprobs=old,
        advantages=advantages,
        ref_logprobs=ref_logprobs,
        is_weights=is_weights,
    )
    return losses.policy_loss(logprobs, batch, losses.PolicyLossOptions(**knobs))


# ---- multi-turn policy replicas (tests/integration/test_multiturn_replicas.py, bench_agentic.py)


def chat_model(source: Path, out: Path) -> Path:
    """A copy of the tiny model at `source` in `out` with the calculator's chat template."""
    from chatgen.environments.calculator import write_template

    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    write_template(out)
    return out


@contextlib.contextmanager
def served_replicas(model: Path, replicas: int, api_key: str, overrides=(), log=print):
    """configs/grpo_multiturn_tiny.yaml's policy (`model`: a chat_model) as `replicas` engines apart
    (Ray actors in a group without a trainer, one core each, runtime.engines_apart), each serving
    OpenAI HTTP as the multi-turn loop starts them: yields (runtime, server urls); shuts down."""
    import dataclasses

    from chatgen.rlhf.algorithms.grpo_multiturn import _serve
    from chatgen.rlhf.config import load_config
    from chatgen.rlhf.runtime import Runtime, engines_apart

    cfg = load_config(
        REPO / "configs/grpo_multiturn_tiny.yaml",
        [f"policy.load={model}", f"policy_trainer.load={model}", "models.policy.num_cpu=1"]
        + list(overrides),
    )
    runtime = dataclasses.replace(cfg.runtime, colocation=[], launcher="ray")
    policy = dataclasses.replace(cfg.models["policy"], num_replicas=replicas)
    cfg = dataclasses.replace(cfg, runtime=runtime, models={"policy": policy})
    assert engines_apart(cfg, ["policy"])
    rt = Runtime.start(cfg, log=log)
    try:
        yield rt, rt["policy"].run(_serve, "policy", api_key, None)
    finally:
        rt.shutdown()
