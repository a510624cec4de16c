"""The main YAML's schema: `runtime:` (RuntimeConfig, with the algorithm's section:
AlgorithmConfig), `models:` (ModelEntry each), the roles an algorithm asks for (Role) and the loaded
whole (ChatgenConfig); which per-model schema and class a model entry's backend means.

chatgen.rlhf.config reads the YAML files into these (load_config); docs/configuration.md lists every
key.
"""

import dataclasses
import importlib.util
from typing import Any, Literal, Optional

from chatgen.config import REQUIRED, opt
from chatgen.config.typed import closest
from chatgen.generation.base import load_backend
from chatgen.rlhf.checks import backend_kind
from chatgen.training.config import FSDPConfig, MegatronConfig

LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")  # runtime.loggers (chatgen.rlhf.trackers)
TRAINER_CLASS = "chatgen.training.megatron_module:MegatronModule"
FSDP_TRAINER_CLASS = "chatgen.training.fsdp_module:FSDPModule"


def backend_schema(backend: str):
    """The per-model config dataclass of a megatron or generation backend (ValueError naming the
    choices)."""
    if backend == "megatron":
        return MegatronConfig
    if backend == "fsdp":
        return FSDPConfig
    try:
        return load_backend(backend).Config
    except ValueError as e:
        raise ValueError(
            f"{e}; or megatron / fsdp (a trainer), python (your class, model_class)"
        ) from None


def model_class(entry) -> str:
    """'package.module:ClassName' a model entry runs: its model_class, else its backend's default
    class."""
    if entry.model_class:
        return entry.model_class
    if entry.backend in ("megatron", "fsdp"):
        return TRAINER_CLASS if entry.backend == "megatron" else FSDP_TRAINER_CLASS
    return load_backend(entry.backend).MODULE


@dataclasses.dataclass(kw_only=True)
class AlgorithmConfig:
    """Base of every algorithm's own `runtime.algorithm:` section
    (chatgen/rlhf/algorithms/<name>.py: Config)."""

    name: str = opt(
        "grpo",
        "the algorithm: a module of chatgen/rlhf/algorithms (grpo, grpo_multiturn, ppo, dpo, "
        "online_dpo) or the dotted path of your own",
    )


@dataclasses.dataclass(frozen=True)
class Role:
    """A model an algorithm needs (its MODELS): which backend, whether it is trained, whether it
    may be left out, and the model its weights are synced into after each update."""

    # generation: any generation backend (vllm, hf, ...)
    backend: Literal["generation", "megatron", "python"]
    trainable: Optional[bool] = None  # True: must be trainable; False: must be frozen; None: either
    optional: bool = False
    syncs_to: Optional[str] = None  # e.g. policy_trainer -> "policy"
    # its token scores are of the policy's samples: it scores logits / the policy's temperature
    scores_samples: bool = False
    doc: str = ""


# the policy's trainable copy, as every policy-gradient algorithm declares it
POLICY_TRAINER = Role(
    "megatron",
    trainable=True,
    syncs_to="policy",
    scores_samples=True,
    doc="the policy's trainable copy",
)


