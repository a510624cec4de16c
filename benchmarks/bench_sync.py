# python benchmarks/bench_sync.py --output outputs/bench_sync.json [--sizes small,medium,large] [--repeats 5] [--no-lora]
"""Weight sync speed (from Megatron and from a transformers model) against its lower bound and the naive path,
for three model sizes (`--sizes tiny --repeats 1` is a smoke run of a few seconds).

For each size (random Llama-architecture weights written straight to safetensors, fp32, on CPU):

    chatgen      `sync_weights(MegatronModule, llm)`: gather + HF layout + manifest check + streaming reload,
                 trainer (TP=1) and engine colocated in this process
    transformers `sync_weights(AutoModelForCausalLM, llm)`: what `VLLMGeneration.sync_weights` does in colocate
                 mode (manifest + finiteness check + streaming reload from the model's parameters)
    server_shm   the same model through server mode's same-host data path (weight_transport="shm"):
                 `ShmSender` copies it into the file in /dev/shm that `ShmReceiver` named, then
                 `ShmReceiver.receive_into(llm)` checks the header, maps the file and reloads from it (what
                 `chatgen serve --control` runs at finish); split into write (trainer: source, finiteness,
                 copy) and load (server: checks + reload)
    server_group the same model through server mode's group path (weight_transport="group", any machine):
                 `GroupSender.to` -> a private gloo group over loopback -> `GroupReceiver.listen().receive_into(llm)` on
                 another thread. Neither server figure includes the two HTTP calls (begin / finish, a few ms)
    broadcast_1, broadcast_2  the trainer (TP=1) to generation replicas on devices of their own, as a run with
                 disaggregated replicas syncs (chatgen.param_sync.group): `GroupSender` -> one gloo
                 broadcast per bucket -> a `GroupReceiver` per engine, each on its own thread loading its own
                 engine; to one engine, then to two. Target: broadcast_2 <= 1.3x broadcast_1. Both engines live in
                 this process and load on the same CPU cores (two replicas' loads are twice the work there; on
                 their own devices they run side by side)
    lower_bound  `vllm_adapter.load_weights(llm.engine, hf_state_dict)` from an HF state dict already in memory
                 (vLLM's own reload: copy + CPU repack; no sync can be faster)
    naive        save an HF checkpoint to disk, then start a new engine from it in this process (vLLM
                 already imported and warm: the most generous restart)
    naive_new_process  the same save, then a new engine in a fresh Python process, timed until it is
                 ready (import + engine start): what restarting a generation worker costs

    lora         a LoRA trainer's two syncs (bench_lora_sync.measure: rank --lora-rank on every target, the tiny
                 Llama and SmolLM2-135M of the tests' cache): merged (`sync_weights`) against adapter-only
                 (`sync_adapter`, the adapter alone, loaded by vLLM from memory), alternating. Targets: the adapter
                 moves <= 5% of the merged bytes in <= 0.2x its time (docs/lora.md)

Reports seconds (median of --repeats interleaved runs, minima too; naive runs once: save + engine start), bytes/s of the weights moved, and the ratios the
issue targets: chatgen, transformers and server_shm <= 1.2x lower_bound, naive >= 20x chatgen (server_group:
reported, no target: it copies every byte through a socket). Writes JSON to --output, with the load average
after each size and at the end (the machine is shared: read figures with it).
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

SIZES = {  # name -> HF config overrides (Llama, GQA, head_dim 32/64/128 as vLLM's CPU attention needs)
    "tiny": dict(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),  # configs/models/tiny_llama.yaml's layers, with a 32000-token vocabulary
    "small": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
    "medium": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
    "large": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
}


def make_model(path: Path, overrides: dict) -> int:
    from chatgen import models
    from chatgen.models import layout

    config = dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=32000,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        hidden_act="silu",
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        **overrides,
    )
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    shapes = layout.hf_param_shapes(models.spec_from_hf_config(config))
    state = {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}
    save_file(state, str(path / "model.safetensors"))
    return sum(t.numel() for t in state.values())


ENGINE_KWARGS = dict(
    enforce_eager=True,
    skip_tokenizer_init=True,
    dtype="float32",
    seed=0,
    kv_cache_memory_bytes=64 << 20,
)
NEW_PROCESS_ENGINE = (
    "import sys\n"
    "from chatgen.generation.vllm import adapter as vllm_adapter\n"
    "llm = vllm_adapter.build_llm(sys.argv[1], **{kwargs!r})\n"
    "print('chatgen-engine-ready', flush=True)\n"
)


def new_process_engine_start_s(model_dir: str) -> float:
    """Seconds from spawning a fresh Python until its vLLM engine on `model_dir` is ready."""
    import subprocess

    t = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", NEW_PROCESS_ENGINE.format(kwargs=ENGINE_KWARGS), model_dir],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    for line in proc.stdout:
        if line.strip() == "chatgen-engine-ready":
            elapsed = time.perf_counter() - t
            proc.kill()
            proc.wait()
            return elapsed
    raise RuntimeError(f"the fresh-process engine exited ({proc.wait()}) before it was ready")


def engine(model_dir: str):
    """A started VLLMModule on random weights (what a sync writes into)."""
    from chatgen.generation.vllm.module import VLLMModule

    return VLLMModule(
        dict(
            load=model_dir,
            load_format="dummy",
            enforce_eager=True,
            dtype="float32",
            seed=0,
            kv_cache_memory_bytes=64 << 20,
        )
    ).start()


def timed(fn, repeats: int = 1) -> list:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def interleaved(fns: dict, repeats: int) -> dict:
    """Alternate the candidates run by run, so load from other processes hits them alike."""
    runs = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            runs[name] += timed(fn)
    return runs


def server_group(hf_model, llm):
    """One sync of `hf_model` into `llm` the way server mode moves it over a group: GroupSender.to -> gloo ->
    GroupReceiver.listen() (on another thread, as the server's)."""
    import threading

    from chatgen.param_sync import GroupReceiver, GroupSender, sync_weights

    receiver = GroupReceiver.listen()
    sender = GroupSender.to("127.0.0.1", receiver.port, receiver.token)

    def once():
        engine_side = threading.Thread(target=receiver.receive_into, args=(llm,))
        engine_side.start()
        sync_weights(hf_model, sender)
        engine_side.join()

    return once


def server_shm(hf_model, llm, load_s: list):
    """One sync of `hf_model` into `llm` the way server mode moves it through shared memory: ShmSender writes the
    file ShmReceiver named, then the receiver checks, maps and loads it (what POST /control/weights/finish runs;
    its seconds are appended to `load_s`)."""
    from chatgen.param_sync import ShmReceiver, ShmSender

    receiver = ShmReceiver()

    def finish(body):
        t = time.perf_counter()
        receiver.receive_into(llm, header=body["header"])
        load_s.append(time.perf_counter() - t)

    sender = ShmSender(receiver.name, finish)

    def once():
        sender.send(hf_model)

    return once


def broadcast(trainer, llms: list):
    """One sync of `trainer` into every engine of `llms` over one broadcast group (the trainer's rank 0 + one
    receiver per engine, each on its own thread, as each replica's process would receive)."""
    import secrets
    import threading

    from chatgen.param_sync import GroupReceiver, GroupSender

    token, world = secrets.token_hex(8), 1 + len(llms)
    sender, receivers = GroupSender(token, world), [None] * len(llms)

    def join(i):
        receivers[i] = GroupReceiver(sender.host, sender.port, 1 + i, world, token)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(llms))]
    [t.start() for t in threads]
    sender.connect()
    [t.join() for t in threads]

    def once():
        engine_sides = [
            threading.Thread(target=rx.receive_into, args=(llm,))
            for rx, llm in zip(receivers, llms)
        ]
        [t.start() for t in engine_sides]
        sender.send(trainer)
        [t.join() for t in engine_sides]

    return once


