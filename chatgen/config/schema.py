"""Typed sections of a chatgen config: one dataclass per YAML mapping, one line per key.

A field is `name: type = opt(default, "one-line doc")`; adding a key is a one-line change here (and a row in
docs/configuration.md, which `chatgen config --reference` prints). `check()` yields `(key, "problem; fix")`
for range and cross-key rules that a type alone cannot say. The loader (loader.py) checks types, enums
(`Literal`) and unknown keys for every field, so a dataclass here never validates its own types.

    main YAML   runtime: -> RuntimeConfig (algorithm: -> the algorithm's own Config, a subclass of AlgorithmConfig
                         declared in its file, chatgen/rlhf/algorithms/<name>.py)
                models:  -> {name: ModelEntry} (the names the algorithm's MODELS declares), each with a per-model
                         YAML of flat keys:
    per-model   backend vllm -> VLLMConfig, megatron -> MegatronConfig, python -> the class's `config_class`
                (a dataclass, or a free dict); the user's own keys of a vllm / megatron model go under `args:`
"""
import copy
import dataclasses
from typing import Any, Literal, Optional

REQUIRED = dataclasses.MISSING
DTYPES = Literal["float32", "float16", "bfloat16"]


def opt(default, doc: str):
    """A dataclass field with its one-line doc; list/dict/dataclass defaults are copied per instance."""
    meta = {"doc": doc}
    if default is REQUIRED:
        return dataclasses.field(metadata=meta)
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=default, metadata=meta)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


USER_KEYS_DOC = ("your own keys, free-form: chatgen reads none of them (`model_args(config)` gives them with the "
                 "typed keys in one flat dict); a key of this section may not be repeated here")


def args_problem(config) -> str | None:
    """Why `config.args` (user keys) cannot sit beside the typed keys in one flat `model_args`, or None."""
    shadowed = sorted(key for key in config.args if key in {f.name for f in dataclasses.fields(config)})
    if shadowed:
        return (f"{', '.join(map(repr, shadowed))} {'is a chatgen key' if len(shadowed) == 1 else 'are chatgen keys'} "
                "of this model; set it at the top level of the file, or give your key another name")
    return None


@dataclasses.dataclass(kw_only=True)
class AlgorithmConfig:
    """Base of every algorithm's own `runtime.algorithm:` section (chatgen/rlhf/algorithms/<name>.py: Config)."""

    name: str = opt("grpo", "the algorithm: a module of chatgen/rlhf/algorithms (grpo, grpo_multiturn, ppo, dpo, "
                            "online_dpo) or the dotted path of your own")


@dataclasses.dataclass(frozen=True)
class Role:
    """A model an algorithm needs (its MODELS): which backend, whether it is trained, whether it may be left out,
    and the model its weights are synced into after each update."""

    backend: Literal["vllm", "megatron", "python"]
    trainable: Optional[bool] = None  # True: must be trainable; False: must be frozen; None: either
    optional: bool = False
    syncs_to: Optional[str] = None  # e.g. policy_trainer -> "policy"
    doc: str = ""