@dataclasses.dataclass(kw_only=True)
class RuntimeConfig:
    num_episode: int = opt(
        1, "episodes to run; one episode = generate sample_per_episode samples, then train on them"
    )
    sample_per_episode: int = opt(16, "samples (prompt + response pairs) generated per episode")
    num_training_epoch: int = opt(1, "passes of the trainer over each episode's samples")
    train_micro_batch_size: int = opt(1, "samples per trainer forward/backward")
    train_global_batch_size: Optional[int] = opt(
        None, "samples per optimizer step; null = sample_per_episode"
    )
    generation_batch_size: int = opt(
        8,
        "sequences a vLLM engine runs together per step (its max_num_seqs); the default of every vllm model's generation_batch_size",
    )
    save_episode_interval: Optional[int] = opt(
        None, "save a checkpoint every N episodes; null = never"
    )
    eval_episode_interval: Optional[int] = opt(
        None, "evaluate on eval_data_path every N episodes; null = never"
    )
    data_path: Optional[str] = opt(
        None, "training prompts (relative paths: to the current directory)", path=True
    )
    eval_data_path: Optional[str] = opt(None, "evaluation prompts; null = no evaluation", path=True)
    prompt_key: str = opt(
        "prompt",
        "the data column holding each text prompt (verl: data.prompt_key; OpenRLHF: --input_key)",
    )
    messages_key: Optional[str] = opt(
        None,
        "the data column holding each prompt as a chat, a list of {role, content} messages "
        "rendered with the policy's chat template (used instead of prompt_key); null = text "
        "prompts",
    )
    answer_key: Optional[str] = opt(
        None,
        "the data column holding the reference answer, given to the reward as `answer` "
        "(OpenRLHF: --label_key); null = the `answer` column where there is one",
    )
    overlong_prompts: Literal["cut", "drop", "error"] = opt(
        "cut",
        "prompts longer than the policy's budget (seq_length - max_new_tokens): cut (keep "
        "their beginning; max_cut_prompt_fraction stops the run), drop (counted in the "
        "log), error (refuse the data); verl: data.filter_overlong_prompts / "
        "data.truncation",
    )
    output_dir: str = opt(
        "outputs", "run outputs: logs, checkpoints, resolved_config.yaml", path=True
    )
    loggers: list[str] = opt(
        ["jsonl", "tensorboard"],
        "where metrics go: jsonl (metrics.jsonl, always on), "
        "tensorboard, wandb, mlflow (each library imported only when "
        "named; verl: trainer.logger)",
    )
    project_name: str = opt(
        "chatgen", "the wandb project / mlflow experiment of the run (verl: trainer.project_name)"
    )
    experiment_name: Optional[str] = opt(
        None,
        "the wandb / mlflow run name (verl: trainer.experiment_name); null = output_dir's "
        "last part",
    )
    colocation: list[list[str]] = opt(
        [], "groups of models sharing devices, e.g. [[policy, policy_trainer]]"
    )
    ray_address: Optional[str] = opt(
        None,
        "Ray cluster address; null = the RAY_ADDRESS variable if set (as `ray job "
        "submit` sets it), else a local Ray (when Ray is used)",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK"] = opt(
        "PACK",
        "how Ray places each group's ranks on nodes: PACK (as few nodes as possible), SPREAD (across nodes), "
        "STRICT_PACK (one node per group, or fail); ranks are ordered node by node either way",
    )
    launcher: Literal["auto", "local", "ray"] = opt(
        "auto",
        "ray: every model group runs as Ray actors; local: a run whose models share one process of one rank "
        "runs in the driver, without Ray; auto: local when possible (and no ray_address), else ray",
    )
    seed: int = opt(1234, "global random seed")
    log_interval: int = opt(1, "log metrics every N training steps")
    allow_data_order_change: bool = opt(
        False,
        "on --resume, accept another seed / batch size / data file than the checkpoint's (its data position then "
        "applies to a different order); false = such a resume is refused",
    )
    max_cut_prompt_fraction: float = opt(
        0.5,
        "stop before training when more than this share of the training prompts had to be cut to the prompt "
        "budget (seq_length - max_new_tokens); 1.0 = never",
    )
    max_bad_train_steps: int = opt(
        3,
        "stop after this many optimizer steps in a row with a non-finite loss or gradient norm, "
        "or as many episodes in a row whose log-prob mismatch is not finite or jumped (training "
        "diverged)",
    )
    eval_greedy: bool = opt(
        False,
        "also evaluate each held-out prompt with one greedy response (eval/greedy/*), "
        "beside the eval_n samples of the policy's eval sampling keys",
    )
    solved_reward: Optional[float] = opt(
        1.0,
        "a sample counts as solved (reward/solved, eval/solved) when its reward is at least this; null = not reported",
    )
    algorithm: Any = opt(
        None, "the algorithm's section: `name` plus its own keys (docs/configuration.md lists them)"
    )

    def check(self):
        for name in self.loggers:
            if name not in LOGGERS:
                yield "loggers", f"unknown logger {name!r}; {closest(name, LOGGERS, 'loggers')}"
            elif name in ("wandb", "mlflow") and importlib.util.find_spec(name) is None:
                package = "mlflow-skinny" if name == "mlflow" else name
                yield (
                    "loggers",
                    (
                        f"{name} is not installed; pip install {package}, or take {name} "
                        "out of the list"
                    ),
                )
        if not 0 <= self.max_cut_prompt_fraction <= 1:
            yield (
                "max_cut_prompt_fraction",
                f"must be in [0, 1], got {self.max_cut_prompt_fraction}; 1.0 turns it off",
            )
        for key in (
            "num_episode",
            "sample_per_episode",
            "num_training_epoch",
            "train_micro_batch_size",
            "generation_batch_size",
            "log_interval",
            "max_bad_train_steps",
        ):
            if getattr(self, key) < 1:
                yield key, f"must be >= 1, got {getattr(self, key)}; set a positive integer"
        for key in ("train_global_batch_size", "save_episode_interval", "eval_episode_interval"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                yield (
                    key,
                    f"must be >= 1 or null, got {getattr(self, key)}; use null to turn it off",
                )
        gbs = self.train_global_batch_size or self.sample_per_episode
        if self.train_micro_batch_size >= 1 and gbs >= 1:
            # (that an episode is whole global batches: run.check_config)
            if gbs % self.train_micro_batch_size:
                yield (
                    "train_global_batch_size",
                    (
                        f"{gbs} is not a multiple of train_micro_batch_size="
                        f"{self.train_micro_batch_size}; make it one"
                    ),
                )


@dataclasses.dataclass(kw_only=True)
class ModelEntry:
    backend: str = opt(
        REQUIRED,
        "a generation backend (vllm; hf: transformers, the reference), megatron or fsdp (training, "
        "forward: docs/fsdp_backend.md), or "
        "python (user code, e.g. a rule reward); a generation backend of your own: its module's dotted path",
    )
    model_config_file: Optional[str] = opt(
        None, "per-model YAML of flat keys, relative to the main YAML; null = none"
    )
    model_class: Optional[str] = opt(
        None,
        "'package.module:ClassName' of the model; null = the backend's default "
        "(VLLMModule for vllm, MegatronModule; a python model must name its class)",
    )
    trainable: bool = opt(
        False, "whether this model is trained (its weights are then synced to the generation model)"
    )
    num_gpu: int = opt(0, "GPUs for this model (0 on CPU-only machines)")
    num_cpu: int = opt(1, "CPU cores for this model's actors")
    num_replicas: int = opt(
        1,
        "generation models: engines the prompts are spread over, each of tensor_parallel_size ranks; colocated "
        "with a trainer, num_replicas x tensor_parallel_size = the trainer's ranks (docs/scaling.md)",
    )
    resources: dict[str, float] = opt(
        {},
        "custom Ray resources each rank of this model needs, e.g. {trainer_node: 1} "
        "for nodes started with `ray start --resources`; {} = none",
    )
    config: Any = opt(
        None, "per-model keys inline (win over model_config_file); once loaded: the typed config"
    )
    config_dialect: Literal["chatgen", "chatlearn"] = opt(
        "chatgen",
        "how the per-model keys are read: chatgen (every key checked) or chatlearn (a ChatLearn YAML: Megatron-LM keys ignored, unknown keys -> args; docs/migrating_from_chatlearn.md)",
    )

    def check(self):
        if self.trainable and backend_kind(self.backend) == "generation":
            yield (
                "trainable",
                f"a {self.backend} model cannot be trained; set trainable: false or backend: megatron",
            )
        if self.backend == "python" and not self.model_class:
            yield (
                "model_class",
                (
                    "a python model runs your class: set model_class: 'package.module:ClassName' (e.g. "
                    "chatgen.rlhf.rewards:RuleReward)"
                ),
            )
        if self.num_gpu < 0 or self.num_cpu < 0:
            yield (
                "num_gpu" if self.num_gpu < 0 else "num_cpu",
                "must be >= 0; set a non-negative integer",
            )
        if self.num_replicas < 1:
            yield "num_replicas", f"must be >= 1, got {self.num_replicas}; 1 is one engine"
        elif self.num_replicas > 1 and backend_kind(self.backend) != "generation":
            yield (
                "num_replicas",
                (
                    f"{self.num_replicas} replicas of a {self.backend} model; replicas are for generation "
                    "models (a Megatron model scales with num_gpu: data parallel); remove the key"
                ),
            )
        for key, amount in self.resources.items():
            if amount < 0:
                yield "resources", f"{key}: {amount} is negative; give the amount each rank needs"


@dataclasses.dataclass
class ChatgenConfig:
    """A loaded main config: `runtime` and the `models` (each entry's `.config` holds its typed
    per-model config)."""

    runtime: RuntimeConfig
    models: dict[str, ModelEntry]
    path: Optional[str] = None  # the main YAML
    # command-line key=value, as given
    overrides: list[str] = dataclasses.field(default_factory=list)
    # every YAML read (main, includes, model files)
    files: list[str] = dataclasses.field(default_factory=list)