def bench_size(name: str, overrides: dict, repeats: int, workdir: Path) -> dict:
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from chatgen.generation.vllm import adapter as vllm_adapter
    from chatgen.param_sync import sync_weights
    from chatgen.training.megatron_module import MegatronModule

    model_dir = workdir / name
    params = make_model(model_dir, overrides)
    nbytes = params * 4
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    trainer = MegatronModule(dict(load=str(model_dir))).start()
    llm = engine(str(model_dir))
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sync_weights(trainer, llm)  # warm-up (first reload records vLLM's layer metadata)
    sync_weights(hf_model, llm)
    hf_state = trainer.hf_state_dict()  # a separate copy, as a lower bound would have it
    vllm_adapter.load_weights(llm.engine, iter(hf_state.items()))
    group, shm_load_s = server_group(hf_model, llm), []
    shm = server_shm(hf_model, llm, shm_load_s)
    group()  # warm-up: the group is created on the first sync
    shm()  # warm-up: the file is created, reserved and mapped on the first sync
    del shm_load_s[:]
    replica = engine(str(model_dir))  # a second replica's engine
    sync_weights(trainer, replica)  # warm-up, as above
    broadcast_1, broadcast_2 = broadcast(trainer, [llm]), broadcast(trainer, [llm, replica])
    runs = interleaved(
        {
            "chatgen": lambda: sync_weights(trainer, llm),
            "transformers": lambda: sync_weights(hf_model, llm),
            "server_group": group,
            "server_shm": shm,
            "broadcast_1": broadcast_1,
            "broadcast_2": broadcast_2,
            "lower": lambda: vllm_adapter.load_weights(llm.engine, iter(hf_state.items())),
        },
        repeats,
    )
    replica.shutdown()
    chatgen_s, transformers_s, lower_s = runs["chatgen"], runs["transformers"], runs["lower"]
    server = {transport: runs[f"server_{transport}"] for transport in ("group", "shm")}

    naive_dir = workdir / f"{name}-naive"

    naive_parts = {}

    def naive():
        t = time.perf_counter()
        naive_dir.mkdir()
        save_file(
            {k: v.contiguous() for k, v in hf_state.items()}, str(naive_dir / "model.safetensors")
        )
        shutil.copy(model_dir / "config.json", naive_dir / "config.json")
        naive_parts["save_s"] = time.perf_counter() - t
        t = time.perf_counter()
        # a new engine on the saved weights
        fresh = vllm_adapter.build_llm(str(naive_dir), **ENGINE_KWARGS)
        naive_parts["engine_start_s"] = time.perf_counter() - t
        vllm_adapter.shutdown(fresh)
        naive_parts["new_process_engine_start_s"] = new_process_engine_start_s(str(naive_dir))

    naive()
    shutil.rmtree(naive_dir, ignore_errors=True)
    llm.shutdown()
    del llm, trainer, hf_state, hf_model
    gc.collect()
    # medians of interleaved runs decide the targets; minima (least disturbed by other processes) kept too
    chatgen, lower = statistics.median(chatgen_s), statistics.median(lower_s)
    transformers = statistics.median(transformers_s)
    servers = {}
    for transport, runs_s in server.items():
        t = statistics.median(runs_s)
        servers.update(
            {
                f"server_{transport}_s": t,
                f"server_{transport}_min_s": min(runs_s),
                f"server_{transport}_runs_s": runs_s,
                f"server_{transport}_bytes_per_s": nbytes / t,
                f"server_{transport}_over_lower_bound": t / lower,
                f"server_{transport}_over_lower_bound_min": min(runs_s) / min(lower_s),
            }
        )
    # the shm sync's two parts, run by run: the server's (check, map, reload) and the trainer's (the rest)
    servers.update(
        server_shm_load_s=statistics.median(shm_load_s),
        server_shm_write_s=statistics.median(
            t - load for t, load in zip(server["shm"], shm_load_s)
        ),
        meets_server_shm_lower_bound_target=servers["server_shm_s"] <= 1.2 * lower,
    )
    one, two = statistics.median(runs["broadcast_1"]), statistics.median(runs["broadcast_2"])
    servers.update(
        broadcast_1_s=one,
        broadcast_2_s=two,
        broadcast_1_runs_s=runs["broadcast_1"],
        broadcast_2_runs_s=runs["broadcast_2"],
        broadcast_2_over_1=two / one,
        broadcast_2_over_1_min=min(runs["broadcast_2"]) / min(runs["broadcast_1"]),
        meets_broadcast_target=two <= 1.3 * one,
    )
    # shutting the engine down is not counted
    naive_t = naive_parts["save_s"] + naive_parts["engine_start_s"]
    naive_np = naive_parts["save_s"] + naive_parts["new_process_engine_start_s"]
    return dict(
        size=name,
        params=params,
        bytes=nbytes,
        config=overrides,
        chatgen_s=chatgen,
        lower_bound_s=lower,
        naive_s=naive_t,
        naive_save_s=naive_parts["save_s"],
        naive_engine_start_s=naive_parts["engine_start_s"],
        chatgen_min_s=min(chatgen_s),
        lower_bound_min_s=min(lower_s),
        chatgen_runs_s=chatgen_s,
        lower_bound_runs_s=lower_s,
        transformers_s=transformers,
        transformers_min_s=min(transformers_s),
        transformers_runs_s=transformers_s,
        transformers_bytes_per_s=nbytes / transformers,
        transformers_over_lower_bound=transformers / lower,
        transformers_over_lower_bound_min=min(transformers_s) / min(lower_s),
        meets_transformers_lower_bound_target=transformers <= 1.2 * lower,
        **servers,
        load_average=os.getloadavg(),
        chatgen_bytes_per_s=nbytes / chatgen,
        lower_bound_bytes_per_s=nbytes / lower,
        naive_bytes_per_s=nbytes / naive_t,
        chatgen_over_lower_bound=chatgen / lower,
        chatgen_over_lower_bound_min=min(chatgen_s) / min(lower_s),
        naive_over_chatgen=naive_t / chatgen,
        naive_new_process_s=naive_np,
        naive_new_process_over_chatgen=naive_np / chatgen,
        meets_lower_bound_target=chatgen <= 1.2 * lower,
        meets_naive_target=naive_t >= 20 * chatgen,
        meets_naive_target_new_process=naive_np >= 20 * chatgen,
    )


