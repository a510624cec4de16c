"""The peers' spellings, kept apart from chatgen's own names: ChatLearn's config dialect and module
calls (chatlearn.py), NeMo RL's generation calls and config keys (nemo_rl/), TRL's merged
VLLMGeneration (trl.py). Users call them as before (`VLLMModule` mixes ChatLearn's and NeMo RL's in;
`config_dialect: chatlearn` reads a ChatLearn YAML; `chatgen.compat.nemo_rl.VllmGeneration` and
`chatgen.compat.trl.VLLMGeneration` load their classes from chatgen.generation on first use);
chatgen's core never names them.
"""
