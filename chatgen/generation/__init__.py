"""vLLM generation: `VLLMModule` (vllm_module.py) driven step by step by the framework.

vllm_adapter.py is the only module touching vLLM internals; engine_config.py maps the per-model YAML to vLLM
arguments; batching.py builds token batches in and out; cli.py is `chatgen generate`; standalone.py is
`VLLMGeneration`, the generator any PyTorch trainer can use. Guides: docs/vllm_module.md, docs/vllm_generation.md.
Importing this package is cheap: vLLM loads with vllm_adapter / vllm_module.
"""