def bench_lora(rank: int, repeats: int) -> dict:
    """The LoRA case (see the module docstring), one row per model."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_lora_memory import default_models
    from bench_lora_sync import measure

    rows = {}
    for model in default_models():
        rows[Path(model).name] = row = measure(model, rank, repeats)
        print(
            f"lora    {Path(model).name}: adapter-only {row['adapter_bytes'] / 1e6:.2f} MB in "
            f"{row['adapter_s'] * 1e3:.1f} ms, merged {row['merged_bytes'] / 1e6:.1f} MB in "
            f"{row['merged_s'] * 1e3:.1f} ms: bytes {row['bytes_ratio']:.3f}x, time {row['time_ratio']:.3f}x | "
            f"load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    ok = all(r["bytes_ratio"] <= 0.05 and r["time_ratio"] <= 0.2 for r in rows.values())
    return dict(rank=rank, models=rows, meets_targets=ok, load_average=os.getloadavg())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True)
    p.add_argument("--sizes", default="small,medium,large", help=f"comma list of {sorted(SIZES)}")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--no-lora", action="store_true", help="skip the LoRA case (adapter-only vs merged)"
    )
    p.add_argument("--lora-rank", type=int, default=4)
    args = p.parse_args(argv)
    unknown = set(args.sizes.split(",")) - set(SIZES)
    if unknown:
        p.error(f"--sizes: unknown {sorted(unknown)}; choose from {sorted(SIZES)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="chatgen-bench-sync-") as tmp:
        for name in args.sizes.split(","):
            r = bench_size(name, SIZES[name], args.repeats, Path(tmp))
            results.append(r)
            print(
                f"{name:7s} {r['params'] / 1e6:7.1f}M params {r['bytes'] / 1e9:5.2f} GB | chatgen {r['chatgen_s']:.3f}s "
                f"({r['chatgen_bytes_per_s'] / 1e9:.2f} GB/s) | transformers {r['transformers_s']:.3f}s "
                f"({r['transformers_over_lower_bound']:.2f}x lower) | server shm {r['server_shm_s']:.3f}s "
                f"({r['server_shm_over_lower_bound']:.2f}x lower; write {r['server_shm_write_s']:.3f}s + load "
                f"{r['server_shm_load_s']:.3f}s) | server group {r['server_group_s']:.3f}s "
                f"({r['server_group_over_lower_bound']:.2f}x lower) | broadcast to 1 / 2 replicas "
                f"{r['broadcast_1_s']:.3f} / {r['broadcast_2_s']:.3f}s ({r['broadcast_2_over_1']:.2f}x) | "
                f"lower bound {r['lower_bound_s']:.3f}s "
                f"({r['lower_bound_bytes_per_s'] / 1e9:.2f} GB/s) | naive {r['naive_s']:.2f}s | "
                f"chatgen/lower {r['chatgen_over_lower_bound']:.2f}x | naive/chatgen {r['naive_over_chatgen']:.0f}x "
                f"(new process: {r['naive_new_process_s']:.1f}s, {r['naive_new_process_over_chatgen']:.0f}x) | "
                f"load {r['load_average'][0]:.2f}",
                flush=True,
            )
    lora = None if args.no_lora else bench_lora(args.lora_rank, args.repeats)
    out = dict(
        benchmark="bench_sync",
        device="cpu",
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        targets=dict(
            chatgen_over_lower_bound_max=1.2,
            transformers_over_lower_bound_max=1.2,
            server_shm_over_lower_bound_max=1.2,
            naive_over_chatgen_min=20,
            broadcast_2_over_1_max=1.3,
            lora_bytes_ratio_max=0.05,
            lora_time_ratio_max=0.2,
        ),
        results=results,
        lora=lora,
        load_average=os.getloadavg(),
        all_targets_met=all(
            r["meets_lower_bound_target"]
            and r["meets_transformers_lower_bound_target"]
            and r["meets_server_shm_lower_bound_target"]
            and r["meets_naive_target"]
            for r in results
        )
        and (lora is None or lora["meets_targets"]),
    )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.output}; all targets met: {out['all_targets_met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
