"""chatgen: RLHF post-training with a step-driven vLLM generation module and a Megatron-core trainer.

Install the tested environment with `bash scripts/setup_env.sh`; `pip install -e .` alone installs only the
package (the heavy stack is pinned in requirements.txt / requirements-gpu.txt).
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
    install_requires=["pyyaml", "safetensors", "sentencepiece", "tqdm"],
    entry_points={"console_scripts": ["chatgen=chatgen.cli:main"]},
)