@dataclasses.dataclass(kw_only=True)
class RuntimeConfig:
    num_episode: int = opt(1, "episodes to run; one episode = generate sample_per_episode samples, then train on them")
    sample_per_episode: int = opt(16, "samples (prompt + response pairs) generated per episode")
    num_training_epoch: int = opt(1, "passes of the trainer over each episode's samples")
    train_micro_batch_size: int = opt(1, "samples per trainer forward/backward")
    train_global_batch_size: Optional[int] = opt(None, "samples per optimizer step; null = sample_per_episode")
    generation_batch_size: int = opt(
        8, "sequences a vLLM engine runs together per step (its max_num_seqs); the default of every vllm model's generation_batch_size")
    save_episode_interval: Optional[int] = opt(None, "save a checkpoint every N episodes; null = never")
    eval_episode_interval: Optional[int] = opt(None, "evaluate on eval_data_path every N episodes; null = never")
    data_path: Optional[str] = opt(None, "training prompts (relative paths: to the current directory)")
    eval_data_path: Optional[str] = opt(None, "evaluation prompts; null = no evaluation")
    output_dir: str = opt("outputs", "run outputs: logs, checkpoints, resolved_config.yaml")
    colocation: list[list[str]] = opt([], "groups of models sharing devices, e.g. [[policy, policy_trainer]]")
    ray_address: Optional[str] = opt(None, "Ray cluster address; null = start a local Ray (when Ray is used)")
    launcher: Literal["auto", "local", "ray"] = opt(
        "auto", "ray: every model group runs as Ray actors; local: a run whose models share one process of one rank "
                "runs in the driver, without Ray; auto: local when possible (and no ray_address), else ray")
    seed: int = opt(1234, "global random seed")
    log_interval: int = opt(1, "log metrics every N training steps")
    allow_data_order_change: bool = opt(
        False, "on --resume, accept another seed / batch size / data file than the checkpoint's (its data position then "
               "applies to a different order); false = such a resume is refused")
    max_cut_prompt_fraction: float = opt(
        0.5, "stop before training when more than this share of the training prompts had to be cut to the prompt "
             "budget (seq_length - max_new_tokens); 1.0 = never")
    max_bad_train_steps: int = opt(
        3, "stop after this many optimizer steps in a row with a zero or non-finite gradient norm (training collapsed "
           "or diverged)")
    solved_reward: Optional[float] = opt(
        1.0, "a sample counts as solved (reward/solved, eval/solved) when its reward is at least this; null = not reported")
    algorithm: Any = opt(None, "the algorithm's section: `name` plus its own keys (docs/configuration.md lists them)")

    def check(self):
        if not 0 <= self.max_cut_prompt_fraction <= 1:
            yield "max_cut_prompt_fraction", f"must be in [0, 1], got {self.max_cut_prompt_fraction}; 1.0 turns it off"
        for key in ("num_episode", "sample_per_episode", "num_training_epoch", "train_micro_batch_size",
                    "generation_batch_size", "log_interval", "max_bad_train_steps"):
            if getattr(self, key) < 1:
                yield key, f"must be >= 1, got {getattr(self, key)}; set a positive integer"
        for key in ("train_global_batch_size", "save_episode_interval", "eval_episode_interval"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                yield key, f"must be >= 1 or null, got {getattr(self, key)}; use null to turn it off"
        gbs = self.train_global_batch_size or self.sample_per_episode
        if self.train_micro_batch_size >= 1 and gbs >= 1:
            if gbs % self.train_micro_batch_size:  # (that an episode is whole global batches: run.check_config)
                yield "train_global_batch_size", (f"{gbs} is not a multiple of train_micro_batch_size="
                                                  f"{self.train_micro_batch_size}; make it one")


@dataclasses.dataclass(kw_only=True)
class ModelEntry:
    backend: Literal["vllm", "megatron", "python"] = opt(
        REQUIRED, "vllm (generation), megatron (training, forward), python (user code, e.g. a rule reward)")
    model_config_file: Optional[str] = opt(None, "per-model YAML of flat keys, relative to the main YAML; null = none")
    model_class: Optional[str] = opt(None, "'package.module:ClassName' of the model; null = the backend's default "
                                           "(VLLMModule, MegatronModule; a python model must name its class)")
    trainable: bool = opt(False, "whether this model is trained (its weights are then synced to the generation model)")
    num_gpu: int = opt(0, "GPUs for this model (0 on CPU-only machines)")
    num_cpu: int = opt(1, "CPU cores for this model's actors")
    config: Any = opt(None, "per-model keys inline (win over model_config_file); once loaded: the typed config")
    config_dialect: Literal["chatgen", "chatlearn"] = opt(
        "chatgen", "how the per-model keys are read: chatgen (every key checked) or chatlearn (a ChatLearn YAML: Megatron-LM keys ignored, unknown keys -> args; docs/migrating_from_chatlearn.md)")

    def check(self):
        if self.trainable and self.backend == "vllm":
            yield "trainable", "a vllm model cannot be trained; set trainable: false or backend: megatron"
        if self.backend == "python" and not self.model_class:
            yield "model_class", ("a python model runs your class: set model_class: 'package.module:ClassName' (e.g. "
                                  "chatgen.rlhf.rewards:RuleReward)")
        if self.num_gpu < 0 or self.num_cpu < 0:
            yield "num_gpu" if self.num_gpu < 0 else "num_cpu", "must be >= 0; set a non-negative integer"


@dataclasses.dataclass(kw_only=True)
class VLLMConfig:
    load: Optional[str] = opt(None, "Hugging Face model directory to load (required by the vLLM module)")
    tokenizer: Optional[str] = opt(None, "tokenizer directory; null = the `load` directory")
    dtype: DTYPES = opt("float32", "weights and activations dtype")
    seed: int = opt(1234, "sampling seed")
    # prompts (build_dataset)
    prompt_template: Optional[str] = opt(
        None, "format of each text prompt before tokenizing, with {prompt}, e.g. 'Question: {prompt}\\nAnswer:'; null = as is")
    chat_template: bool = opt(False, "render each text prompt as one user message with the tokenizer's chat template "
                                     "(instruct models), after prompt_template")
    # sampling
    n: int = opt(1, "responses per prompt (the GRPO group size)")
    temperature: float = opt(1.0, "sampling temperature; 0 = greedy")
    top_p: float = opt(1.0, "nucleus sampling: keep the smallest token set with this much probability; 1.0 = off")
    top_k: int = opt(-1, "keep the k most likely tokens; -1 = off")
    min_p: float = opt(0.0, "drop tokens below min_p times the top token's probability; 0 = off")
    repetition_penalty: float = opt(
        1.0, "penalise tokens already in the prompt or response (positive logits divided by it, negative ones multiplied); > 1 discourages repeats, 1.0 = off")
    ignore_eos: bool = opt(False, "keep generating after EOS (until the token limit)")
    use_beam_search: bool = opt(False, "beam search instead of sampling")
    eval_temperature: Optional[float] = opt(None, "temperature in evaluation; null = temperature")
    eval_top_p: Optional[float] = opt(None, "top_p in evaluation; null = top_p")
    eval_top_k: Optional[int] = opt(None, "top_k in evaluation; null = top_k")
    stop_token_list: str = opt("", "stops separated by ';', e.g. '</answer>;\\n\\n'; a special token (e.g. '</s>') stops on its id; '' = EOS only")
    new_token_limit: bool = opt(False, "True: stop at max_new_tokens; False: generate until seq_length")
    max_new_tokens: int = opt(256, "generated tokens per response when new_token_limit is true")
    seq_length: Optional[int] = opt(
        None, "prompt + response tokens at most; null = the model's max_position_embeddings")
    prompt_logprobs: Optional[int] = opt(None, "logprobs of prompt tokens (top-N; 0 = the token only); null = off")
    logprobs_mode: Literal["raw", "processed"] = opt(
        "processed", "logprobs of the raw logits, or of the distribution after temperature/top-p/top-k")
    # scheduler
    max_num_batched_tokens: Optional[int] = opt(None, "tokens per engine step at most; null = vLLM's default")
    generation_batch_size: Optional[int] = opt(
        None, "sequences scheduled together per engine step (vLLM max_num_seqs; each prompt makes n); null = runtime.generation_batch_size in a run, vLLM's default (256) standalone")
    max_paddings: Optional[int] = opt(None, "old vLLM scheduler knob, not supported (vLLM V1 packs without padding)")
    # cache
    block_size: Optional[int] = opt(None, "KV cache block size in tokens; None = vLLM's default (128 on CPU, which needs a multiple of 32)")
    gpu_memory_utilization: float = opt(0.9, "fraction of GPU memory vLLM may use, in (0, 1]")
    swap_space: Optional[float] = opt(None, "old vLLM KV swap space (GiB), not supported (vLLM V1 recomputes preempted requests)")
    sliding_window: Optional[int] = opt(None, "sliding-window attention size; null = the model's own")
    kv_cache_memory_bytes: Optional[int] = opt(
        None, "KV cache size in bytes; null = from gpu_memory_utilization (on CPU the module picks a small size)")
    # parallelism
    tensor_parallel_size: int = opt(1, "tensor-parallel ranks of the engine")
    return_routed_experts: bool = opt(
        False, "record the experts each token was routed to (mixture-of-experts models) into RolloutBatch.routed_experts, "
               "for a trainer's moe_routing_replay; turns prefix caching off (a cached prompt is not routed again)")
    enforce_eager: bool = opt(False, "disable CUDA graphs / compilation (faster start, slower steps)")
    args: dict[str, Any] = opt({}, USER_KEYS_DOC)

    def check(self):
        if self.prompt_template is not None and "{prompt}" not in self.prompt_template:
            yield "prompt_template", (f"{self.prompt_template!r} has no {{prompt}}; write where the prompt goes, e.g. "
                                      "'Question: {prompt}\\nAnswer:'")
        if self.temperature < 0:
            yield "temperature", f"must be >= 0, got {self.temperature}; use 0 for greedy decoding"
        if self.eval_temperature is not None and self.eval_temperature < 0:
            yield "eval_temperature", f"must be >= 0, got {self.eval_temperature}; use 0 for greedy decoding"
        for key in ("top_p", "eval_top_p"):
            value = getattr(self, key)
            if value is not None and not 0 < value <= 1:
                yield key, f"must be in (0, 1], got {value}; use 1.0 to turn top-p off"
        for key in ("top_k", "eval_top_k"):
            value = getattr(self, key)
            if value is not None and (value == 0 or value < -1):
                yield key, f"must be -1 (off) or >= 1, got {value}; use -1 to turn top-k off"
        if not 0 <= self.min_p <= 1:
            yield "min_p", f"must be in [0, 1], got {self.min_p}; use 0 to turn min-p off"
        if self.repetition_penalty <= 0:
            yield "repetition_penalty", f"must be > 0, got {self.repetition_penalty}; use 1.0 to turn it off"
        if self.n < 1:
            yield "n", f"must be >= 1, got {self.n}; set responses per prompt"
        if self.max_new_tokens < 1:
            yield "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}; set a positive token count"
        elif self.seq_length is not None and self.max_new_tokens >= self.seq_length:
            yield "max_new_tokens", (f"{self.max_new_tokens} leaves no room for a prompt in seq_length="
                                     f"{self.seq_length}; raise seq_length or lower max_new_tokens")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            yield "prompt_logprobs", f"must be >= 0 or null, got {self.prompt_logprobs}; use null to turn it off"
        if self.max_paddings is not None:
            yield "max_paddings", ("not supported: vLLM's V1 scheduler packs sequences without padding; remove it "
                                   "and bound a step with max_num_batched_tokens instead")
        # Keys vLLM V1 cannot honour: rejected here, with the fix, so they come out with every other error.
        if self.swap_space is not None:
            yield "swap_space", ("not supported: vLLM V1 recomputes preempted requests instead of swapping their KV "
                                 "cache to CPU; remove the key (size the KV cache with gpu_memory_utilization or "
                                 "kv_cache_memory_bytes)")
        if self.sliding_window is not None:
            yield "sliding_window", ("not supported: vLLM V1 takes the sliding window from the model's config.json; "
                                     "remove the key and set `sliding_window` there")
        if self.use_beam_search:
            yield "use_beam_search", ("not supported: vLLM V1 has no beam search in its step-driven engine "
                                      "(LLM.beam_search is a separate offline API); set it to false and use n > 1 "
                                      "sampling")
        if self.temperature == 0 and self.n > 1:
            yield "n", (f"n={self.n} with temperature 0 would give {self.n} identical responses (vLLM rejects it); "
                        "set temperature > 0 or n: 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            yield "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}; 0.9 is usual"
        for key in ("block_size", "tensor_parallel_size"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                yield key, f"must be >= 1, got {getattr(self, key)}; set a positive integer"
        for key in ("max_num_batched_tokens", "generation_batch_size", "sliding_window", "kv_cache_memory_bytes"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                yield key, f"must be >= 1 or null, got {getattr(self, key)}; use null for the default"
        if problem := args_problem(self):
            yield "args", problem


@dataclasses.dataclass(kw_only=True)
class MegatronConfig:
    load: Optional[str] = opt(None, "Hugging Face model directory or Megatron checkpoint to start from")
    dtype: DTYPES = opt("float32", "parameter and compute dtype (bfloat16/float16: the optimizer keeps fp32 masters)")
    seed: int = opt(1234, "initialisation and dropout seed")
    tensor_model_parallel_size: int = opt(1, "tensor-parallel ranks")
    pipeline_model_parallel_size: int = opt(1, "pipeline-parallel stages")
    expert_model_parallel_size: int = opt(
        1, "expert-parallel ranks of a mixture-of-experts model: each holds num_experts / EP experts of every layer "
           "(taken out of the data-parallel ranks: world = TP x PP x DP, EP divides DP)")
    moe_aux_loss_coeff: float = opt(
        0.0, "weight of the router load-balancing loss (Switch Transformer's) of a mixture-of-experts model, added "
             "to train_step's loss; 0 = none")
    moe_routing_replay: bool = opt(
        False, "compute every MoE layer with the experts the engine chose for each token (the batch's routed_experts: "
               "the vllm model needs return_routed_experts) instead of routing again")
    seq_length: Optional[int] = opt(
        None, "longest sample (prompt + response) in tokens; longer batches are an error; null = max_position_embeddings")
    micro_batch_size: Optional[int] = opt(None, "samples per forward/backward; null = runtime.train_micro_batch_size")
    global_batch_size: Optional[int] = opt(
        None, "samples per optimizer step over all DP ranks (train_step checks it); null = runtime.train_global_batch_size")
    pack_shared_prefix: bool = opt(
        True, "train_step runs each prompt a group's samples share once (one packed row per group; same loss and "
              "gradients); false = one row per sample")
    lr: float = opt(1e-6, "peak learning rate")
    min_lr: float = opt(0.0, "learning rate at the end of the decay")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.999, "AdamW beta2")
    adam_eps: float = opt(1e-8, "AdamW epsilon")
    clip_grad: float = opt(1.0, "clip the global gradient norm to this; 0 = no clipping")
    lr_warmup_iters: int = opt(0, "optimizer steps of linear warm-up")
    lr_decay_iters: Optional[int] = opt(None, "optimizer steps of cosine decay from lr to min_lr after warm-up; null = constant lr")
    make_vocab_size_divisible_by: int = opt(128, "pad the embedding rows to a multiple of this (times TP size)")
    args: dict[str, Any] = opt({}, USER_KEYS_DOC)

    def check(self):
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                    "make_vocab_size_divisible_by"):
            if getattr(self, key) < 1:
                yield key, f"must be >= 1, got {getattr(self, key)}; set a positive integer"
        if self.seq_length is not None and self.seq_length < 1:
            yield "seq_length", f"must be >= 1 or null, got {self.seq_length}; null takes max_position_embeddings"
        for key in ("micro_batch_size", "global_batch_size"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                yield key, f"must be >= 1 or null, got {getattr(self, key)}; null takes the runtime's value"
        if self.micro_batch_size and self.global_batch_size and self.global_batch_size % self.micro_batch_size:
            yield "global_batch_size", (f"{self.global_batch_size} is not a multiple of micro_batch_size="
                                        f"{self.micro_batch_size}; make it one")
        if not 0 < self.lr <= 1:
            yield "lr", f"must be in (0, 1], got {self.lr}; LLM fine-tuning uses about 1e-7 to 1e-3 (e.g. 1e-6)"
        if not 0 <= self.min_lr <= self.lr:
            yield "min_lr", f"must be in [0, lr={self.lr}], got {self.min_lr}; lower it"
        for key in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) < 1:
                yield key, f"must be in [0, 1), got {getattr(self, key)}; 0.9 / 0.999 are usual"
        for key in ("weight_decay", "adam_eps", "clip_grad", "lr_warmup_iters", "moe_aux_loss_coeff"):
            if getattr(self, key) < 0:
                yield key, f"must be >= 0, got {getattr(self, key)}; set a non-negative value"
        if problem := args_problem(self):
            yield "args", problem


# backend -> schema of its per-model YAML; `dict` = free mapping of user keys (not validated). A python model's
# schema is its class's `config_class` (chatgen.Module), resolved by the loader from `model_class`.
SCHEMAS = {"vllm": VLLMConfig, "megatron": MegatronConfig, "python": dict}
# backend -> the class a model entry without `model_class` runs (a python model must name its class)
DEFAULT_MODEL_CLASSES = {"vllm": "chatgen.generation.vllm_module:VLLMModule",
                         "megatron": "chatgen.training.megatron_module:MegatronModule"}


@dataclasses.dataclass
class ChatgenConfig:
    """A loaded main config: `runtime` and the `models` (each entry's `.config` holds its typed per-model config)."""

    runtime: RuntimeConfig
    models: dict[str, ModelEntry]
    path: Optional[str] = None  # the main YAML
    overrides: list[str] = dataclasses.field(default_factory=list)  # command-line key=value, as given
    files: list[str] = dataclasses.field(default_factory=list)  # every YAML read (main, includes, model files)
